"""Admission control: a bounded FIFO waiting queue in front of a limit on running requests.

A request runs at once when nobody waits and fewer than capacity() requests run; otherwise it
gets a ticket in the queue, and a full queue refuses it with Overloaded (RESOURCE_EXHAUSTED) and a
retry hint. A ticket resolves True when its request may run, False when it was withdrawn.
Every request that runs calls release() exactly once, which lets the next ticket in.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

from services.common.errors import Overloaded

_EMA_WEIGHT = 0.2


class Admission:
    def __init__(self, max_queue: int, capacity: Callable[[], int]) -> None:
        self.max_queue = max_queue
        self._capacity = capacity
        self._waiting: deque[asyncio.Future[bool]] = deque()
        self.running = 0
        self._service_s = 1.0  # moving average of a request's running time, for the retry hint

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def enter(self) -> asyncio.Future[bool] | None:
        """None: the request runs now. Else its ticket in the queue. Overloaded when the queue is full."""
        if not self._waiting and self.running < self._capacity():
            self.running += 1
            return None
        if len(self._waiting) >= self.max_queue:
            raise Overloaded(f"the scheduler's waiting queue is full ({self.max_queue} requests); retry later",
                             retry_after=self.retry_after())
        ticket: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append(ticket)
        return ticket

    def withdraw(self, ticket: asyncio.Future[bool]) -> None:
        """Take a ticket out of the queue (its request was aborted, cancelled or timed out).

        A ticket granted to a request that then never ran passes its slot on: call withdraw once,
        when the request ends, for a ticket whose request did not run.
        """
        if not ticket.done():
            self._waiting.remove(ticket)
            ticket.set_result(False)
        elif ticket.result():
            self.release()

    def release(self, service_s: float | None = None) -> None:
        """A running request ended (after `service_s` seconds running, when known)."""
        self.running -= 1
        if service_s is not None:
            self._service_s += _EMA_WEIGHT * (service_s - self._service_s)
        self.grant()

    def grant(self) -> None:
        """Let tickets in while there is room (also call when capacity() grew)."""
        while self._waiting and self.running < self._capacity():
            self.running += 1
            self._waiting.popleft().set_result(True)

    def retry_after(self) -> float:
        """Seconds after which a refused request may find room: the queue ahead served at the current pace."""
        rounds = (len(self._waiting) + 1) / max(1, self._capacity())
        return max(1.0, math.ceil(self._service_s * rounds))
