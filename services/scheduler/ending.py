"""How a running request ends, as the scheduler learns it. The scheduler carries no tokens: once a
request is placed, its Submit call waits for one ending, and the first one wins:

- finish(): its worker reported the final event (or it was aborted): the call ends OK;
- fail(error): the call ends with the error's status;
- lose(lost): the worker generating it was lost: the gateway is told, and submits the
  continuation (prompt plus the tokens it delivered) if the request may move on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import DeadlineExceeded, TandemError


@dataclass(frozen=True, slots=True)
class Lost:
    """The attempt's worker `worker_id` was lost; `error` is what the client gets if it cannot move."""

    worker_id: str
    error: TandemError


class Ending:
    """Call order: finish()/fail()/lose() from anywhere on the event loop; wait() once, by the Submit call."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._ended: asyncio.Future[Lost | None] = asyncio.get_running_loop().create_future()
        self._ended.add_done_callback(lambda f: f.exception())  # seen, even when nobody waits any more

    @property
    def closed(self) -> bool:
        return self._ended.done()

    def finish(self) -> None:
        if not self.closed:
            self._ended.set_result(None)

    def fail(self, error: TandemError) -> None:
        if not self.closed:
            self._ended.set_exception(error)

    def lose(self, lost: Lost) -> None:
        if not self.closed:
            self._ended.set_result(lost)

    async def wait(self, remaining: Callable[[], float | None]) -> Lost | None:
        """None when the request finished, Lost when its worker was lost; raises the failure, or
        DeadlineExceeded when `remaining()` (seconds left, None: no deadline) runs out first. The
        waiter is cancelled alone, never the ending (as wait_for over shield, with one future and
        one timer instead of their five futures and callbacks: this runs once per request)."""
        if not self.closed:
            await self._until_ended(remaining())
        if not self.closed:
            raise DeadlineExceeded(f"request {self.request_id}: its deadline passed while it ran")
        return self._ended.result()

    async def _until_ended(self, timeout: float | None) -> None:
        """Returns when the request ended or `timeout` seconds passed, whichever comes first."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_: object) -> None:
            if not waiter.done():
                waiter.set_result(None)

        self._ended.add_done_callback(wake)
        timer = None if timeout is None else loop.call_later(max(0.0, timeout), wake, None)
        try:
            await waiter
        finally:
            self._ended.remove_done_callback(wake)
            if timer is not None:
                timer.cancel()
