"""What the three worker servicers share: the runtime they bind to once the model is loaded, the
Stats RPC, the engine-side abort, and the checks on an incoming request.

The gRPC server starts before the model loads (health says NOT_SERVING meanwhile), so a servicer
exists before its runtime; an RPC that arrives in between gets UNAVAILABLE.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from services.common.errors import InvalidRequest, Unavailable
from services.common.sampling_params import SamplingParams
from services.common.wire import DEFAULT_MAX_TOKENS, sampling_from_proto
from services.worker.engine_loop import StepResult
from services.worker.runtime import WorkerRuntime
from tandem.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


class WorkerServicerBase:
    """Base of the role servicers (the runtime's RoleServicer)."""

    def __init__(self) -> None:
        self._runtime: WorkerRuntime | None = None

    def bind(self, runtime: WorkerRuntime) -> None:
        self._runtime = runtime
        runtime.attach(self)

    @property
    def runtime(self) -> WorkerRuntime:
        if self._runtime is None:
            raise Unavailable("this worker is still loading its model; retry when its health check says SERVING")
        return self._runtime

    # -- RoleServicer defaults --------------------------------------------------------------

    def on_step(self, step: StepResult) -> None:
        return None

    async def abort_all(self, reason: str) -> None:
        ids = list(self.runtime.batcher.requests)
        if ids:
            log.warning("aborting %d request(s): %s", len(ids), reason)
            await self.abort_requests(ids)

    @property
    def num_pending(self) -> int:
        return 0

    # -- shared RPCs ------------------------------------------------------------------------

    async def Stats(self, request: worker_pb2.WorkerStatsRequest, context) -> worker_pb2.WorkerStats:
        return self.runtime.stats()

    async def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Aborts the requests wherever the worker holds them (freeing their blocks at once); returns those."""
        return await self.runtime.abort(request_ids)


def check_request(request_id: str, token_ids: Iterable[int]) -> None:
    if not request_id:
        raise InvalidRequest("request_id", "is empty; the scheduler must give every request an id")
    if not list(token_ids):
        raise InvalidRequest("token_ids", "is empty; a request needs at least one prompt token")


def sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """The domain SamplingParams of a wire message, validated (INVALID_ARGUMENT naming the field)."""
    params = sampling_from_proto(message, DEFAULT_MAX_TOKENS)
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidRequest("sampling", str(exc)) from exc
    return params


def engine_rejection(exc: ValueError) -> InvalidRequest:
    """A request the engine refused (prompt too long, token id outside the vocabulary, id in use)."""
    return InvalidRequest("request", str(exc))
