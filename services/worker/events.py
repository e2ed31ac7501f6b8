"""Engine outputs as the wire's TokenEvents, one TokenBatch per engine iteration.

The batcher tracks the requests a worker streams (their prompt size, cached tokens, whether
logprobs were asked, arrival and first-token times) and turns each step's outputs into one
TokenBatch: offsets, tokens, logprobs, and on the last event the finish reason and usage. Every
event goes to its request's token stream (the gateway's); the scheduler gets only what its
accounting needs: each request's first event on this worker (it started: the routing load, a
decode reservation in use) and its final one (completion, or the worker dropping it on its own:
FINISH_REASON_ERROR with the status its Submit call ends with), never the tokens in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from services.common.wire import FINISH_REASON_TO_PROTO, logprob_to_proto, usage_to_proto
from services.runtime.engine import RequestOutput
from services.runtime.sequence import FinishReason
from services.worker.engine_loop import StepResult
from tandem.v1 import common_pb2, scheduler_pb2


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    """The wire finish reason; UNSPECIFIED while running, and for PREFILLED (the request goes on)."""
    if reason is None or reason is FinishReason.PREFILLED:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return FINISH_REASON_TO_PROTO[reason.value]


def is_final(reason: FinishReason | None) -> bool:
    return reason is not None and reason is not FinishReason.PREFILLED


def ms_between(start_ns: int | None, end_ns: int | None) -> float:
    return 0.0 if start_ns is None or end_ns is None else (end_ns - start_ns) / 1e6


@dataclass(slots=True)
class TrackedRequest:
    """What a worker remembers of a request to report its tokens.

    `cached_tokens` None means the engine's count (the request was prefilled here);
    `timings` are the ones known before this worker (a decode worker gets them in the KV header).
    """

    request_id: str
    num_prompt_tokens: int
    logprobs: bool
    cached_tokens: int | None = None
    arrival_ns: int = field(default_factory=time.time_ns)
    started_ns: int | None = None  # first scheduled in an engine iteration
    first_token_ns: int | None = None  # first token produced on this worker
    reported: bool = False  # the scheduler got its first event on this worker
    placer: str = ""  # the scheduler replica that placed it here ("": unknown; services/common/placer.py)
    timings: common_pb2.RequestTimings = field(default_factory=common_pb2.RequestTimings)


@dataclass(slots=True)
class StepEvents:
    """One step's events: all of them (for the requests' token streams), and the batch the scheduler gets,
    with the placer of each of its events' requests, in order."""

    events: list[scheduler_pb2.TokenEvent]
    report: scheduler_pb2.TokenBatch | None
    placers: tuple[str, ...] = ()


def _batch(step: StepResult, events: list[scheduler_pb2.TokenEvent]) -> scheduler_pb2.TokenBatch:
    return scheduler_pb2.TokenBatch(iteration=step.iteration, events=events, batch_size=step.batch_size)


def _without_prompt_logprobs(event: scheduler_pb2.TokenEvent) -> scheduler_pb2.TokenEvent:
    """The event as the scheduler gets it: the prompt's logprobs are the client's alone."""
    if not event.prompt_logprobs:
        return event
    reported = scheduler_pb2.TokenEvent()
    reported.CopyFrom(event)
    reported.ClearField("prompt_logprobs")
    return reported


class TokenBatcher:
    """Tracks requests and builds one TokenBatch per StepResult for them."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.requests: dict[str, TrackedRequest] = {}
        self._unstarted: set[str] = set()

    def track(self, request: TrackedRequest) -> None:
        self.requests[request.request_id] = request
        if request.started_ns is None:
            self._unstarted.add(request.request_id)

    def forget(self, request_id: str) -> TrackedRequest | None:
        self._unstarted.discard(request_id)
        return self.requests.pop(request_id, None)

    def dropped(self, request_ids: list[str], why: str) -> scheduler_pb2.TokenBatch | None:
        """The final events of the tracked ones of `request_ids`, which the worker drops on its own
        for the reason `why` (FINISH_REASON_ERROR, UNAVAILABLE: the request may be retried), forgotten
        now; None when it tracks none."""
        events = [scheduler_pb2.TokenEvent(
            request_id=rid, worker_id=self.worker_id, finish_reason=common_pb2.FINISH_REASON_ERROR,
            error=common_pb2.RequestError(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                          message=f"worker {self.worker_id} dropped request {rid}: {why}"))
            for rid in request_ids if self.forget(rid) is not None]
        return scheduler_pb2.TokenBatch(events=events) if events else None

    def batch(self, step: StepResult) -> StepEvents:
        """The step's events, for the streams and for the scheduler; final ones are forgotten."""
        self._note_started(step)
        now = time.time_ns()
        events, report, placers = [], [], []
        for output in step.outputs:
            tracked = self.requests.get(output.request_id)
            if tracked is None:
                continue
            event = self.event(output, tracked, now)
            events.append(event)
            final = is_final(output.finish_reason)
            if final or not tracked.reported:
                tracked.reported = True
                report.append(_without_prompt_logprobs(event))
                placers.append(tracked.placer)
            if final:
                self.forget(output.request_id)
        return StepEvents(events, _batch(step, report) if report else None, tuple(placers))

    def _note_started(self, step: StepResult) -> None:
        if not self._unstarted:
            return
        produced = {output.request_id for output in step.outputs}
        for request_id in [r for r in self._unstarted if r in step.running_ids or r in produced]:
            self.requests[request_id].started_ns = step.started_ns
            self._unstarted.discard(request_id)

    def event(self, output: RequestOutput, tracked: TrackedRequest, now_ns: int) -> scheduler_pb2.TokenEvent:
        offset = output.num_output_tokens - len(output.new_token_ids)
        event = scheduler_pb2.TokenEvent(
            request_id=output.request_id,
            worker_id=self.worker_id,
            output_offset=offset,
            token_ids=output.new_token_ids,
            finish_reason=finish_reason_to_proto(output.finish_reason),
        )
        if tracked.logprobs:
            event.logprobs.extend(logprob_to_proto(s.token_id, s.logprob, s.top_logprobs)
                                  for s in output.new_logprobs)
        if output.prompt_logprobs is not None:
            event.prompt_logprobs.extend(logprob_to_proto(s.token_id, s.logprob, s.top_logprobs)
                                         for s in output.prompt_logprobs)
        if tracked.first_token_ns is None:
            tracked.first_token_ns = now_ns
        if offset == 0:
            tracked.timings.prefill_ms = ms_between(tracked.started_ns, now_ns)
            tracked.timings.time_to_first_token_ms = ms_between(tracked.arrival_ns, now_ns)
        if is_final(output.finish_reason):
            cached = output.num_cached_tokens if tracked.cached_tokens is None else tracked.cached_tokens
            event.usage.CopyFrom(usage_to_proto(tracked.num_prompt_tokens, cached, output.num_output_tokens))
            tracked.timings.decode_ms = ms_between(tracked.first_token_ns, now_ns)
        event.timings.CopyFrom(tracked.timings)
        return event

