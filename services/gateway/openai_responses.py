"""The response JSON of the OpenAI-compatible API, as vLLM serves it: whole responses, stream
chunks, usage and logprobs of /v1/completions (with echo) and /v1/chat/completions (with tool
calls, read by tools.py), built from the pipeline's chunks (errors: http_errors.py); and the model
cards of /v1/models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.models import ModelEntry
from services.gateway.output import Chunk
from services.gateway.request import OWNED_BY
from services.gateway.tools import ToolCall, ToolCallReader, ToolDelta, ToolPlan
from tandem.v1 import common_pb2

TokenText = Callable[[int], str]  # a token id's own text, for logprobs


def usage_body(usages: list[common_pb2.Usage], n: int = 1) -> dict[str, Any]:
    """Usage of the choices of a request, n per prompt in index order: each prompt (and its cached
    part) counted once, as OpenAI bills it, from its first choice, which computed it; completion
    tokens summed."""
    firsts = usages[::n]
    prompt = sum(usage.prompt_tokens for usage in firsts)
    cached = sum(usage.cached_tokens for usage in firsts)
    completion = sum(usage.completion_tokens for usage in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def model_card(entry: ModelEntry) -> dict[str, Any]:
    """A model's (or an adapter's) card: OpenAI's keys, vLLM's `root`, `parent` (an adapter's base)
    and `max_model_len`, and Tandem's `resident` and `resident_workers` (workers holding it loaded)."""
    model = entry.model
    card: dict[str, Any] = {"id": entry.id, "object": "model", "created": model.created, "owned_by": OWNED_BY,
                            "root": model.name, "max_model_len": model.max_model_len}
    if entry.parent is not None:
        card["parent"] = entry.parent
    return {**card, "resident": entry.resident, "resident_workers": entry.resident_workers}


@dataclass(slots=True)
class Choice:
    """One choice's output collected from its chunks (for a non-streaming response)."""

    index: int
    text: str = ""
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: common_pb2.Usage | None = None
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None  # its prompt's, when asked (output.Chunk)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
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
                 with_logprobs: bool, n: int = 1, with_prompt_logprobs: bool = False) -> None:
        """`with_prompt_logprobs`: the request sent vLLM's prompt_logprobs (returned in its shape)."""
        self.response_id = response_id
        self.created = created
        self.model = model
        self.token_text = token_text
        self.with_logprobs = with_logprobs
        self.n = n  # choices per prompt
        self.with_prompt_logprobs = with_prompt_logprobs

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        return {**self._header(self.object_name),
                "choices": [self._final_choice(choice) for choice in choices],
                "usage": usage_body([choice.usage for choice in choices if choice.usage is not None], self.n)}

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any token (the chat role)."""
        return []

    def chunk(self, index: int, chunk: Chunk) -> dict[str, Any] | None:
        """The stream chunk for one pipeline chunk; None when it has nothing to show."""
        delta = self._delta(index, chunk)
        if not (any(delta.values()) or chunk.finish_reason or (self.with_logprobs and chunk.logprobs)):
            return None
        choice = {"index": index, **delta,
                  "logprobs": self._logprobs(index, chunk.logprobs) if self.with_logprobs else None,
                  "finish_reason": self._finish_reason(index, chunk.finish_reason), "stop_reason": stop_reason(chunk)}
        return {**self._header(self.chunk_object_name), "choices": [choice]}

    def only_text(self, index: int, chunk: Chunk) -> bool:
        """Whether the stream chunk for `chunk` is the choice's text and nothing else that varies
        (no finish, logprobs or prompt logprobs), so it differs from the choice's other such chunks
        only in the text: the SSE stream sends those from a template (sse.TextTemplates)."""
        return (chunk.finish_reason is None and chunk.prompt_logprobs is None and not self.with_logprobs
                and bool(chunk.text))

    def usage_chunk(self, usages: list[common_pb2.Usage]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: no choices, the usage."""
        return {**self._header(self.chunk_object_name), "choices": [], "usage": usage_body(usages, self.n)}

    def _header(self, object_name: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model}

    def _final_choice(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, **self._message(choice),
                "logprobs": self._choice_logprobs(choice) if self.with_logprobs else None,
                "finish_reason": self._finish_reason(choice.index, choice.finish_reason),
                "stop_reason": choice.stop_reason}

    def _choice_logprobs(self, choice: Choice) -> dict[str, Any]:
        return self._logprobs(choice.index, choice.logprobs)

    def _message(self, choice: Choice) -> dict[str, Any]:
        """The choice's output fields of a whole response."""
        raise NotImplementedError

    def prompt_logprobs_body(self, entries: list[common_pb2.TokenLogprob] | None) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then for each token a map from
        token id (as text) to its logprob and text: the prompt's token and the alternatives asked for."""
        if not entries:
            return []
        body: list[dict[str, Any] | None] = [None]
        for entry in entries[1:]:
            pairs = [(entry.token_id, entry.logprob), *((top.token_id, top.logprob) for top in entry.top_logprobs)]
            body.append({str(token_id): {"logprob": logprob, "decoded_token": self.token_text(token_id)}
                         for token_id, logprob in pairs})
        return body

    def _delta(self, index: int, chunk: Chunk) -> dict[str, Any]:
        """The choice's output fields of a stream chunk; all empty when it adds nothing."""
        raise NotImplementedError

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        return reason

    def _logprobs(self, index: int, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShaper(ResponseShaper):
    """text_completion objects; logprobs in the legacy shape (tokens, token_logprobs,
    top_logprobs, text_offset), offsets running on across a choice's chunks. With echo, each
    choice's text starts with its prompt's text (`echoes`, one per prompt)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any, echoes: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}
        self._echoes = echoes
        self._echoed: set[int] = set()  # stream: the choices whose prompt text was sent

    def _final_choice(self, choice: Choice) -> dict[str, Any]:
        body = super()._final_choice(choice)
        if self.with_prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs_body(choice.prompt_logprobs)
        return body

    def _choice_logprobs(self, choice: Choice) -> dict[str, Any]:
        """With echo, the legacy logprobs of the echoed prompt's tokens (the first one's null, as
        OpenAI's; offsets from the text's start) then the output's."""
        if self._echoes is None:
            return self._logprobs(choice.index, choice.logprobs)
        prompt = self._logprobs(choice.index, choice.prompt_logprobs or [])
        output = self._logprobs(choice.index, choice.logprobs)
        if prompt["tokens"]:
            prompt["token_logprobs"][0] = None
            prompt["top_logprobs"][0] = None
        return {key: prompt[key] + output[key] for key in prompt}

    def _message(self, choice: Choice) -> dict[str, Any]:
        return {"text": self._echo(choice.index) + choice.text}

    def only_text(self, index: int, chunk: Chunk) -> bool:
        """Also not the choice's first chunk with echo: that one starts with the prompt's text."""
        return super().only_text(index, chunk) and (self._echoes is None or index in self._echoed)

    def _delta(self, index: int, chunk: Chunk) -> dict[str, Any]:
        echo = "" if index in self._echoed else self._echo(index)
        self._echoed.add(index)
        return {"text": echo + chunk.text}

    def _echo(self, index: int) -> str:
        return "" if self._echoes is None else self._echoes[index // self.n]

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
    """chat.completion objects; the stream opens with the assistant role for every choice. With
    tools, each choice's text is read into content and `tool_calls` (tools.ToolCallReader), and a
    choice that called a tool without tool_choice naming it finishes with "tool_calls"."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolPlan | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tools = tools
        self._readers: dict[int, ToolCallReader] = {}

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        """With prompt_logprobs, vLLM's top-level list: the choices share the one prompt."""
        body = super().response(choices)
        if self.with_prompt_logprobs:
            body["prompt_logprobs"] = self.prompt_logprobs_body(choices[0].prompt_logprobs if choices else None)
        return body

    def opening_chunks(self, n: int) -> list[dict[str, Any]]:
        return [{**self._header(self.chunk_object_name),
                 "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]}
                for index in range(n)]

    def only_text(self, index: int, chunk: Chunk) -> bool:
        """Also not with tools: a chunk's text may then be (part of) a tool call."""
        return super().only_text(index, chunk) and self._tools is None

    def _message(self, choice: Choice) -> dict[str, Any]:
        if self._tools is None:
            return {"message": {"role": "assistant", "content": choice.text}}
        reader = self._reader(choice.index)
        read = _joined(reader.push(choice.text), reader.finish())
        if not read.calls:
            return {"message": {"role": "assistant", "content": read.content}}
        return {"message": {"role": "assistant", "content": read.content.strip() or None,
                            "tool_calls": [call.as_json() for call in read.calls]}}

    def _delta(self, index: int, chunk: Chunk) -> dict[str, Any]:
        if self._tools is None:
            return {"delta": {"content": chunk.text} if chunk.text else {}}
        reader = self._reader(index)
        before = reader.num_calls
        read = reader.push(chunk.text)
        if chunk.finish_reason is not None:
            read = _joined(read, reader.finish())
        delta: dict[str, Any] = {"content": read.content} if read.content else {}
        if read.calls:
            delta["tool_calls"] = [_call_delta(before + number, call) for number, call in enumerate(read.calls)]
        return {"delta": delta}

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        named = self._tools is not None and self._tools.forced and self._tools.choice != "required"
        called = index in self._readers and self._readers[index].num_calls > 0
        return "tool_calls" if reason == "stop" and called and not named else reason

    def _reader(self, index: int) -> ToolCallReader:
        assert self._tools is not None
        return self._readers.setdefault(index, ToolCallReader(self._tools))

    def _logprobs(self, index: int, entries: list[common_pb2.TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._token(entry.token_id, entry.logprob),
                             "top_logprobs": [self._token(top.token_id, top.logprob) for top in entry.top_logprobs]}
                            for entry in entries]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _joined(first: ToolDelta, second: ToolDelta) -> ToolDelta:
    return ToolDelta(first.content + second.content, first.calls + second.calls)


def _call_delta(number: int, call: ToolCall) -> dict[str, Any]:
    """A whole call as one stream delta, in OpenAI's shape (`index`: the call's number in the choice)."""
    return {"index": number, **call.as_json()}
