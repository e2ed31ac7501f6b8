"""Admission control: a bounded FIFO waiting queue in front of a limit on running requests.

Model: every request holds a Ticket. The head of the queue runs when fewer than capacity()
requests run and its `ready()` holds (a decode worker has room for its KV); the requests behind
it wait their turn, first come first served, as in vLLM's waiting queue. A request that finds the
queue empty runs at once under the same two conditions. A full queue refuses with Overloaded
(RESOURCE_EXHAUSTED) and a retry hint from the drain rate. grant() lets tickets in: call it
whenever the capacity or a worker's room may have grown (a request ended, a worker registered or
reported its load). A running request that could not be placed after all goes back to the head
with requeue(). Every ticket leaves exactly once, with leave(), when its request ends.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from services.common.errors import Overloaded
from services.scheduler.drain import DrainRate


class TicketState(IntEnum):
    WAITING = 0
    RUNNING = 1
    LEFT = 2


def _never() -> bool:
    return False


def _new_turn() -> asyncio.Future[bool]:
    return asyncio.get_running_loop().create_future()


@dataclass(slots=True, eq=False)
class Ticket:
    """`turn` resolves True when the request may run, False when it left the queue without running."""

    ready: Callable[[], bool]
    state: TicketState = TicketState.WAITING
    turn: asyncio.Future[bool] = field(default_factory=_new_turn)


class Admission:
    def __init__(self, max_queue: int, capacity: Callable[[], int], drain: DrainRate | None = None) -> None:
        self.max_queue = max_queue
        self._capacity = capacity
        self._drain = drain or DrainRate()
        self._queue: deque[Ticket] = deque()
        self.running = 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def enter(self, request_id: str, ready: Callable[[], bool] = lambda: True) -> Ticket:
        """The request's ticket, already granted when it may run now. Overloaded when the queue is full."""
        ticket = Ticket(ready)
        if not self._queue and self._may_run(ticket):
            self._run(ticket)
            return ticket
        if len(self._queue) >= self.max_queue:
            raise Overloaded(f"request {request_id}: the scheduler's waiting queue is full "
                             f"({self.max_queue} requests); retry after the hinted delay",
                             retry_after=self.retry_after())
        self._queue.append(ticket)
        return ticket

    def requeue(self, ticket: Ticket) -> None:
        """A running request could not be placed after all: it gives up its slot and waits again, at the head."""
        assert ticket.state is TicketState.RUNNING, ticket.state
        self.running -= 1
        ticket.state, ticket.turn = TicketState.WAITING, _new_turn()
        self._queue.appendleft(ticket)
        self.grant()

    def leave(self, ticket: Ticket) -> None:
        """The request ended (or left the queue): its place or its slot passes on. Idempotent."""
        if ticket.state is TicketState.WAITING:
            self._queue.remove(ticket)
            ticket.turn.set_result(False)
        elif ticket.state is TicketState.RUNNING:
            self.running -= 1
            self._drain.record()
        ticket.state = TicketState.LEFT
        ticket.ready = _never  # drops the request's readiness check, which refers back to the request: no
        # cycle is left for the garbage collector to find (one per request, each holding its state and span)
        self.grant()

    def grant(self) -> None:
        """Let tickets in from the head while there is a slot and the head is ready."""
        while self._queue and self._may_run(self._queue[0]):
            self._run(self._queue.popleft())

    def retry_after(self) -> float:
        """Seconds after which a refused request may find room: the queue ahead drained at the observed pace."""
        return self._drain.retry_after(len(self._queue))

    def _may_run(self, ticket: Ticket) -> bool:
        return self.running < self._capacity() and ticket.ready()

    def _run(self, ticket: Ticket) -> None:
        self.running += 1
        ticket.state = TicketState.RUNNING
        ticket.turn.set_result(True)
