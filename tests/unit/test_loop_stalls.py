"""The event-loop stall probe: a blocked loop is reported with its length, its CPU and its collections."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time

import pytest

from services.common import loop_stalls
from services.common.loop_stalls import Stall


async def _first_stall(block) -> Stall:
    """Start the probe, block the loop with `block` once the probe sleeps, and return the first stall reported."""
    stalls: asyncio.Queue[Stall] = asyncio.Queue()
    probe = asyncio.create_task(loop_stalls.watch(2.0, stalls.put_nowait))
    await asyncio.sleep(0)  # the probe is asleep now
    block()
    try:
        return await asyncio.wait_for(stalls.get(), timeout=10)
    finally:
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)


async def test_a_blocked_loop_is_reported_with_its_length_and_little_cpu() -> None:
    stall = await _first_stall(lambda: time.sleep(0.05))
    assert stall.late_ms >= 50 - loop_stalls.PERIOD_S * 1e3
    assert stall.window_ms >= 50
    assert stall.cpu_ms < stall.window_ms / 2  # sleeping: the thread waited, it did not compute
    assert "woke" in stall.describe() and "process CPU" in stall.describe()
    assert 0 <= stall.queued_ms <= stall.window_ms + 1  # time runnable without a core: the load decides how much


async def test_a_collection_in_the_stall_is_named() -> None:
    def collect_while_blocked() -> None:
        gc.collect()
        time.sleep(0.03)

    stall = await _first_stall(collect_while_blocked)
    assert 2 in [c.generation for c in stall.collections]  # gen0 passes may run too
    assert "gen2" in stall.describe()
    assert loop_stalls.CollectionTimes not in map(type, gc.callbacks)  # removed with the probe


async def test_off_unless_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(loop_stalls.STALL_LOG_ENV, raising=False)
    assert loop_stalls.watch_from_env() is None
    monkeypatch.setenv(loop_stalls.STALL_LOG_ENV, "two")
    with pytest.raises(ValueError, match="milliseconds"):
        loop_stalls.watch_from_env()


def test_a_logged_stall_reads_back() -> None:
    stall = Stall(12.3, 17.3, 2.5, 3.5, 8.1,
                  (loop_stalls.Collection(0, 0.0, 0.2), loop_stalls.Collection(2, 0.0, 9.8)))
    assert Stall.parse(f"2026-12-02 15:18:46,941 WARNING tandem.stalls: {stall.describe()}") == stall
    assert Stall.parse("2026-12-02 15:18:46,941 INFO tandem.scheduler: serving") is None


def test_collections_timed_on_another_thread_meanwhile_do_not_break_reading_them() -> None:
    times = loop_stalls.CollectionTimes(keep=64)
    stop = threading.Event()

    def collect() -> None:  # as collections triggered on gRPC's threads would call it
        while not stop.is_set():
            times("start", {"generation": 0})
            times("stop", {"generation": 0})

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    collector = threading.Thread(target=collect)
    collector.start()
    try:
        for _ in range(20_000):  # a deque appended to meanwhile raised within ~1,000 of these
            assert len(times.since(0.0)) <= 64
    finally:
        stop.set()
        collector.join()
        sys.setswitchinterval(switch)


def test_the_last_collections_are_kept() -> None:
    times = loop_stalls.CollectionTimes(keep=3)
    for generation in (0, 1, 2, 0, 1):
        times("start", {"generation": generation})
        times("stop", {"generation": generation})
    assert [c.generation for c in times.since(0.0)] == [2, 0, 1]
