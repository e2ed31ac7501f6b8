"""The request bodies of the OpenAI-compatible API, as vLLM takes them: /v1/completions and
/v1/chat/completions parsed into the gateway's `GenerationRequest`s (one per prompt), and a failed
parse worded for the client.

Bodies are checked here for JSON types only; value ranges are the pipeline's (validation.py), so
the HTTP and gRPC doors reject the same values with the same messages. A field a body does not
declare goes to openai_fields' policy: inert, refused with a 400, or unknown and logged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.errors import InvalidRequest
from services.common.sampling_params import SamplingParams
from services.common.structured_output import StructuredOutput
from services.gateway.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldPolicy, check_undeclared
from services.gateway.request import GenerationRequest
from services.gateway.structured_requests import ResponseFormat, StructuredFields
from services.gateway.tools import Tool, ToolChoice, ToolPlan


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); known ones must have their JSON type.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False


class _GenerationBody(StructuredFields, _Body):
    """Fields both endpoints share. None means "not sent": the SamplingParams default applies."""

    model_config = ConfigDict(extra="allow", strict=True)  # undeclared fields: see check_undeclared
    undeclared_fields: ClassVar[dict[str, FieldPolicy]] = {}
    endpoint: ClassVar[str] = ""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label; accepted, and every caller is served alike
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many alternatives

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def check_undeclared(self) -> None:
        """Refuse (InvalidRequest) the fields sent that this server does not implement; log unknown ones."""
        check_undeclared(self.model_extra or {}, self.undeclared_fields, self.endpoint)
        if self.stream and self._prompt_logprobs() is not None:
            raise InvalidRequest(self._prompt_logprobs_param(), "prompt logprobs are returned on whole "
                                 "responses only; send stream: false")

    def generation_requests(self, request_id: str, default_salt: str, default_max_tokens: int) -> list[GenerationRequest]:
        """The pipeline's requests for this body, one per prompt."""
        return [self._generation_request(request_id, default_salt, default_max_tokens)]

    def _generation_request(self, request_id: str, default_salt: str, default_max_tokens: int) -> GenerationRequest:
        """The pipeline's request for this body but its prompt (the subclass's)."""
        return GenerationRequest(
            sampling=self._sampling(default_max_tokens),
            model=self.model,
            stop=self.stop_strings,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            cache_salt=default_salt if self.cache_salt is None else self.cache_salt,
            request_id=request_id,
        )

    def param_name(self, field_name: str) -> str:
        """The body's name for a field the pipeline names in an InvalidRequest."""
        return field_name

    def _sampling(self, default_max_tokens: int) -> SamplingParams:
        sent = {
            "max_tokens": self._max_tokens(), "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed, "logprobs": self._logprobs(),
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "prompt_logprobs": self._prompt_logprobs(),
        }
        values = {name: value for name, value in sent.items() if value is not None}
        return SamplingParams(**{"max_tokens": default_max_tokens, **values},
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens, structured=self._structured(),
                              logit_bias=self.logit_bias_pairs())

    def _structured(self) -> StructuredOutput | None:
        return self.structured_output()

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _prompt_logprobs_param(self) -> str:
        return "prompt_logprobs"


