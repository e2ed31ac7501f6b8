"""The SDK's result types (chunks, completions, usage, logprobs, models) and their conversion from the wire.

Frozen records: the SDK hands them out and never changes them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.v1 import common_pb2, gateway_pb2

FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely alternatives at a sampled position."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one generated token and, when asked for, the top alternatives (most likely first)."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of a finished request; `cached_tokens` of the prompt came from the prefix cache."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    """Where the request spent its time on the servers, in milliseconds (0: stage not reached yet)."""

    queue_ms: float
    prefill_ms: float
    kv_transfer_ms: float
    time_to_first_token_ms: float
    decode_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class Chunk:
    """The tokens a stream produced since the previous chunk.

    `text` is UTF-8 safe, so it may lag `token_ids` by a partial character. `finish_reason`
    ("stop", "length", "abort", "error"), `stop_reason` (the stop token id or stop string) and
    `usage` are set on the last chunk only. Every chunk carries the request and trace ids.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    usage: Usage | None
    request_id: str
    trace_id: str
    stop_reason: int | str | None = None
    timings: Timings | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: the chunks of one stream joined."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    usage: Usage | None
    request_id: str
    trace_id: str
    stop_reason: int | str | None = None
    timings: Timings | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A served model: pass `id` as `model=`; prompt plus output must fit in `max_model_len` tokens.
    `resident_workers` workers hold it loaded now (none: the first request for it loads it)."""

    id: str
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    created: int
    owned_by: str
    resident: bool = False
    resident_workers: int = 0


class ChunkDecoder:
    """Turns the messages of one stream into Chunks, copying the first message's ids onto all of them."""

    def __init__(self) -> None:
        self.started = False
        self.request_id = ""
        self.trace_id = ""

    def decode(self, msg: gateway_pb2.GenerateResponse) -> Chunk:
        if not self.started:
            self.started, self.request_id, self.trace_id = True, msg.request_id, msg.trace_id
        return chunk_from_pb(msg, self.request_id, self.trace_id)


def chunk_from_pb(msg: gateway_pb2.GenerateResponse, request_id: str, trace_id: str) -> Chunk:
    """A wire message as a Chunk with the stream's ids."""
    return Chunk(
        text=msg.text,
        token_ids=list(msg.token_ids),
        logprobs=[_logprob_from_pb(lp) for lp in msg.logprobs],
        finish_reason=FINISH_REASONS.get(msg.finish_reason),
        usage=_usage_from_pb(msg.usage) if msg.HasField("usage") else None,
        request_id=request_id,
        trace_id=trace_id,
        stop_reason=_stop_reason(msg),
        timings=_timings_from_pb(msg.timings) if msg.HasField("timings") else None,
    )


def model_from_pb(card: gateway_pb2.ModelCard) -> ModelInfo:
    return ModelInfo(id=card.id, max_model_len=card.max_model_len, vocab_size=card.vocab_size,
                     has_chat_template=card.has_chat_template, created=card.created, owned_by=card.owned_by,
                     resident=card.resident, resident_workers=card.resident_workers)


class CompletionBuilder:
    """Joins the chunks of one stream, in order, into a Completion."""

    def __init__(self) -> None:
        self._chunks: list[Chunk] = []

    def add(self, chunk: Chunk) -> None:
        self._chunks.append(chunk)

    def build(self) -> Completion:
        last = self._chunks[-1] if self._chunks else None
        return Completion(
            text="".join(chunk.text for chunk in self._chunks),
            token_ids=[token for chunk in self._chunks for token in chunk.token_ids],
            logprobs=[logprob for chunk in self._chunks for logprob in chunk.logprobs],
            finish_reason=last.finish_reason if last else None,
            usage=last.usage if last else None,
            request_id=last.request_id if last else "",
            trace_id=last.trace_id if last else "",
            stop_reason=last.stop_reason if last else None,
            timings=last.timings if last else None,
        )


def _logprob_from_pb(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    top = [TopLogprob(token_id=alt.token_id, logprob=alt.logprob) for alt in msg.top_logprobs]
    return TokenLogprob(token_id=msg.token_id, logprob=msg.logprob, top_logprobs=top)


def _usage_from_pb(msg: common_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, cached_tokens=msg.cached_tokens,
                 completion_tokens=msg.completion_tokens)


def _timings_from_pb(msg: common_pb2.RequestTimings) -> Timings:
    return Timings(queue_ms=msg.queue_ms, prefill_ms=msg.prefill_ms, kv_transfer_ms=msg.kv_transfer_ms,
                   time_to_first_token_ms=msg.time_to_first_token_ms, decode_ms=msg.decode_ms,
                   total_ms=msg.total_ms)


def _stop_reason(msg: gateway_pb2.GenerateResponse) -> int | str | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None
