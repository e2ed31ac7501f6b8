"""Which catalogue models a worker holds in memory, under its --model-memory budget.

The rule: every model resident or loading counts its weight bytes against the budget. A model
not resident is loaded on the first request for it (a cold start); requests for a model still
loading wait for that one load (single flight). A load that does not fit evicts idle unpinned
resident models, least recently used first, until it fits; if it cannot fit even then it fails
with ModelMemoryExhausted and evicts nothing. A model is never evicted while it is busy (requests
queued or running, or a lease held while one is admitted) or pinned. Torch-free: what a model is
(an engine and its thread) is the caller's, through `load`, `unload` and `active`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class ModelState(enum.IntEnum):
    """Values of scheduler_pb2.ModelState."""

    LOADING = 1
    RESIDENT = 2


class ModelMemoryExhausted(RuntimeError):
    """A model that cannot fit the budget even after evicting every idle unpinned model."""


class ModelLoadError(RuntimeError):
    """A model whose load failed (its directory could not be read or built)."""


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """One model held (or loading), as the worker reports it (scheduler_pb2.ModelResidency)."""

    name: str
    state: ModelState
    pinned: bool
    weight_bytes: int
    active_requests: int
    idle_ms: int


@dataclass(frozen=True, slots=True)
class Loaded(Generic[T]):
    """A load's outcome: the model and the models evicted to make room for it (in eviction order)."""

    model: T
    evicted: tuple[str, ...]


@dataclass(slots=True)
class _Held(Generic[T]):
    name: str
    weight_bytes: int
    pinned: bool
    ready: asyncio.Future[None]  # done when the load ended; its exception when the load failed
    last_used: float
    model: T | None = None  # the one reference the worker keeps: gone with `take`, so eviction frees it
    leases: int = 0
    leaving: bool = False  # unloaded while busy: evicted once idle
    evicted: tuple[str, ...] = field(default=())

    @property
    def state(self) -> ModelState:
        return ModelState.RESIDENT if self.model is not None else ModelState.LOADING

    def take(self) -> T:
        """The model, handed to whoever frees it; this record keeps no reference."""
        model, self.model = self.model, None
        assert model is not None, f"model {self.name} taken twice"
        return model


