"""The engine thread of a worker: it runs `engine.step()` while there is work and sleeps otherwise.

The engine is not thread-safe, so everything that touches it goes through `await loop.call(fn)`,
which runs `fn(engine)` in the engine thread at the next iteration boundary. Each step's outputs
(with the prefix-cache events it caused and a load snapshot) go back to the asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from services.common.block_hash import BlockHash
from services.runtime.counters import EngineCounters
from services.runtime.engine import Engine, IterationWork, RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
# How long the thread sleeps when requests wait but none could be scheduled (no free blocks):
# whatever frees blocks arrives as a call, which wakes it earlier.
_STALL_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's load and a copy of its counters, taken in the engine thread (safe to read anywhere)."""

    num_blocks: int = 0
    allocatable_blocks: int = 0  # free list plus cached-but-unreferenced (evictable)
    cached_blocks: int = 0  # cached and unreferenced
    referenced_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    counters: EngineCounters = field(default_factory=EngineCounters)

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        blocks, scheduler = engine.blocks, engine.scheduler
        prefilling = [s for s in scheduler.running if s.num_uncomputed_tokens > 1]
        return cls(
            num_blocks=blocks.num_blocks,
            allocatable_blocks=blocks.num_free_blocks,
            cached_blocks=blocks.num_cached_blocks,
            referenced_blocks=blocks.num_referenced_blocks,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            queued_prefill_tokens=sum(s.num_uncomputed_tokens for s in (*scheduler.waiting, *prefilling)),
            counters=engine.counters.copy(),
        )


