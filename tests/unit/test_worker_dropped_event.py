"""A request the worker drops on its own is reported to the scheduler as its final event
(FINISH_REASON_ERROR, UNAVAILABLE, naming the worker, the request and why), once: only a request
whose final event has not gone out, and never again after it."""

from __future__ import annotations

import grpc

from services.runtime.engine import RequestOutput
from services.runtime.sequence import FinishReason
from services.worker.engine_loop import StepResult
from services.worker.events import TokenBatcher, TrackedRequest
from tandem.v1 import common_pb2


def step(*outputs: RequestOutput) -> StepResult:
    return StepResult(list(outputs), batch_size=len(outputs), iteration=1, started_ns=0, ended_ns=1, work={},
                      running_ids=frozenset(o.request_id for o in outputs), stored=[], evicted=[], snapshot=None)


def test_a_dropped_request_gets_one_final_error_event_and_a_finished_or_unknown_one_none():
    batcher = TokenBatcher("w-1")
    for rid in ("running", "finished"):
        batcher.track(TrackedRequest(rid, num_prompt_tokens=3, logprobs=False))
    batcher.batch(step(RequestOutput("finished", [9], [], FinishReason.LENGTH, 3, 0, 1)))

    batch = batcher.dropped(["running", "finished", "unknown"], "no gateway reads its tokens")

    (event,) = batch.events
    assert (event.request_id, event.worker_id, event.finish_reason) == (
        "running", "w-1", common_pb2.FINISH_REASON_ERROR)
    assert event.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert event.error.message == "worker w-1 dropped request running: no gateway reads its tokens"
    assert batcher.dropped(["running"], "again") is None  # forgotten: its end is reported once
    assert not batcher.requests