class ResidentModels(Generic[T]):
    """Call order: `async with lease(name) as model` around admitting each request -> `note_used(name)`
    after each step of its model -> `load`/`unload` on the scheduler's word -> `close()`.

    `load(name, evicted)` builds a model (evicted: the names evicted for it, for its span);
    `unload(name, model)` frees one; `active(model)` counts its queued and running requests.
    """

    def __init__(self, sizes: Mapping[str, int], budget: int, load: Callable[[str, tuple[str, ...]], Awaitable[T]],
                 unload: Callable[[str, T], Awaitable[None]], active: Callable[[T], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sizes = dict(sizes)
        self.budget = budget
        self._load = load
        self._unload = unload
        self._active = active
        self._clock = clock
        self._held: dict[str, _Held[T]] = {}

    # -- requests ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[T]:
        """The model, resident, kept from eviction until the block exits (admit the request inside it)."""
        held = self._held.get(name) or self._start_load(name)
        held.leases += 1  # from now: a request waiting for the load counts as active
        try:
            await asyncio.shield(held.ready)
            assert held.model is not None  # leased: not evictable
            yield held.model
        finally:
            held.leases -= 1
            held.last_used = self._clock()
            self._leave_if_idle(held)

    def note_used(self, name: str) -> None:
        """The model just stepped: used now when busy; a model unloaded while busy leaves once idle."""
        held = self._held.get(name)
        if held is None or held.state is not ModelState.RESIDENT:
            return
        if self._busy(held):
            held.last_used = self._clock()
        self._leave_if_idle(held)

    def resident(self, name: str) -> T | None:
        """The model when it is resident now (no load, no wait)."""
        held = self._held.get(name)
        return held.model if held is not None else None

    def models(self) -> dict[str, T]:
        """Every resident model, by name."""
        return {name: held.model for name, held in self._held.items() if held.model is not None}

    # -- the scheduler's word ---------------------------------------------------------------

    async def load(self, name: str, pin: bool = False) -> Loaded[T]:
        """Loads the model (or waits for its load) and pins it if asked; returns it and what was evicted."""
        held = self._held.get(name) or self._start_load(name)
        held.pinned = held.pinned or pin
        held.leaving = held.leaving and not pin
        held.leases += 1  # not evictable before this call returns it
        try:
            await asyncio.shield(held.ready)
        finally:
            held.leases -= 1
            held.last_used = self._clock()
        assert held.model is not None
        return Loaded(held.model, held.evicted)

    async def unload(self, name: str) -> bool:
        """Unpins the model and evicts it when idle (True); a busy one leaves once idle (False)."""
        held = self._held.get(name)
        if held is None:
            return False
        held.pinned = False
        if held.state is not ModelState.RESIDENT or self._busy(held):
            held.leaving = True
            return False
        await self._evict(held)
        return True

    async def close(self) -> None:
        """Unloads every resident model (the worker is stopping)."""
        for held in list(self._held.values()):
            if held.state is ModelState.RESIDENT:
                await self._evict(held)

    # -- what the worker reports ------------------------------------------------------------

    def records(self) -> list[ModelRecord]:
        now = self._clock()
        return [ModelRecord(h.name, h.state, h.pinned, h.weight_bytes, self._active_requests(h),
                            0 if self._busy(h) else round((now - h.last_used) * 1000)) for h in self._held.values()]

    @property
    def free_bytes(self) -> int:
        return max(self.budget - sum(h.weight_bytes for h in self._held.values()), 0)

    # -- loading and evicting ---------------------------------------------------------------

    def _start_load(self, name: str) -> _Held[T]:
        """Makes room (synchronously, so no other load takes it meanwhile), then loads in a task."""
        size = self.sizes[name]
        victims = self._victims(name, size)
        held = _Held(name, size, pinned=False, ready=asyncio.get_running_loop().create_future(),
                     last_used=self._clock(), evicted=tuple(v.name for v in victims))
        for victim in victims:
            del self._held[victim.name]
        self._held[name] = held
        asyncio.ensure_future(self._run_load(held, victims))
        return held

    def _victims(self, name: str, size: int) -> list[_Held[T]]:
        """Least recently used idle unpinned resident models whose eviction makes `size` fit."""
        if size > self.budget:
            raise ModelMemoryExhausted(
                f"model {name!r} needs {size} bytes of weights, more than this worker's --model-memory "
                f"({self.budget} bytes); start the worker with a larger --model-memory")
        need = size - self.free_bytes
        victims: list[_Held[T]] = []
        idle = sorted((h for h in self._held.values() if self._evictable(h)), key=lambda h: h.last_used)
        for held in idle:
            if need <= 0:
                break
            victims.append(held)
            need -= held.weight_bytes
        if need > 0:
            kept = ", ".join(sorted(h.name for h in self._held.values() if h not in victims))
            raise ModelMemoryExhausted(
                f"model {name!r} needs {size} bytes of weights; {self.free_bytes} of --model-memory "
                f"{self.budget} are free and the models holding the rest are busy, pinned or loading ({kept}); "
                "retry later, or on a worker with room")
        return victims

    async def _run_load(self, held: _Held[T], victims: list[_Held[T]]) -> None:
        try:
            for victim in victims:
                await self._unload(victim.name, victim.take())
            model = await self._load(held.name, held.evicted)
        except Exception as exc:  # noqa: BLE001 - every waiter gets it; the model is not held
            if self._held.get(held.name) is held:
                del self._held[held.name]
            error = exc if isinstance(exc, ModelMemoryExhausted) else ModelLoadError(
                f"model {held.name!r} could not be loaded: {type(exc).__name__}: {exc}")
            held.ready.set_exception(error)
            held.ready.exception()  # retrieved: a load nobody awaits any more must not warn
            return
        held.last_used = self._clock()
        held.model = model
        held.ready.set_result(None)

    def _evict(self, held: _Held[T]) -> asyncio.Future[None]:
        """Forgets the model now (a new request loads it afresh) and frees it in the background."""
        del self._held[held.name]
        return asyncio.ensure_future(self._unload(held.name, held.take()))

    def _leave_if_idle(self, held: _Held[T]) -> None:
        """A model unloaded while busy leaves once idle (if still held: not evicted meanwhile)."""
        if held.leaving and self._held.get(held.name) is held and held.model is not None and not self._busy(held):
            self._evict(held)

    def _evictable(self, held: _Held[T]) -> bool:
        return held.state is ModelState.RESIDENT and not held.pinned and not self._busy(held)

    def _busy(self, held: _Held[T]) -> bool:
        return self._active_requests(held) > 0

    def _active_requests(self, held: _Held[T]) -> int:
        return held.leases + (self._active(held.model) if held.model is not None else 0)