def combined(snapshots: Iterable[EngineSnapshot], retired: EngineCounters) -> EngineSnapshot:
    """The snapshots of a worker's engines (one per resident model) as one, its counters on top of
    `retired` (those of the engines evicted so far, so no counter goes down when a model leaves)."""
    total = EngineSnapshot(counters=retired)
    for snapshot in snapshots:
        total = EngineSnapshot(
            num_blocks=total.num_blocks + snapshot.num_blocks,
            allocatable_blocks=total.allocatable_blocks + snapshot.allocatable_blocks,
            cached_blocks=total.cached_blocks + snapshot.cached_blocks,
            referenced_blocks=total.referenced_blocks + snapshot.referenced_blocks,
            running=total.running + snapshot.running,
            waiting=total.waiting + snapshot.waiting,
            queued_prefill_tokens=total.queued_prefill_tokens + snapshot.queued_prefill_tokens,
            counters=total.counters.plus(snapshot.counters),
        )
    return total


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine iteration produced, handed to the asyncio loop.

    `running_ids` are the requests in the running batch after the step (started ones);
    `work` what each request of the step computed (empty when only calls ran: such a result
    carries what they changed, e.g. blocks a reservation evicted or a release freed);
    `stored`/`evicted` the prefix-cache changes since the previous result.
    """

    outputs: list[RequestOutput]
    batch_size: int
    iteration: int
    started_ns: int
    ended_ns: int
    work: dict[str, IterationWork]
    running_ids: frozenset[str]
    stored: list[BlockHash]
    evicted: list[BlockHash]
    snapshot: EngineSnapshot


@dataclass(slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: asyncio.Future


class EngineLoop:
    """Owns the engine thread. Call order: start() -> call(...)* -> stop().

    `on_step(result)` runs on the asyncio loop after every iteration, and after calls that ran
    between iterations (their effect shows in its snapshot and block events); `on_failure(exc)`
    once if `engine.step()` raises, after which the thread stops and pending calls fail (the
    worker cannot continue with an engine in an unknown state).
    """

    def __init__(
        self,
        engine: Engine,
        on_step: Callable[[StepResult], None],
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._calls: list[_Call] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self.snapshot = EngineSnapshot.of(engine)
        self.failure: BaseException | None = None
        self.batch_window_s = 0.0  # the scheduler's batching window: see _gather

    def start(self) -> None:
        self._aio = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stops the thread after its current iteration; pending calls are cancelled."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs fn(engine) in the engine thread at the next iteration boundary; returns its result."""
        if self._aio is None:
            raise RuntimeError("EngineLoop.call before start()")
        future = self._aio.create_future()
        with self._cond:
            if self._stopping or self.failure is not None:
                raise RuntimeError("the engine loop has stopped; the worker is shutting down")
            self._calls.append(_Call(fn, future))
            self._cond.notify()
        return await future

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        # Thread counts are per thread for OpenMP: set them in the thread that runs the model.
        if self.engine.config.num_threads:
            torch.set_num_threads(self.engine.config.num_threads)
        try:
            while self._next_round():
                pass
        except BaseException as exc:  # noqa: BLE001 - reported to the worker, which shuts down
            log.exception("engine step failed; the worker stops serving")
            self.failure = exc
            if self._on_failure is not None:
                self._deliver(self._on_failure, exc)
        finally:
            self._cancel_pending()

    def _next_round(self) -> bool:
        """Runs the pending calls then one step; False once stopping."""
        calls = self._wait_for_work()
        if calls is None:
            return False
        self._run_calls(self._gather(calls))
        stepped = self._step(changed=bool(calls))
        if not stepped and self.engine.has_unfinished():
            self._stall()
        return True

    def _gather(self, calls: list[_Call]) -> list[_Call]:
        """Calls arriving while nothing runs open a batching window: the calls of the next
        `batch_window_s` join them, so prompts arriving together prefill in one step."""
        if not calls or self.batch_window_s <= 0 or self.engine.scheduler.running:
            return calls
        deadline = time.monotonic() + self.batch_window_s
        with self._cond:
            while not self._stopping and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            calls, self._calls = calls + self._calls, []
        return calls

    def _run_calls(self, calls: list[_Call]) -> None:
        if not calls:
            return
        results = [self._run_call(call) for call in calls]
        self.snapshot = EngineSnapshot.of(self.engine)  # before the callers resume: Stats sees their effect
        for call, (ok, value) in zip(calls, results):
            self._deliver(_set_result if ok else _set_exception, call.future, value)

    def _step(self, changed: bool) -> bool:
        """One engine iteration if there is work; True when it ran one."""
        engine = self.engine
        started_ns = time.time_ns()
        iteration = engine.counters.iterations
        outputs = engine.step() if engine.has_unfinished() else []
        stepped = engine.counters.iterations != iteration
        self._publish(outputs, started_ns, engine.last_work if stepped else {}, stepped or changed)
        return stepped

    def _stall(self) -> None:
        """Requests wait but none could be scheduled (no free blocks): sleep until a call or a short timeout."""
        with self._cond:
            if not self._calls and not self._stopping:
                self._cond.wait(_STALL_WAIT_S)

    def _wait_for_work(self) -> list[_Call] | None:
        with self._cond:
            while not (self._calls or self._stopping or self.engine.has_unfinished()):
                self._cond.wait()
            if self._stopping:
                return None
            calls, self._calls = self._calls, []
            return calls

    def _run_call(self, call: _Call) -> tuple[bool, Any]:
        """(True, result) or (False, the exception, for the caller)."""
        try:
            return True, call.fn(self.engine)
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            return False, exc

    def _publish(self, outputs: list[RequestOutput], started_ns: int, work: dict[str, IterationWork],
                 changed: bool) -> None:
        if not changed:
            return
        engine = self.engine
        self.snapshot = EngineSnapshot.of(engine)
        stored, evicted = engine.blocks.drain_events()
        result = StepResult(
            outputs=outputs,
            batch_size=engine.counters.last_batch_size if work else 0,
            iteration=engine.counters.iterations,
            started_ns=started_ns,
            ended_ns=time.time_ns(),
            work=work,
            running_ids=frozenset(s.request_id for s in engine.scheduler.running),
            stored=stored,
            evicted=evicted,
            snapshot=self.snapshot,
        )
        self._deliver(self._on_step, result)

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._aio is not None
        try:
            self._aio.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the asyncio loop is closed: the process is exiting
            pass

    def _cancel_pending(self) -> None:
        with self._cond:
            self._stopping = True
            calls, self._calls = self._calls, []
        error = RuntimeError("the engine loop stopped before running this call")
        for call in calls:
            self._deliver(_set_exception, call.future, error)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
