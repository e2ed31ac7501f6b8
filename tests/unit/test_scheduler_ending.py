"""How a running request's Submit call waits for its ending (ending.Ending.wait): the first ending
wins; the deadline fails the wait with DeadlineExceeded but leaves the ending open; a waiter that is
cancelled (the call ended) never cancels the ending, and leaves no callback or timer behind."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import DeadlineExceeded, Unavailable
from services.scheduler.ending import Ending, Lost


async def test_the_first_ending_wins_and_a_wait_after_it_returns_at_once() -> None:
    ending = Ending("r1")
    waiter = asyncio.ensure_future(ending.wait(lambda: 30.0))
    await asyncio.sleep(0)
    lost = Lost("w-1", Unavailable("w-1 was lost"))
    ending.lose(lost)
    ending.finish()  # too late: the loss came first
    assert await waiter is lost
    assert await ending.wait(lambda: 0.0) is lost


async def test_a_failure_raises_its_error() -> None:
    ending = Ending("r1")
    waiter = asyncio.ensure_future(ending.wait(lambda: None))
    await asyncio.sleep(0)
    ending.fail(Unavailable("request r1: no worker"))
    with pytest.raises(Unavailable, match="request r1: no worker"):
        await waiter


async def test_the_deadline_fails_the_wait_and_leaves_the_ending_open() -> None:
    ending = Ending("r1")
    with pytest.raises(DeadlineExceeded, match="request r1: its deadline passed while it ran"):
        await ending.wait(lambda: 0.01)
    assert not ending.closed
    ending.finish()
    assert await ending.wait(lambda: 0.0) is None


async def test_a_cancelled_waiter_leaves_the_ending_open_with_no_callback_behind() -> None:
    ending = Ending("r1")
    callbacks_before = len(ending._ended._callbacks)
    waiter = asyncio.ensure_future(ending.wait(lambda: 30.0))
    await asyncio.sleep(0)
    assert len(ending._ended._callbacks) == callbacks_before + 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not ending.closed and len(ending._ended._callbacks) == callbacks_before
    ending.finish()
    assert await ending.wait(lambda: None) is None
