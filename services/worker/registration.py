"""A worker's membership in the scheduler's registry: RegisterWorker, periodic heartbeats with its
load, registering again when the scheduler no longer knows it, and DeregisterWorker on shutdown.

The heartbeats go on one long-lived Heartbeats stream, each answered on it in order: one message
each way instead of a call. Each answer's wait is bounded as a call's was. A stream found broken is
replaced at once and the heartbeat sent again on the new one (a restarted scheduler hears it without
delay); a late answer fails the heartbeat and the next one opens a new stream (a late answer left
on the old one would pair with the wrong heartbeat).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 2.0
_RETRY_START_S = 0.1
_RETRY_MAX_S = 2.0
_DEFAULT_INTERVAL_S = 1.0


class Registration:
    """Call order: await register() -> start_heartbeats() -> await stop().

    `on_reregistered` runs after the scheduler forgot the worker (TTL lapse or scheduler restart)
    and took it back: the scheduler has failed the worker's requests by then, so the worker drops
    those no gateway reads and resends its whole prefix-cache contents. `on_policy` gets a batching policy a heartbeat
    answer carries (the scheduler sets it from SLOs once the worker reports a cost model).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        info: scheduler_pb2.WorkerInfo,
        load: Callable[[], scheduler_pb2.WorkerLoad],
        metadata: tuple[tuple[str, str], ...] = (),
        on_reregistered: Callable[[scheduler_pb2.RegisterWorkerResponse], Awaitable[None]] | None = None,
        on_policy: Callable[[scheduler_pb2.BatchPolicy], Awaitable[None]] | None = None,
    ) -> None:
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self.info = info
        self._load = load
        self._metadata = metadata
        self._on_reregistered = on_reregistered
        self._on_policy = on_policy
        self._task: asyncio.Task | None = None
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._exchange = asyncio.Lock()  # one heartbeat on the stream at a time: answers pair by order
        self.interval_s = _DEFAULT_INTERVAL_S
        self.response: scheduler_pb2.RegisterWorkerResponse | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    async def register(self) -> scheduler_pb2.RegisterWorkerResponse:
        """Registers, retrying with backoff until the scheduler takes it (a worker may start first, or its
        id may still be held by its previous registration until that lapses)."""
        delay = _RETRY_START_S
        while True:
            try:
                return await self._register_once()
            except grpc.aio.AioRpcError as error:
                if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED):
                    raise
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Our id is still held by a registration with other info (this worker before a
                    # restart on a new address, say): it frees once that one's heartbeats lapse.
                    log.warning("scheduler refused the registration (%s); retrying in %.1f s", error.details(), delay)
                else:
                    log.info("scheduler not reachable yet (%s); retrying in %.1f s", error.code().name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)

    async def _register_once(self) -> scheduler_pb2.RegisterWorkerResponse:
        info = scheduler_pb2.WorkerInfo()
        info.CopyFrom(self.info)
        info.load.CopyFrom(self._load())
        request = scheduler_pb2.RegisterWorkerRequest(worker=info)
        response = await self._stub.RegisterWorker(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
        self.response = response
        if response.heartbeat_interval_ms > 0:
            self.interval_s = response.heartbeat_interval_ms / 1000
        log.info("registered %s as %s with scheduler %s (heartbeat every %.2f s)", self.worker_id,
                 common_pb2.WorkerRole.Name(self.info.role), response.scheduler_id or "?", self.interval_s)
        return response

    def start_heartbeats(self) -> None:
        self._task = asyncio.create_task(self._heartbeats(), name="heartbeats")

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._close_stream()
        if deregister:
            request = scheduler_pb2.DeregisterWorkerRequest(worker_id=self.worker_id)
            try:
                await self._stub.DeregisterWorker(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
            except grpc.aio.AioRpcError as error:
                log.warning("could not deregister %s: %s", self.worker_id, error.code().name)
            else:
                log.info("deregistered %s from the scheduler", self.worker_id)

    async def _heartbeats(self) -> None:
        """Every interval until stopped; a scheduler away (restarting) is said once, and again when it is back."""
        failing = False
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.heartbeat()
            except grpc.aio.AioRpcError as error:
                if not failing:
                    log.warning("heartbeat failed (%s: %s); retrying every %.2f s", error.code().name,
                                error.details(), self.interval_s)
                failing = True
                continue
            if failing:
                log.info("heartbeats reach the scheduler again")
            failing = False

    async def heartbeat(self) -> bool:
        """One heartbeat; registers again (and runs on_reregistered) when the scheduler forgot us.
        AioRpcError when the stream broke or the answer was late (the next heartbeat reopens it)."""
        request = scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id, load=self._load())
        timeout = min(self.interval_s, RPC_TIMEOUT_S) if self.interval_s > 0 else RPC_TIMEOUT_S
        async with self._exchange:
            fresh = self._stream is None
            try:
                response = await self._exchange_one(request, timeout)
            except grpc.aio.AioRpcError as error:
                if fresh or error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                # The stream broke since the last heartbeat (the scheduler restarted, say): once more on a new one.
                response = await self._exchange_one(request, timeout)
        if response.known:
            if response.HasField("policy") and self._on_policy is not None:
                await self._on_policy(response.policy)
            return True
        log.warning("the scheduler no longer knows %s; registering again", self.worker_id)
        response = await self._register_once()
        if self._on_reregistered is not None:
            await self._on_reregistered(response)
        return False

    async def _exchange_one(self, request: scheduler_pb2.HeartbeatRequest,
                            timeout: float) -> scheduler_pb2.HeartbeatResponse:
        """Send one heartbeat on the stream (opened if none is) and read its answer within `timeout`."""
        if self._stream is None:
            self._stream = self._stub.Heartbeats(metadata=self._metadata)
        try:
            response = await asyncio.wait_for(_send_and_read(self._stream, request), timeout)
        except TimeoutError:
            self._close_stream()
            detail = f"no answer to the heartbeat within {timeout:g} s"
            raise _failed(grpc.StatusCode.DEADLINE_EXCEEDED, detail) from None
        except grpc.aio.AioRpcError:
            self._close_stream()
            raise
        except asyncio.InvalidStateError:  # a write on a stream that had already ended (its scheduler went away)
            self._close_stream()
            raise _failed(grpc.StatusCode.UNAVAILABLE, "the heartbeat stream had ended") from None
        if response is grpc.aio.EOF:
            self._close_stream()
            raise _failed(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the heartbeat stream")
        return response

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None


async def _send_and_read(stream: grpc.aio.StreamStreamCall,
                         request: scheduler_pb2.HeartbeatRequest) -> scheduler_pb2.HeartbeatResponse:
    await stream.write(request)
    return await stream.read()


def _failed(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A heartbeat that failed on the stream, as the error a failed call would raise."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
