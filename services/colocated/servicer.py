"""ColocatedService: one engine prefills and decodes each request, with no KV transfer.

The baseline that disaggregation is measured against: the scheduler assigns requests on one
long-lived Assign stream (services/colocated/assignments.py); each is queued in the engine and
answered at once; all its tokens, the first included, go on the request's token stream (the
gateway reads it). The request's colocated.request span, a child of the scheduler's (the trace
context its RunRequest carries), runs from its admission until its last token or abort. A request
for a catalogue model not resident waits for its load (services/worker/residency.py) before it is
queued.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from services.colocated.assignments import serve_assignments
from services.common.placer import placer_of
from services.common.tracing import SpanName, extract_context
from services.worker.events import TrackedRequest
from services.worker.servicer_base import WorkerServicerBase, check_request, engine_rejection, sampling_params
from tandem.v1 import worker_pb2, worker_pb2_grpc


class ColocatedServicer(WorkerServicerBase, worker_pb2_grpc.ColocatedServiceServicer):
    async def Assign(self, request_iterator: AsyncIterator[worker_pb2.RunRequest],
                     context) -> AsyncIterator[worker_pb2.RunResult]:
        placed = functools.partial(self._run, placer=placer_of(context.invocation_metadata()))
        async for result in serve_assignments(request_iterator, placed):
            yield result

    async def _run(self, request: worker_pb2.RunRequest, placer: str = "") -> int:
        """Queues the request in the engine; returns how many requests wait ahead of it. `placer`: the
        scheduler replica whose Assign stream carried it (services/common/placer.py)."""
        rid = request.request_id
        check_request(rid, request.token_ids)
        params = sampling_params(request.sampling)
        ids = list(request.token_ids)
        runtime = self.runtime
        async with runtime.serving(request.model) as served:
            runtime.track(TrackedRequest(rid, len(ids), logprobs=params.logprobs is not None, placer=placer))
            # Before the engine has it: its first iteration may be reported before the answer goes out.
            runtime.spans.start(SpanName.COLOCATED, rid, extract_context(request.trace_context.items()),
                                prefilling=True)
            try:
                return await served.loop.call(lambda engine: _add(engine, rid, ids, params, request))
            except ValueError as exc:
                runtime.forget(rid)
                runtime.spans.end(rid, "abort")
                raise engine_rejection(exc) from exc


def _add(engine, rid: str, ids: list[int], params, request: worker_pb2.RunRequest) -> int:
    """Queues the request; returns how many requests wait ahead of it."""
    ahead = len(engine.scheduler.waiting)
    engine.add_request(rid, ids, params, request.cache_salt, seed=request.seed, lora=request.lora)
    return ahead
