"""The OpenAI-compatible wire format, as vLLM serves it: request bodies of /v1/completions and
/v1/chat/completions (parsed into the gateway's `GenerationRequest`) and the JSON of responses,
stream chunks, usage and logprobs (errors: http_errors.py).

Bodies are checked here for JSON types only; value ranges are the pipeline's (validation.py), so
the HTTP and gRPC doors reject the same values with the same messages.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from services.common.errors import InvalidRequest
from services.common.sampling_params import SamplingParams
from services.gateway.output import Chunk
from services.gateway.request import GenerationRequest
from tandem.v1 import common_pb2

TokenText = Callable[[int], str]  # a token id's own text, for logprobs


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); known ones must have their JSON type.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False


class _GenerationBody(_Body):
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
                              min_tokens=self.min_tokens)

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


def usage_body(usages: list[common_pb2.Usage]) -> dict[str, Any]:
    """Usage of the n choices of one prompt: the prompt (and its cached part) counted once, as
    OpenAI bills it, from the first choice, which computed it; completion tokens summed."""
    prompt, cached = (usages[0].prompt_tokens, usages[0].cached_tokens) if usages else (0, 0)
    completion = sum(usage.completion_tokens for usage in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass(slots=True)
class Choice:
    """One choice's output collected from its chunks (for a non-streaming response)."""

    index: int
    text: str = ""
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: common_pb2.Usage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = stop_reason(chunk)
            self.usage = chunk.usage


def stop_reason(chunk: Chunk) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the choice (None for EOS
    and length)."""
    return chunk.stop_string if chunk.stop_string is not None else chunk.stop_token_id


class ResponseShaper:
    """Builds the JSON of one response (id, created, model) for either endpoint; the subclass
    says how a choice's text and logprobs look."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, created: int, model: str, token_text: TokenText,
                 with_logprobs: bool) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.with_logprobs = with_logprobs

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._header(self.object_name),
                "choices": [self._final_choice(choice) for choice in choices],
                "usage": usage_body([choice.usage for choice in choices if choice.usage is not None])}

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (the chat role)."""
        return []

    def chunk(self, index: int, chunk: Chunk) -> dict[str, Any] | None:
        """The stream chunk for one pipeline chunk; None when it has nothing to show."""
        if not (chunk.text or chunk.finish_reason or (self.with_logprobs and chunk.logprobs)):
            return None
        choice = {"index": index, **self._delta(chunk.text),
                  "logprobs": self._logprobs(index, chunk.logprobs) if self.with_logprobs else None,
                  "finish_reason": chunk.finish_reason, "stop_reason": stop_reason(chunk)}
        return {**self._header(self.chunk_object_name), "choices": [choice]}

    def usage_chunk(self, usages: list[common_pb2.Usage]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the usage."""
        return {**self._header(self.chunk_object_name), "choices": [], "usage": usage_body(usages)}

    def _header(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model}

    def _final_choice(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, **self._message(choice.text),
                "logprobs": self._logprobs(choice.index, choice.logprobs) if self.with_logprobs else None,
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}

    def _message(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, index: int, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShaper(ResponseShaper):
    """text_completion objects; logprobs in the legacy shape (tokens, token_logprobs,
    top_logprobs, text_offset), offsets running on across a choice's chunks."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}

    def _message(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def _logprobs(self, index: int, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
        tokens = [self.token_text(entry.token_id) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{self.token_text(top.token_id): top.logprob for top in entry.top_logprobs}
                             for entry in entries],
            "text_offset": offsets,
        }


class ChatShaper(ResponseShaper):
    """chat.completion objects; the stream opens with the assistant role for every choice."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        return [{**self._header(self.chunk_object_name),
                 "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]}
                for index in range(n)]

    def _message(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text} if text else {}}

    def _logprobs(self, index: int, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._token(entry.token_id, entry.logprob),
                             "top_logprobs": [self._token(top.token_id, top.logprob) for top in entry.top_logprobs]}
                            for entry in entries]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
