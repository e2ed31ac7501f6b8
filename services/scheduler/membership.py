"""Worker membership as the dispatcher sees it: registrations, heartbeats, graceful leaves, losses
(a token stream ended, a heartbeat lapsed) and the capacity the live workers give.

A lost worker is dropped from the registry and its channel is closed first, which cuts the calls
still waiting on it; every attempt it held ends through `end_attempt` (the dispatcher moves the
request on or fails it). A worker that deregistered drains: it is not routed to, and the requests
it holds may finish until its token stream ends. Whatever may let a waiting request in (a worker
joined, reported its load, or left with its requests) calls `on_room`.

A worker's heartbeats come on its Heartbeats stream (answer_in_order), each as a Heartbeat call:
the stream is transport only, liveness stays the registry's TTL renewed by each heartbeat read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from services.common.errors import TandemError
from services.common.store import WorkerLoad, WorkerRole
from services.scheduler import failures, message_counts
from services.scheduler.inflight import InflightTable, Placement, RequestState, Status
from services.scheduler.launcher import Spawn
from services.scheduler.message_counts import HEARTBEATS, IN, OUT
from services.scheduler.registry import WorkerRegistry
from services.scheduler.worker_clients import WorkerClients
from tandem.v1 import scheduler_pb2

log = logging.getLogger(__name__)

EndAttempt = Callable[[RequestState, Placement, TandemError], bool]


class Membership:
    """Call order: watch() in the background; registered()/heartbeat()/deregistered()/lost() as
    the servicer and the token streams hear of workers."""

    def __init__(self, registry: WorkerRegistry, inflight: InflightTable, clients: WorkerClients, *,
                 max_running: int, spawn: Spawn, end_attempt: EndAttempt, on_room: Callable[[], None]) -> None:
        self.registry = registry
        self._inflight = inflight
        self._clients = clients
        self._max_running = max_running
        self._spawn = spawn
        self._end_attempt = end_attempt
        self._on_room = on_room
        self._draining: set[str] = set()

    def capacity(self) -> int:
        """Requests that may run at once: max_running per decode worker (colocated ones, when any)."""
        roles = [record.info.role for record in self.registry.snapshot()]
        generators = roles.count(WorkerRole.COLOCATED) or roles.count(WorkerRole.DECODE)
        return self._max_running * max(1, generators)

    def registered(self) -> None:
        """A worker joined: more requests may run, and its blocks are free."""
        self._on_room()

    async def heartbeat(self, worker_id: str, load: WorkerLoad, renew_store: bool = True) -> bool:
        """Renew a worker (in the store too unless another replica does: registry.heartbeat). False
        tells it to register again, upon which it drops every request it holds: their attempts end
        here at once (the watcher may not have seen the lapse yet)."""
        known = await self.registry.heartbeat(worker_id, load, renew_store)
        if not known and self._inflight.held_by(worker_id):
            self.lost(worker_id, "its heartbeat lapsed")
        self._on_room()  # the worker may report freed blocks
        return known

    async def deregistered(self, worker_id: str) -> None:
        """A worker leaving gracefully: no new requests; the ones it holds may finish until its stream ends."""
        self._draining.add(worker_id)
        address = next((r.info.address for r in self.registry.snapshot() if r.info.worker_id == worker_id), None)
        if address is not None:
            self._clients.leaving(address)
        self.registry.forget(worker_id)
        await self.registry.unregister(worker_id)

    def lost(self, worker_id: str, reason: str) -> None:
        """End the attempts the worker runs and stop routing to it. A request that only may hold a
        reservation there (a Reserve in flight or cut) is left alone: closing the channel cuts the
        call, and the request tries the next decode worker."""
        held = self._inflight.held_by(worker_id)
        address = held[0].placement.holders[worker_id].info.address if held else None
        ended = [state for state in held if _runs_on(state, worker_id)]
        for state in held:
            del state.placement.holders[worker_id]
        moved = sum(self._end_attempt(state, state.placement, failures.lost(state, worker_id, reason))
                    for state in ended)
        log.warning("worker %s lost (%s): %d request(s) moved to other workers, %d failed", worker_id, reason,
                    moved, len(ended) - moved)
        self._draining.discard(worker_id)
        self.registry.forget(worker_id)
        self._spawn(self._forget(worker_id, address))

    async def check(self) -> None:
        """Lose the workers no longer live (heartbeat lapsed) that hold requests; let waiters in if capacity grew."""
        live = {record.info.worker_id for record in await self.registry.live_workers()}
        for worker_id in self._inflight.holders() - live - self._draining:
            self.lost(worker_id, "its heartbeat lapsed")
        self._on_room()

    async def watch(self, interval: float) -> None:
        """check() every `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check()
            except Exception:
                log.exception("checking the workers' heartbeats failed")

    async def _forget(self, worker_id: str, address: str | None) -> None:
        """Close the channel first: it cuts the calls still waiting on the worker at once."""
        if address is not None:
            await self._clients.forget(address)
        await self.registry.unregister(worker_id)


async def answer_in_order(
        heartbeats: AsyncIterator[scheduler_pb2.HeartbeatRequest],
        answer: Callable[[scheduler_pb2.HeartbeatRequest], Awaitable[scheduler_pb2.HeartbeatResponse]],
) -> AsyncIterator[scheduler_pb2.HeartbeatResponse]:
    """A worker's Heartbeats stream: each heartbeat answered before the next is read, so answers go
    back in the order the heartbeats came (the worker pairs them by order). Its end, broken or not,
    changes nothing here: a worker whose heartbeats stop lapses by the TTL, as with Heartbeat calls."""
    async for heartbeat in heartbeats:
        message_counts.count(HEARTBEATS, IN)
        response = await answer(heartbeat)
        message_counts.count(HEARTBEATS, OUT)
        yield response


def _runs_on(state: RequestState, worker_id: str) -> bool:
    """Whether the worker is the request's decode worker (its reservation taken), or its prefill or
    colocated worker once the request was started there."""
    placement = state.placement
    if placement.decode is not None and placement.decode.info.worker_id == worker_id:
        return True
    started = state.status >= Status.PREFILLING
    return started and placement.prefill is not None and placement.prefill.info.worker_id == worker_id
