"""A worker's membership in the scheduler's registry: RegisterWorker, periodic heartbeats with its
load (on one Heartbeats stream: heartbeat_stream.py), registering again when the scheduler no longer
knows it, and DeregisterWorker on shutdown. With several scheduler replicas, one Registration each,
sharing a StoreRenewal (store_renewal.py): one replica writes each heartbeat to the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from services.worker.heartbeat_stream import HeartbeatStream
from services.worker.store_renewal import StoreRenewal
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
    those no gateway reads and resends its whole prefix-cache contents. `on_forgotten` runs first, at once,
    when a heartbeat finds the worker forgotten and before it registers again: what the worker holds
    then is what the scheduler failed, and what arrives after may already be the fresh registration's
    (the scheduler places on the worker as soon as it has taken it back). `on_policy` gets a batching
    policy a heartbeat answer carries (the scheduler sets it from SLOs once the worker reports a cost model).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        info: scheduler_pb2.WorkerInfo,
        load: Callable[[], scheduler_pb2.WorkerLoad],
        metadata: tuple[tuple[str, str], ...] = (),
        on_reregistered: Callable[[scheduler_pb2.RegisterWorkerResponse], Awaitable[None]] | None = None,
        on_policy: Callable[[scheduler_pb2.BatchPolicy], Awaitable[None]] | None = None,
        on_forgotten: Callable[[], None] | None = None,
        renewal: tuple[StoreRenewal, int] | None = None,
    ) -> None:
        """`renewal`: the worker's StoreRenewal and this scheduler's seat in it (None: one scheduler,
        which renews the store)."""
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._renewal = renewal
        self._heartbeat_stream = HeartbeatStream(self._stub, metadata)
        self.info = info
        self._load = load
        self._metadata = metadata
        self._on_reregistered = on_reregistered
        self._on_policy = on_policy
        self._on_forgotten = on_forgotten
        self._task: asyncio.Task | None = None
        self._rejoin: asyncio.Task | None = None  # on_reregistered, running beside the heartbeats
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
        for task in (self._task, self._rejoin):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._heartbeat_stream.close()
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
        """One heartbeat; when the scheduler forgot us: on_forgotten, registers again, starts on_reregistered."""
        request = scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id, load=self._load())
        if self._renewal is not None:
            renewal, seat = self._renewal
            request.renewed_elsewhere = not renewal.renews(seat)
        timeout = min(self.interval_s, RPC_TIMEOUT_S) if self.interval_s > 0 else RPC_TIMEOUT_S
        try:
            response = await self._heartbeat_stream.exchange(request, timeout)
        except grpc.aio.AioRpcError:
            self._heard(False)
            raise
        self._heard(True)
        if response.known:
            if response.HasField("policy") and self._on_policy is not None:
                await self._on_policy(response.policy)
            return True
        log.warning("the scheduler no longer knows %s; registering again", self.worker_id)
        if self._on_forgotten is not None:
            self._on_forgotten()
        response = await self._register_once()
        if self._on_reregistered is not None:
            self._rejoin = asyncio.create_task(self._rejoined(self._rejoin, self._on_reregistered, response),
                                               name="rejoin")
        return False

    def _heard(self, ok: bool) -> None:
        if self._renewal is not None:
            renewal, seat = self._renewal
            renewal.heard(seat, ok)

    @staticmethod
    async def _rejoined(previous: asyncio.Task | None,
                        on_reregistered: Callable[[scheduler_pb2.RegisterWorkerResponse], Awaitable[None]],
                        response: scheduler_pb2.RegisterWorkerResponse) -> None:
        """Runs on_reregistered after any earlier run, beside the heartbeats: it may wait on the engine
        (aborting requests, resending the prefix cache) longer than a heartbeat TTL, and heartbeats held
        that long let the fresh registration lapse."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        try:
            await on_reregistered(response)
        except Exception:
            log.exception("taking up the scheduler's fresh registration failed")
