"""The worker registry on the Store: registrations, TTL heartbeats, block reports, live workers.

A worker is live while the store lists it, or while this scheduler received its registration or
heartbeat within the TTL, and it was not dropped (lost, or deregistered) since it last registered.
A worker with several scheduler replicas heartbeats to each and has one of them renew its store
entry (`renew_store`); the others renew their mirror only, so the store takes one write a heartbeat
whatever the number of replicas, and each replica still hears every worker (its load, and its
liveness through an outage of the store).
The local mirror of registrations is the "last known state": when the store raises
StoreUnavailable the registry routes from it, without prefix hits, and is `degraded`; it leaves the
store alone for STORE_RETRY_S (a hung Redis would cost its timeout on every request) and recovers
at the first store call that succeeds after. A store that comes back empty (Redis restarted) is
refilled from the mirror at each worker's next heartbeat, so no worker is told to register again,
which would make it drop its running requests. A restarted scheduler finds the workers in the store;
at each one's first heartbeat it adopts the record it listed into its mirror, so a worker it may
have routed requests to is never told to register again because the store's entry lapsed while
the scheduler was down, and it keeps routing to it through a later outage of the store. Block
reports made while the store is down are lost.

With `listing_reuse_s`, one listing of the store's workers serves the requests routed within that
long (wall clock), this scheduler's own heartbeats and registrations laid over it: on Redis a listing
is one round trip and a record to decode per worker, on every request. While a listing is reused
and no worker heard here has lapsed, the live workers are the last answer as registrations,
heartbeats and drops have kept it (no pass over the workers per request). The requests that find
the listing aged out share the one listing then sent (one round trip, not one each); a registration
or a model load here starts the next one afresh.

A worker id belongs to the worker that registered it while that one is live: a registration
under a live worker's id with other info (address, role, model, cache geometry) is refused with
FailedPrecondition, since heartbeats carry load, not identity, and the real worker's heartbeats
would keep an impostor's record alive. The same info may register again at any time (the worker
restarted, or this scheduler forgot it); other info may once the live record lapses or is dropped.

A decode worker that refused a Reserve for lack of blocks counts as full (no free blocks) until it
reports its load again: its last report was too hopeful, and routing waits for a fresh one.

The routing map (model -> the workers holding it, model_placement.py) is read from the workers'
records: their catalogues from registration, their resident and loading models from each heartbeat,
both kept in the store. A model this scheduler had loaded or unloaded (record_models) shows at once, here and in
the store, before the worker's next heartbeat says so. `model_placement` is the policy routing applies.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from services.common.block_hash import BlockHash
from services.common.errors import FailedPrecondition
from services.common.store import ModelResidency, Store, StoreUnavailable, WorkerInfo, WorkerLoad, WorkerRecord
from services.scheduler.model_placement import ModelPlacement

log = logging.getLogger(__name__)

STORE_RETRY_S = 1.0
LISTING_REUSE_S = 0.05  # how long the scheduler reuses a listing of its workers
T = TypeVar("T")
_Listed = tuple[bool, list[WorkerRecord] | None, bool]  # (the store answered, its workers, current)


@dataclass(slots=True)
class _Seen:
    record: WorkerRecord
    at: float  # clock() of the last registration or heartbeat received here


class WorkerRegistry:
    """`clock` (monotonic seconds) is injectable for tests; give the store the same one."""

    def __init__(self, store: Store, ttl: float, clock: Callable[[], float] = time.monotonic,
                 listing_reuse_s: float = 0.0, placement: ModelPlacement = ModelPlacement.COST) -> None:
        self.store = store
        self.model_placement = placement
        self._listing_reuse_s = listing_reuse_s
        self._listing: tuple[float, list[WorkerRecord]] | None = None  # (time.monotonic(), the store's workers)
        self._pending_listing: asyncio.Future[_Listed] | None = None
        self._listing_epoch = 0  # bumped when this scheduler changed a record: older listings are not kept
        self.ttl = ttl
        self._clock = clock
        self._seen: dict[str, _Seen] = {}
        self._dropped: set[str] = set()
        self._live: dict[str, WorkerRecord] = {}
        self._lapse_at = 0.0  # clock() before which no worker heard here since the last listing lapses
        self._full: set[str] = set()
        self.degraded = False
        self._retry_at = 0.0

    async def register(self, info: WorkerInfo, load: WorkerLoad) -> None:
        """Add a worker, or replace one registering again with the same info; it is live at once (also
        while the store is down). FailedPrecondition when a live worker holds the id with other info."""
        holder = await self._live_record(info.worker_id)
        if holder is not None and holder.info != info:
            raise FailedPrecondition(
                f"worker id {info.worker_id!r} belongs to a live {holder.info.role} worker at "
                f"{holder.info.address} serving {holder.info.model!r}; give this worker another id, or stop "
                f"that one and register again once its heartbeat lapses ({self.ttl:g} s)")
        self._dropped.discard(info.worker_id)
        self._full.discard(info.worker_id)
        record = WorkerRecord(info, load)
        self._seen[info.worker_id] = _Seen(record, self._clock())
        self._live[info.worker_id] = record
        await self._store_call(lambda: self.store.register_worker(info, self.ttl, load))
        self._drop_listing()

    async def heartbeat(self, worker_id: str, load: WorkerLoad, renew_store: bool = True) -> bool:
        """Renew a worker; False when it must register again (unknown here, lapsed, or dropped).
        `renew_store` False: another replica sharing the store renews its entry there (the worker
        has it write its heartbeats): only the local mirror is renewed, and it decides; a worker the
        mirror lacks (this scheduler restarted, and has not listed the store since) asks the store."""
        if worker_id in self._dropped:
            return False
        seen = self._fresh(worker_id) or self._adopt(worker_id)
        ok, known = False, None
        if renew_store or seen is None:
            ok, known = await self._store_call(lambda: self.store.heartbeat(worker_id, load, self.ttl))
        if not (ok and known):  # the store is down or lost it: the local mirror decides (and refills it)
            known = seen is not None
            if known and ok:
                await self._store_call(lambda: self.store.register_worker(seen.record.info, self.ttl, load))
        if known and seen is not None:
            seen.record = WorkerRecord(seen.record.info, load)
            seen.at = self._clock()
            self._full.discard(worker_id)
            if worker_id in self._live:
                self._live[worker_id] = seen.record
        return bool(known)

    def _adopt(self, worker_id: str) -> _Seen | None:
        """A mirror entry for a worker that the last listing took from the store and this scheduler
        never heard from itself (it restarted); None for one it does not list."""
        record = self._live.get(worker_id)
        if record is None:
            return None
        seen = self._seen[worker_id] = _Seen(record, self._clock())
        return seen

    async def record_models(self, worker_id: str, resident: ModelResidency | None = None,
                            gone: Iterable[str] = ()) -> None:
        """A live worker answered a LoadModel (`resident` now, `gone` evicted for it) or an UnloadModel
        (`gone`): laid over its last load report, here and in the store (renewing its entry, as its
        heartbeat would). No-op for a worker that is not live."""
        seen = self._fresh(worker_id) or self._adopt(worker_id)
        if seen is None:
            return
        dropped = {*gone, *((resident.name,) if resident else ())}
        kept = tuple(m for m in seen.record.load.models if m.name not in dropped)
        load = replace(seen.record.load, models=kept + ((resident,) if resident else ()))
        seen.record = WorkerRecord(seen.record.info, load)
        self._live[worker_id] = seen.record
        self._drop_listing()
        await self._store_call(lambda: self.store.heartbeat(worker_id, load, self.ttl))

    async def _stored(self, worker_id: str) -> WorkerRecord | None:
        """The store's live record of the worker; None when it has none or is down."""
        ok, listed = await self._store_call(self.store.list_workers)
        return next((r for r in listed or () if r.info.worker_id == worker_id), None) if ok else None

    async def _live_record(self, worker_id: str) -> WorkerRecord | None:
        """The record of a live worker under this id: the local mirror's, else the store's (this
        scheduler restarted); None when it was dropped, lapsed, or is unknown."""
        if worker_id in self._dropped:
            return None
        if (seen := self._fresh(worker_id)) is not None:
            return seen.record
        return await self._stored(worker_id)

    def forget(self, worker_id: str) -> None:
        """Stop routing to a worker (deregistered, lost) until it registers again. Call unregister()
        next to take it out of the store as well."""
        self._dropped.add(worker_id)
        self._full.discard(worker_id)
        self._seen.pop(worker_id, None)
        self._live.pop(worker_id, None)

    async def unregister(self, worker_id: str) -> None:
        """Remove a forgotten worker and its prefix-index blocks from the store."""
        await self._store_call(lambda: self.store.remove_worker(worker_id))

    async def report_blocks(self, worker_id: str, stored: Iterable[BlockHash], evicted: Iterable[BlockHash],
                            reset: bool = False) -> None:
        """Apply a worker's prefix-cache changes (reset: `stored` is its whole cache)."""
        if worker_id in self._dropped:
            return
        stored, evicted = list(stored), list(evicted)
        await self._store_call(lambda: self.store.update_blocks(worker_id, stored, evicted, reset=reset))

    async def live_workers(self) -> list[WorkerRecord]:
        """The live workers ordered by id (see the module docstring); refreshes snapshot(), unless
        this scheduler changed a record while the store was being listed (a later call lists again)."""
        reused = self._listing is not None and time.monotonic() - self._listing[0] < self._listing_reuse_s
        if reused and self._clock() < self._lapse_at:
            return list(self._live.values())  # as the rebuild below would make it: nothing lapsed since
        if reused:
            ok, listed, current = True, self._listing[1], True
        else:
            ok, listed, current = await self._list_store()
        records = {r.info.worker_id: r for r in listed} if ok else {}
        for worker_id in list(self._seen):
            if (reused or worker_id not in records) and (seen := self._fresh(worker_id)) is not None:
                records[worker_id] = seen.record  # a reused listing is older than this scheduler's own news
        live = {w: records[w] for w in sorted(records) if w not in self._dropped}
        if current:
            self._live = live
            now = self._clock()
            self._lapse_at = min((seen.at for seen in self._seen.values() if now - seen.at < self.ttl),
                                 default=math.inf) + self.ttl
        return list(live.values())

    async def _list_store(self) -> _Listed:
        """The store's workers, kept as the listing to reuse. With listing reuse on, callers arriving
        while a listing is under way share it (it started at most a moment before them, younger than
        any reused one), instead of each sending its own: the requests that find the last listing
        aged out arrive together. A caller cancelled meanwhile does not cancel it for the others."""
        if self._listing_reuse_s <= 0:
            return await self._list_once()
        if self._pending_listing is None or self._pending_listing.done():
            self._pending_listing = asyncio.ensure_future(self._list_once())
        return await asyncio.shield(self._pending_listing)

    async def _list_once(self) -> _Listed:
        """(ok, the store's workers, current): not current when a change made here since it started
        may be missing from it."""
        listed_at, epoch = time.monotonic(), self._listing_epoch
        ok, listed = await self._store_call(self.store.list_workers)
        current = epoch == self._listing_epoch
        if current:
            self._listing = (listed_at, listed) if ok else None
        return ok, listed, current

    def _drop_listing(self) -> None:
        """This scheduler changed a worker's record: the next live_workers() lists the store again,
        and a listing under way (it may predate the change) serves only those already waiting on it."""
        self._listing = None
        self._pending_listing = None
        self._listing_epoch += 1

    def is_live(self, worker_id: str) -> bool:
        """Whether the worker was live at the last live_workers() and has not been dropped since."""
        return worker_id in self._live

    def snapshot(self) -> list[WorkerRecord]:
        """The live workers as of the last live_workers() or register(), without asking the store."""
        return list(self._live.values())

    async def match_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Leading blocks of `hashes` each worker caches; {} while the store is down (degraded routing)."""
        if not hashes:
            return {}
        ok, matched = await self._store_call(lambda: self.store.match_prefix(hashes))
        return matched if ok else {}

    def mark_full(self, worker_id: str) -> None:
        """The worker refused a Reserve for lack of blocks: count it full until it reports again."""
        self._full.add(worker_id)

    def free_blocks(self, record: WorkerRecord) -> int:
        """The worker's free KV blocks at its last report (0 while it counts as full)."""
        return 0 if record.info.worker_id in self._full else record.load.free_blocks

    def last_seen(self, worker_id: str) -> float | None:
        """clock() of the worker's last registration or heartbeat received here, None if none."""
        seen = self._seen.get(worker_id)
        return None if seen is None else seen.at

    def heartbeat_age(self, worker_id: str) -> float | None:
        at = self.last_seen(worker_id)
        return None if at is None else self._clock() - at

    def _fresh(self, worker_id: str) -> _Seen | None:
        """The worker's local entry if its last registration or heartbeat here is within the TTL."""
        seen = self._seen.get(worker_id)
        if seen is not None and self._clock() - seen.at >= self.ttl:
            del self._seen[worker_id]
            return None
        return seen

    async def _store_call(self, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """(True, result) of a store call; (False, None) when it raised StoreUnavailable, or was
        skipped because the store failed less than STORE_RETRY_S ago."""
        if self.degraded and self._clock() < self._retry_at:
            return False, None
        try:
            result = await call()
        except StoreUnavailable as exc:
            if not self.degraded:
                log.warning("%s; routing from the last known workers, without prefix hits, until it returns", exc)
            self.degraded = True
            self._retry_at = self._clock() + STORE_RETRY_S
            return False, None
        if self.degraded:
            log.warning("the %s store answers again: routing with the prefix index", self.store.name)
        self.degraded = False
        return True, result
