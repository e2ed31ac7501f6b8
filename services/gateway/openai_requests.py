"""The request bodies of the OpenAI-compatible API, as vLLM takes them: /v1/completions and
/v1/chat/completions parsed into the gateway's `GenerationRequest`, and a failed parse worded
for the client.

Bodies are checked here for JSON types only; value ranges are the pipeline's (validation.py), so
the HTTP and gRPC doors reject the same values with the same messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.common.errors import InvalidRequest
from services.common.sampling_params import SamplingParams
from services.common.structured_output import StructuredOutput
from services.gateway.request import GenerationRequest
from services.gateway.structured_requests import ResponseFormat, StructuredFields


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); known ones must have their JSON type.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False


class _GenerationBody(StructuredFields, _Body):
    """Fields both endpoints share. None means "not sent": the SamplingParams default applies."""

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
    user: str | None = None
    cache_salt: str | None = None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def generation_request(self, request_id: str, default_salt: str, default_max_tokens: int) -> GenerationRequest:
        """The pipeline's request for this body (the prompt fields are the subclass's)."""
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
            "repetition_penalty": self.repetition_penalty,
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


class CompletionRequest(_GenerationBody):
    """POST /v1/completions. `prompt` is text or token ids; a batch of one is unwrapped."""

    prompt: str | list[int]
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) > 1:
                raise ValueError("batches of prompts are not supported; send one prompt per request")
            return value[0]
        return value

    def generation_request(self, request_id: str, default_salt: str, default_max_tokens: int) -> GenerationRequest:
        request = super().generation_request(request_id, default_salt, default_max_tokens)
        if isinstance(self.prompt, str):
            request.prompt = self.prompt
        else:
            request.token_ids = list(self.prompt)
        return request

    def param_name(self, field_name: str) -> str:
        return "prompt" if field_name == "token_ids" else field_name

    def _logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        """{"role", "content"} as the chat template takes it; text parts are joined."""
        if isinstance(self.content, list):
            return {"role": self.role, "content": "".join(part.text for part in self.content)}
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the older `max_tokens`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    def generation_request(self, request_id: str, default_salt: str, default_max_tokens: int) -> GenerationRequest:
        request = super().generation_request(request_id, default_salt, default_max_tokens)
        request.messages = [message.as_dict() for message in self.messages]
        # As OpenAI and vLLM: a chat reply without a limit may use the rest of the context.
        request.max_tokens_to_context = self._max_tokens() is None
        return request

    def param_name(self, field_name: str) -> str:
        if field_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if field_name == "logprobs" else field_name

    def _structured(self) -> StructuredOutput | None:
        return self.structured_output_with(self.response_format)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs", "needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


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