class CompletionRequest(_GenerationBody):
    """POST /v1/completions. `prompt` is a text, token ids, or a list of either: one request per
    prompt, whose choices are numbered prompt by prompt (choice i of prompt p has index p * n + i)."""

    undeclared_fields: ClassVar[dict[str, FieldPolicy]] = COMPLETION_FIELDS
    endpoint: ClassVar[str] = "/v1/completions"

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, as texts and token-id lists."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def check_undeclared(self) -> None:
        super().check_undeclared()
        if self.best_of is not None and self.best_of != self.num_choices:
            raise InvalidRequest("best_of", f"must equal n ({self.num_choices}): every sample is returned, "
                                 "none is ranked out")

    def generation_requests(self, request_id: str, default_salt: str, default_max_tokens: int) -> list[GenerationRequest]:
        requests = []
        for index, prompt in enumerate(self.prompts):
            request = self._generation_request(request_id if index == 0 else f"{request_id}-p{index}",
                                               default_salt, default_max_tokens)
            if isinstance(prompt, str):
                request.prompt = prompt
            else:
                request.token_ids = list(prompt)
            request.prompt_only = self._prompt_only
            requests.append(request)
        return requests

    def param_name(self, field_name: str) -> str:
        return "prompt" if field_name == "token_ids" else field_name

    @property
    def _prompt_only(self) -> bool:
        return bool(self.echo) and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        """echo with max_tokens 0 generates one token, hidden (GenerationRequest.prompt_only)."""
        return 1 if self._prompt_only else self.max_tokens

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs_param(self) -> str:
        return "prompt_logprobs" if self.prompt_logprobs is not None else "echo"

    def _prompt_logprobs(self) -> int | None:
        """vLLM's prompt_logprobs, or with echo the legacy logprobs' count: the echoed prompt's
        tokens come with their logprobs (the more alternatives of the two)."""
        echoed = self.logprobs if self.echo else None
        sent = [n for n in (self.prompt_logprobs, echoed) if n is not None]
        return max(sent) if sent else None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class AssistantToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it: "role" and "content" (text parts joined),
        and the tool fields that were sent."""
        content = "".join(part.text for part in self.content) if isinstance(self.content, list) else self.content
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the older `max_tokens`."""

    undeclared_fields: ClassVar[dict[str, FieldPolicy]] = CHAT_FIELDS
    endpoint: ClassVar[str] = "/v1/chat/completions"

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @property
    def tool_plan(self) -> ToolPlan | None:
        """How this request uses tools (None: it sent none); InvalidRequest when the fields disagree."""
        return ToolPlan.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _generation_request(self, request_id: str, default_salt: str, default_max_tokens: int) -> GenerationRequest:
        request = super()._generation_request(request_id, default_salt, default_max_tokens)
        request.messages = [message.as_dict() for message in self.messages]
        plan = self.tool_plan
        if plan is not None:
            request.tools = plan.template_tools()
        # As OpenAI and vLLM: a chat reply without a limit may use the rest of the context.
        request.max_tokens_to_context = self._max_tokens() is None
        return request

    def param_name(self, field_name: str) -> str:
        if field_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if field_name == "logprobs" else field_name

    def _structured(self) -> StructuredOutput | None:
        """response_format or the vLLM fields, or the schema that forces a required or named tool call."""
        asked = self.structured_output_with(self.response_format)
        plan = self.tool_plan
        forced = None if plan is None else plan.structured_output()
        if forced is not None and asked is not None:
            raise InvalidRequest("tool_choice", "a required or named tool call cannot be combined with another "
                                                "structured output; send one of them")
        return forced or asked

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """POST /tokenize, as vLLM takes it: a text `prompt`, or chat `messages` (and their `tools`)
    rendered by the chat template as /v1/chat/completions would."""

    model_config = ConfigDict(extra="forbid", strict=True)  # a small API: a field it lacks is a mistake

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None

    def generation_request(self) -> GenerationRequest:
        messages = None if self.messages is None else [message.as_dict() for message in self.messages]
        tools = None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]
        return GenerationRequest(model=self.model, prompt=self.prompt, messages=messages, tools=tools)


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text, special tokens included."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = ""
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class BodyError:
    """Why a body could not be parsed: the message, the field it names (None for the whole body)."""

    message: str
    param: str | None
    code: str


def body_error(error: ValidationError) -> BodyError:
    """The first problems of a failed parse, in one message naming the first field."""
    problems = error.errors(include_url=False)
    first = problems[0]
    if first["type"] == "json_invalid":
        return BodyError(f"the request body is not valid JSON: {first['ctx']['error']}", None, "invalid_json")
    if not first["loc"]:
        return BodyError(f"the request body must be a JSON object: {first['msg']}", None, "invalid_json")
    text = "; ".join(f"{_location(p['loc'])}: {_plain_message(p['msg'])}" for p in problems[:3])
    return BodyError(text, str(first["loc"][0]), "invalid_type")


def _location(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _plain_message(message: str) -> str:
    return re.sub(r"^(Value error|Assertion failed), ", "", message)
