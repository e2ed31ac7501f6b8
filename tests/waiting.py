"""Waiting in tests: poll the condition a test checks until it holds, never sleep a fixed time.

The deadline only ends a failing test; a passing one returns as soon as its condition holds, so
the default is generous enough for a 2-core machine that other work is loading.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 30.0
# The bound on a service process's start (python and torch imports, a model or tokenizer load), which
# a loaded machine stretches most: at load 14 on 2 cores one took over 90 s from spawn to SERVING.
START_S = 240.0
_POLL_S = 0.02


def wait_until(probe: Callable[[], T], what: str, timeout: float = DEADLINE_S, poll: float = _POLL_S) -> T:
    """The first truthy value `probe()` returns; AssertionError naming `what` once `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout:g}s (last value {value!r})")
        time.sleep(poll)
    return value


async def eventually(probe: Callable[[], T], what: str, timeout: float = DEADLINE_S) -> T:
    """`wait_until` inside an event loop: the loop keeps running between the polls."""
    return await eventually_async(_returning(probe), what, timeout)


async def eventually_async(probe: Callable[[], Awaitable[T]], what: str, timeout: float = DEADLINE_S) -> T:
    """The first truthy value the coroutine `probe()` returns; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := await probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout:g}s (last value {value!r})")
        await asyncio.sleep(_POLL_S)
    return value


def _returning(probe: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    async def call() -> T:
        return probe()

    return call
