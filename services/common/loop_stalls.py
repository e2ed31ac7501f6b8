"""Event-loop stalls, to find what makes a service's latency tail: a probe that wakes every PERIOD_S
and reports each wake later than a threshold, with the loop thread's CPU over that window (its own
work, against waiting for a core) and the garbage collections run in it. Off unless asked
(`TANDEM_STALL_LOG_MS`, read by `watch_from_env`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tandem.stalls")

STALL_LOG_ENV = "TANDEM_STALL_LOG_MS"
PERIOD_S = 0.005  # the probe's sleep: 200 wakes a second while it runs
_DESCRIBED = re.compile(r"event loop stalled: woke ([\d.]+) ms late; loop thread CPU ([\d.]+) ms of the ([\d.]+) ms "
                        r"window, process CPU ([\d.]+) ms, waiting for a core ([\d.]+) ms; gc: (.*)$")
_SCHEDSTAT = "/proc/thread-self/schedstat"  # Linux: CPU ns, ns runnable but waiting for a core, timeslices
_COLLECTION = re.compile(r"gen(\d) ([\d.]+) ms")


@dataclass(frozen=True, slots=True)
class Collection:
    """One garbage collection: its generation, when it began (perf_counter s) and how long it took."""

    generation: int
    start: float
    ms: float


@dataclass(frozen=True, slots=True)
class Stall:
    """A wake `late_ms` after it was due; over the `window_ms` since the probe last slept, the loop
    thread ran `cpu_ms` (near window_ms: the loop's own work; far below: it waited, for a core or for
    the GIL), the whole process `process_cpu_ms` (its other threads' share: what held the GIL, or a
    core), the loop thread was runnable but without a core for `queued_ms` (the machine's load; 0
    where Linux's schedstat is missing), and `collections` ran."""

    late_ms: float
    window_ms: float
    cpu_ms: float
    process_cpu_ms: float
    queued_ms: float
    collections: tuple[Collection, ...]

    def describe(self) -> str:
        gcs = ", ".join(f"gen{c.generation} {c.ms:.1f} ms" for c in self.collections) or "none"
        return (f"event loop stalled: woke {self.late_ms:.1f} ms late; loop thread CPU {self.cpu_ms:.1f} ms "
                f"of the {self.window_ms:.1f} ms window, process CPU {self.process_cpu_ms:.1f} ms, "
                f"waiting for a core {self.queued_ms:.1f} ms; gc: {gcs}")

    @staticmethod
    def parse(line: str) -> Stall | None:
        """The stall a log line describes (its figures to 0.1 ms; collections without their start); None
        for any other line."""
        found = _DESCRIBED.search(line)
        if found is None:
            return None
        late, cpu, window, process, queued = (float(found[i]) for i in range(1, 6))
        collections = tuple(Collection(int(gen), 0.0, float(ms)) for gen, ms in _COLLECTION.findall(found[6]))
        return Stall(late, window, cpu, process, queued, collections)


class CollectionTimes:
    """gc.callbacks entry timing each collection; keeps the last `keep`. A collection may run on any
    thread, between two steps of since() on the loop's: each one replaces the tuple rather than
    changing it, so since() reads one whole tuple (a deque appended to meanwhile raised RuntimeError,
    which ended the probe)."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._recent: tuple[Collection, ...] = ()
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            collection = Collection(info["generation"], self._started, (now - self._started) * 1e3)
            self._recent = (*self._recent, collection)[-self._keep:]

    def since(self, start: float) -> tuple[Collection, ...]:
        return tuple(c for c in self._recent if c.start >= start)


async def watch(threshold_ms: float, report: Callable[[Stall], None]) -> None:
    """Report every stall of the running loop longer than threshold_ms, until cancelled."""
    times = CollectionTimes()
    gc.callbacks.append(times)
    try:
        while True:
            slept_at, cpu_at, process_at = time.perf_counter(), time.thread_time(), time.process_time()
            queued_at = queued_ns()
            await asyncio.sleep(PERIOD_S)
            woke = time.perf_counter()
            late_ms = (woke - slept_at - PERIOD_S) * 1e3
            if late_ms > threshold_ms:
                report(Stall(late_ms, (woke - slept_at) * 1e3, (time.thread_time() - cpu_at) * 1e3,
                             (time.process_time() - process_at) * 1e3, (queued_ns() - queued_at) / 1e6,
                             times.since(slept_at)))
    finally:
        gc.callbacks.remove(times)


def queued_ns() -> int:
    """Nanoseconds this thread has been runnable without a core so far (0 where Linux's schedstat is missing)."""
    try:
        with open(_SCHEDSTAT, "rb") as stat:
            return int(stat.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def watch_from_env() -> asyncio.Task[None] | None:
    """The probe logging stalls over TANDEM_STALL_LOG_MS milliseconds, when that is set; else None."""
    threshold = os.environ.get(STALL_LOG_ENV)
    if not threshold:
        return None
    try:
        threshold_ms = float(threshold)
    except ValueError:
        raise ValueError(f"{STALL_LOG_ENV}={threshold!r}: expected the stall threshold in milliseconds, "
                         "e.g. 2") from None
    return asyncio.create_task(watch(threshold_ms, lambda stall: log.warning("%s", stall.describe())),
                               name="loop-stalls")
