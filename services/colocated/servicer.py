"""ColocatedService: one engine prefills and decodes each request, with no KV transfer.

The baseline that disaggregation is measured against: Run queues the request in the engine and
returns; all its tokens, the first included, go on the worker's ReportTokens stream. The request's
colocated.request span, a child of the scheduler's, runs from Run until its last token or abort.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.tracing import SpanName, extract_context
from services.worker.engine_loop import StepResult
from services.worker.events import TrackedRequest
from services.worker.request_spans import RequestSpans
from services.worker.servicer_base import WorkerServicerBase, check_request, engine_rejection, sampling_params
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class ColocatedServicer(WorkerServicerBase, worker_pb2_grpc.ColocatedServiceServicer):
    def __init__(self) -> None:
        super().__init__()
        self._spans = RequestSpans()

    def on_step(self, step: StepResult) -> None:
        self._spans.on_step(step)

    async def Run(self, request: worker_pb2.RunRequest, context) -> worker_pb2.RunResponse:
        rid = request.request_id
        check_request(rid, request.token_ids)
        params = sampling_params(request.sampling)
        ids = list(request.token_ids)
        runtime = self.runtime
        runtime.batcher.track(TrackedRequest(rid, len(ids), logprobs=params.logprobs is not None))
        # Before the engine has it: its first iteration may be reported before the call returns.
        self._spans.start(SpanName.COLOCATED, rid, extract_context(context.invocation_metadata()), prefilling=True)
        try:
            position = await runtime.loop.call(lambda engine: _add(engine, rid, ids, params, request))
        except ValueError as exc:
            runtime.batcher.forget(rid)
            self._spans.end(rid, "abort")
            raise engine_rejection(exc) from exc
        return worker_pb2.RunResponse(request_id=rid, queue_position=position)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted_ids=await self.abort_requests(request.request_ids))

    async def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = list(request_ids)
        for rid in ids:
            self._spans.end(rid, "abort")
        return await super().abort_requests(ids)


def _add(engine, rid: str, ids: list[int], params, request: worker_pb2.RunRequest) -> int:
    """Queues the request; returns how many requests wait ahead of it."""
    ahead = len(engine.scheduler.waiting)
    engine.add_request(rid, ids, params, request.cache_salt, seed=request.seed)
    return ahead
