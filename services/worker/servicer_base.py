"""What the three worker servicers share: the runtime they serve once the model is loaded, the
Stats and Abort RPCs, the token streams the gateway reads (TokenStreamService.Follow: many
requests' on one call), the model catalogue's LoadModel and UnloadModel (ModelService), and
the checks on an incoming request.

The gRPC server starts before the model loads (health says NOT_SERVING meanwhile), so a servicer
exists before its runtime and holds the future that resolves to it; an RPC that arrives in
between gets UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

from services.common.errors import InvalidRequest, Unavailable
from services.common.sampling_params import SamplingParams
from services.common.wire import DEFAULT_MAX_TOKENS, abort_ids, sampling_from_proto
from services.worker.runtime import WorkerRuntime
from services.worker.stats import residency_to_pb
from services.worker.token_streams import follow_many
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

# Every role serves it (with its role's own services): the gateway reads the requests' tokens there.
TOKEN_STREAM_SERVICE = ("tandem.v1.TokenStreamService", worker_pb2_grpc.add_TokenStreamServiceServicer_to_server)
# Every role serves it too: the scheduler loads, pins and unloads catalogue models there.
MODEL_SERVICE = ("tandem.v1.ModelService", worker_pb2_grpc.add_ModelServiceServicer_to_server)


class WorkerServicerBase:
    """Base of the role servicers: the runtime they serve once it is loaded, and the shared RPCs."""

    def __init__(self, loaded: asyncio.Future[WorkerRuntime]) -> None:
        """`loaded` resolves to the runtime when the model is loaded (the server starts before)."""
        self._loaded = loaded

    @property
    def runtime(self) -> WorkerRuntime:
        if not self._loaded.done():
            raise Unavailable("this worker is still loading its model; retry when its health check says SERVING")
        return self._loaded.result()

    async def Stats(self, request: worker_pb2.WorkerStatsRequest, context) -> worker_pb2.WorkerStats:
        return self.runtime.stats()

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(aborted_ids=await self.runtime.abort(abort_ids(request)))

    async def Follow(self, request_iterator: AsyncIterator[worker_pb2.FollowControl],
                     context) -> AsyncIterator[worker_pb2.FollowBatch]:
        """TokenStreamService.Follow: the events of the requests a gateway attaches, batched."""
        streams = self.runtime.streams
        async for batch in follow_many(request_iterator, streams.follow, streams.leave):
            yield batch

    async def LoadModel(self, request: worker_pb2.LoadModelRequest, context) -> worker_pb2.LoadModelResponse:
        """ModelService.LoadModel: resident (loaded now, or already), pinned if asked."""
        if not request.model:
            raise InvalidRequest("model", "is empty; name a model of this worker's catalogue")
        record, evicted = await self.runtime.load_model(request.model, request.pin)
        return worker_pb2.LoadModelResponse(model=residency_to_pb(record), evicted=evicted)

    async def UnloadModel(self, request: worker_pb2.UnloadModelRequest, context) -> worker_pb2.UnloadModelResponse:
        """ModelService.UnloadModel: unpinned, and evicted now when idle (else once idle)."""
        if not request.model:
            raise InvalidRequest("model", "is empty; name a model of this worker's catalogue")
        name = self.runtime.catalogue_name(request.model)
        return worker_pb2.UnloadModelResponse(unloaded=await self.runtime.models.unload(name))


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
