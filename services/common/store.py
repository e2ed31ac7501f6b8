"""The scheduler's shared state: the worker registry (TTL heartbeats), the prefix index
(block hash -> workers caching it) and claims (which replica does a thing). `Store` is the
interface, `EmbeddedStore` the in-process implementation; `open_store` picks it or the Redis one
(redis_store.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from services.common.block_hash import BlockHash
from services.common.prefix_index import PrefixIndex


class StoreUnavailable(RuntimeError):
    """The store cannot be reached; the scheduler keeps routing from its last known state."""


class WorkerRole(StrEnum):
    """What a worker does (mirrors tandem.v1.WorkerRole)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class ModelState(StrEnum):
    """Where a model is in its life on a worker (mirrors tandem.v1.ModelState)."""

    LOADING = "loading"
    RESIDENT = "resident"


@dataclass(frozen=True, slots=True)
class ModelResidency:
    """One model a worker holds or is loading (mirrors tandem.v1.ModelResidency)."""

    name: str
    state: ModelState = ModelState.RESIDENT
    pinned: bool = False
    weight_bytes: int = 0
    active_requests: int = 0
    idle_ms: int = 0


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load at its last heartbeat (mirrors tandem.v1.WorkerLoad). `models`: those it holds
    or is loading (a worker without a catalogue reports none: it holds its WorkerInfo.model)."""

    free_blocks: int = 0
    cached_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    reserved_blocks: int = 0
    models: tuple[ModelResidency, ...] = ()
    free_model_memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker registered (mirrors tandem.v1.WorkerInfo)."""

    worker_id: str
    role: WorkerRole
    address: str
    model: str
    num_blocks: int
    block_size: int
    max_model_len: int = 0
    kv_block_bytes: int = 0
    device: str = "cpu"
    catalogue: tuple[str, ...] = ()  # every model it may serve; empty: `model` alone
    model_memory_bytes: int = 0
    local_prefill: bool = False  # a decode worker that also serves Assign (tandem decode --hybrid)


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A live worker as the store knows it."""

    info: WorkerInfo
    load: WorkerLoad


class Store(Protocol):
    """Worker registry and prefix index, shared by scheduler replicas.

    Invariants: list_workers() returns only workers whose last register/heartbeat is younger
    than the ttl it gave; a worker that re-registers starts with no blocks in the index;
    match_prefix counts only unbroken leading runs of blocks. An expired worker's blocks leave
    the index when list_workers() or heartbeat() finds it expired, so match_prefix may briefly
    name a dead worker: intersect with list_workers(). Every method raises StoreUnavailable
    when the backing store cannot be reached.
    """

    name: str
    """"embedded" or "redis" (reported by the scheduler's stats)."""

    async def register_worker(self, info: WorkerInfo, ttl: float, load: WorkerLoad = WorkerLoad()) -> None:
        """Add or replace a worker (its previous prefix-index blocks are dropped); live for ttl seconds."""

    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl: float) -> bool:
        """Renew a live worker for ttl seconds with its new load; False if it is unknown or expired."""

    async def list_workers(self) -> list[WorkerRecord]:
        """The live workers, ordered by worker id."""

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and its prefix-index blocks (no-op when unknown)."""

    async def add_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        """Record that the worker caches these blocks."""

    async def remove_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        """Record that the worker evicted these blocks."""

    async def update_blocks(self, worker_id: str, stored: Iterable[BlockHash] = (),
                            evicted: Iterable[BlockHash] = (), *, reset: bool = False) -> None:
        """Apply one report of the worker's prefix-cache changes at once, in this order: with reset,
        forget its blocks (`stored` is then its whole cache); record `stored`; drop `evicted`. A
        hash in both ends up not cached. Replicas never see the report half applied."""

    async def match_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each worker caching hashes[0], the number of leading hashes it caches (workers with 0 left out)."""

    async def drop_worker_blocks(self, worker_id: str) -> None:
        """Forget every block of the worker (it restarted, reset its cache, or died)."""

    async def claim(self, key: str, owner: str, ttl: float) -> bool:
        """Take the claim `key` for `owner` for ttl seconds; False while any owner (`owner` too) holds
        it unexpired. Atomic across replicas: of those claiming a free key at once, exactly one wins."""

    async def release(self, key: str, owner: str) -> None:
        """Drop the claim `key` if `owner` still holds it (no-op when it lapsed or another owner holds it)."""

    async def ping(self) -> None:
        """Return when the store answers; StoreUnavailable otherwise."""

    async def close(self) -> None:
        """Release connections."""


@dataclass(slots=True)
class _Entry:
    record: WorkerRecord
    expires_at: float


class EmbeddedStore:
    """In-process Store for a single scheduler. `clock` (monotonic seconds) is injectable for tests."""

    name = "embedded"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[str, _Entry] = {}
        self._index = PrefixIndex()
        self._claims: dict[str, tuple[str, float]] = {}  # key -> (owner, expires_at)

    def _live(self, worker_id: str) -> _Entry | None:
        """The worker's entry if it has not expired; an expired worker is forgotten with its blocks."""
        entry = self._workers.get(worker_id)
        if entry is not None and entry.expires_at <= self._clock():
            del self._workers[worker_id]
            self._forget_blocks(worker_id)
            return None
        return entry

    async def register_worker(self, info: WorkerInfo, ttl: float, load: WorkerLoad = WorkerLoad()) -> None:
        await self.drop_worker_blocks(info.worker_id)
        self._workers[info.worker_id] = _Entry(WorkerRecord(info, load), self._clock() + ttl)

    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl: float) -> bool:
        entry = self._live(worker_id)
        if entry is None:
            return False
        entry.record = WorkerRecord(entry.record.info, load)
        entry.expires_at = self._clock() + ttl
        return True

    async def list_workers(self) -> list[WorkerRecord]:
        live = [self._live(worker_id) for worker_id in sorted(self._workers)]
        return [entry.record for entry in live if entry is not None]

    async def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        await self.drop_worker_blocks(worker_id)

    async def add_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        self._index.add(worker_id, hashes)

    async def remove_blocks(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        self._index.remove(worker_id, hashes)

    async def update_blocks(self, worker_id: str, stored: Iterable[BlockHash] = (),
                            evicted: Iterable[BlockHash] = (), *, reset: bool = False) -> None:
        if reset:
            self._forget_blocks(worker_id)
        await self.add_blocks(worker_id, stored)
        await self.remove_blocks(worker_id, evicted)

    async def match_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self._index.match(hashes)

    async def drop_worker_blocks(self, worker_id: str) -> None:
        self._forget_blocks(worker_id)

    def _forget_blocks(self, worker_id: str) -> None:
        self._index.forget(worker_id)

    async def claim(self, key: str, owner: str, ttl: float) -> bool:
        held = self._claims.get(key)
        if held is not None and held[1] > self._clock():
            return False
        self._claims[key] = (owner, self._clock() + ttl)
        return True

    async def release(self, key: str, owner: str) -> None:
        held = self._claims.get(key)
        if held is not None and held[0] == owner:
            del self._claims[key]

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def open_store(redis_url: str | None, *, namespace: str = "tandem") -> Store:
    """The Redis store when a URL is given (connects lazily), else an EmbeddedStore."""
    if not redis_url:
        return EmbeddedStore()
    from services.common.redis_store import RedisStore

    return RedisStore(redis_url, namespace=namespace)
