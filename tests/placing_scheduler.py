"""A stand-in scheduler for the gateway's tests that places every request on itself: a subclass
writes `events(request, context)`, the request's token events as a worker streams them (raising a
TandemError fails the request); Submit answers with a Placement on this same server, whose
TokenStreamService.Follow streams those events (Submissions serves each of its submissions with
Submit, as the real scheduler does). A failure before the first event is Submit's
status; one after it ends the Submit call with that status, as the real scheduler's would."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from services.common.errors import TandemError
from services.common.grpc_server import GrpcServer, create_server
from services.scheduler import submissions
from services.worker.token_streams import follow_many
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

_Run = tuple[scheduler_pb2.TokenEvent, AsyncIterator[scheduler_pb2.TokenEvent], asyncio.Future]


class PlacingScheduler(scheduler_pb2_grpc.SchedulerServiceServicer, worker_pb2_grpc.TokenStreamServiceServicer):
    address = ""

    def serve_on(self, server: GrpcServer) -> None:
        """Add both services to `server` (call before it starts; `placed_at` after)."""
        server.add_service("tandem.v1.SchedulerService", scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                           self)
        server.add_service("tandem.v1.TokenStreamService",
                           worker_pb2_grpc.add_TokenStreamServiceServicer_to_server, self)

    def placed_at(self, port: int) -> None:
        self.address = f"127.0.0.1:{port}"

    def events(self, request, context) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        raise NotImplementedError

    async def Submit(self, request, context) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        events = self.events(request, context)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            return
        ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._runs()[request.request_id] = (first, events, ended)
        yield scheduler_pb2.SubmitEvent(placement=scheduler_pb2.Placement(
            attempt_id=request.request_id, generator_worker_id="colocated-0", generator_address=self.address))
        error = await ended
        if error is not None:
            raise error

    def Submissions(self, request_iterator, context) -> AsyncIterator[scheduler_pb2.SubmitUpdates]:
        return submissions.serve(self.Submit, request_iterator, context)

    async def Follow(self, request_iterator, context) -> AsyncIterator[worker_pb2.FollowBatch]:
        async for batch in follow_many(request_iterator, lambda request_id, min_tokens: self._follow(request_id)):
            yield batch

    async def _follow(self, request_id: str) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        first, events, ended = self._runs().pop(request_id)
        try:
            yield first
            async for event in events:
                yield event
            ended.done() or ended.set_result(None)
        except TandemError as error:
            ended.done() or ended.set_result(error)

    @contextlib.asynccontextmanager
    async def served(self) -> AsyncIterator[grpc.aio.Channel]:
        """This scheduler on a loopback server of its own, and a channel to it; both closed on exit."""
        server = create_server("127.0.0.1", 0)
        self.serve_on(server)
        await server.start()
        self.placed_at(server.port)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield channel
        finally:
            await channel.close()
            await server.stop(0)

    def _runs(self) -> dict[str, _Run]:
        if not hasattr(self, "_placed"):
            self._placed: dict[str, _Run] = {}
        return self._placed
