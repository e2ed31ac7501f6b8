"""A request's output as the gateway returns it: token events in, typed `Chunk`s out.

`OutputAssembler` detokenizes incrementally (UTF-8 safe), applies stop strings token by token so a
match cuts the text and the tokens exactly, and keeps the token accounting for the usage. As in
vLLM, the stop token that ends a request (EOS or one of stop_token_ids) is among the tokens but
not in the text, unless include_stop_str_in_output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.sampling_params import SamplingParams
from services.common.tokenizer import TextCodec
from services.common.wire import FINISH_REASON_FROM_PROTO
from services.gateway.stop_strings import StopStringMatcher
from tandem.v1 import common_pb2, scheduler_pb2


@dataclass(slots=True)
class Chunk:
    """One step of a generation stream: the tokens since the previous chunk and their text.

    The last chunk has `finish_reason` ("stop" | "length" | "abort") and `usage`; a "stop" says
    what stopped it in `stop_token_id` or `stop_string`. `text` may lag `token_ids` while a
    character or a possible stop string is incomplete.
    """

    token_ids: list[int]
    text: str
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int | None = None
    stop_string: str | None = None
    usage: common_pb2.Usage | None = None
    timings: common_pb2.RequestTimings | None = None
    # The first chunk of a request asking for them: one entry per prompt token, the first without a
    # logprob (nothing precedes it).
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How a request's output is turned into text."""

    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_only: bool = False  # GenerationRequest.prompt_only: no generated token is shown or counted


class OutputAssembler:
    """Turns one request's token events, in output order, into chunks.

    After `finished` is set (a finish reason arrived or a stop string matched) the request's
    upstream work is no longer wanted: the caller cancels it and ignores later events.
    """

    def __init__(self, codec: TextCodec, options: OutputOptions, prompt_token_ids: list[int]) -> None:
        self._options = options
        self._detokenizer = codec.incremental(options.skip_special_tokens)
        self._stops = StopStringMatcher(options.stop, options.include_stop_str_in_output)
        self._searches = self._stops.searches  # fixed for the request: read once, not per event
        ends = set(options.sampling.stop_token_ids)
        self._stop_token_ids = ends if options.sampling.ignore_eos else ends | set(codec.eos_token_ids)
        self._num_prompt_tokens = len(prompt_token_ids)
        self._first_prompt_token = prompt_token_ids[0]
        self._num_output_tokens = 0
        self._last_token_id: int | None = None
        self._cached_tokens = 0
        self.finished = False

    def on_event(self, event: scheduler_pb2.TokenEvent) -> Chunk | None:
        """The chunk for one event; None when it carries nothing to send."""
        if event.HasField("usage"):
            self._cached_tokens = event.usage.cached_tokens
        chunk = Chunk([], "", timings=event.timings if event.HasField("timings") else None)
        if event.prompt_logprobs:
            chunk.prompt_logprobs = [common_pb2.TokenLogprob(token_id=self._first_prompt_token),
                                     *event.prompt_logprobs]
        if self._options.prompt_only:
            return self._prompt_only(chunk, event)
        if not self._searches:
            self._add_all(chunk, event)
        elif self._add_each(chunk, event):
            return chunk  # a stop string ended the output
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._finish(chunk, event)
        return chunk if chunk.token_ids or chunk.text or chunk.finish_reason or chunk.prompt_logprobs else None

    def _prompt_only(self, chunk: Chunk, event: scheduler_pb2.TokenEvent) -> Chunk | None:
        """The prompt's logprobs and the end, as if max_tokens were 0: the token generated for them is dropped."""
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self._end(chunk, "length", common_pb2.Usage(prompt_tokens=self._num_prompt_tokens,
                                                        cached_tokens=self._cached_tokens, completion_tokens=0))
        return chunk if chunk.finish_reason or chunk.prompt_logprobs else None

    def _ends_on_stop_token(self, event: scheduler_pb2.TokenEvent) -> bool:
        """The event's last token is the stop token that finishes the request."""
        return (event.finish_reason == common_pb2.FINISH_REASON_STOP and bool(event.token_ids)
                and event.token_ids[-1] in self._stop_token_ids)

    def _add_each(self, chunk: Chunk, event: scheduler_pb2.TokenEvent) -> bool:
        """An event's tokens one by one through the stop strings; whether one of them ended the output."""
        last = len(event.token_ids) - 1
        for index, token_id in enumerate(event.token_ids):
            shown = not (index == last and self._ends_on_stop_token(event))
            self._add_token(chunk, token_id, event.logprobs[index] if event.logprobs else None, shown)
            if self.finished:
                return True
        return False

    def _add_all(self, chunk: Chunk, event: scheduler_pb2.TokenEvent) -> None:
        """An event's tokens in one go, as `_add_token` adds them one by one: without stop strings
        nothing ends the output inside an event, and the text of the tokens is their joined deltas."""
        token_ids = event.token_ids[:]  # a list; a slice of the repeated field costs less than list() of it
        if not token_ids:
            return
        chunk.token_ids.extend(token_ids)
        if logprobs := event.logprobs:
            chunk.logprobs.extend(logprobs)
        self._num_output_tokens += len(token_ids)
        self._last_token_id = token_ids[-1]
        if self._ends_on_stop_token(event) and not self._options.include_stop_str_in_output:
            token_ids.pop()  # the stop token is not in the text
        chunk.text += self._detokenizer.push(token_ids)

    def _add_token(self, chunk: Chunk, token_id: int, logprob: common_pb2.TokenLogprob | None, shown: bool) -> None:
        chunk.token_ids.append(token_id)
        if logprob is not None:
            chunk.logprobs.append(logprob)
        self._num_output_tokens += 1
        self._last_token_id = token_id
        if shown or self._options.include_stop_str_in_output:
            self._push_text(chunk, self._detokenizer.push([token_id]))

    def _push_text(self, chunk: Chunk, text: str) -> None:
        """Adds text through the stop strings, which apply once min_tokens are out (as in vLLM)."""
        match = self._stops.push(text, check=self._num_output_tokens >= self._options.sampling.min_tokens)
        chunk.text += match.text
        if match.stop is not None:
            chunk.stop_string = match.stop
            self._end(chunk, "stop", self._usage())

    def _finish(self, chunk: Chunk, event: scheduler_pb2.TokenEvent) -> None:
        self._push_text(chunk, self._detokenizer.flush())
        if self.finished:
            return
        chunk.text += self._stops.flush()
        reason = FINISH_REASON_FROM_PROTO[event.finish_reason]
        if reason == "stop" and self._last_token_id in self._stop_token_ids:
            chunk.stop_token_id = self._last_token_id
        self._end(chunk, reason, event.usage if event.HasField("usage") else self._usage())

    def _end(self, chunk: Chunk, reason: str, usage: common_pb2.Usage) -> None:
        chunk.finish_reason = reason
        chunk.usage = usage
        self.finished = True

    def _usage(self) -> common_pb2.Usage:
        """Usage counted here, when the request ends before the workers' final event."""
        return common_pb2.Usage(prompt_tokens=self._num_prompt_tokens, cached_tokens=self._cached_tokens,
                                completion_tokens=self._num_output_tokens)
