"""A service's event loop: uvloop's (libuv: its polling, transports and callbacks in C) when uvloop
is installed, asyncio's otherwise or when asked (`--event-loop asyncio`). The gateway's CPU per SSE
event and the scheduler's per message are in large part the loop's own work (waking a task, a
socket read or write, the poll, a future's callbacks); everything else runs the same on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # auto: uvloop when installed


class EventLoopError(Exception):
    """The event loop asked for cannot be had."""


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The new-loop function for `choice` (one of EVENT_LOOPS); None: asyncio's default."""
    if choice not in EVENT_LOOPS:
        raise EventLoopError(f"--event-loop {choice!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise EventLoopError("--event-loop uvloop: uvloop is not installed (pip install uvloop), "
                                 "or pass --event-loop asyncio") from None
        return None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """'uvloop' or 'asyncio', for the log."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """asyncio.run(main) on the loop `choice` gives; `main` is closed unstarted when there is none."""
    try:
        factory = loop_factory(choice)
    except EventLoopError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
