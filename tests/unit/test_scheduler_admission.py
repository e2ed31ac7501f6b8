"""Admission: requests run up to the capacity while the head of the FIFO queue is ready, the rest wait
in order; a full queue is RESOURCE_EXHAUSTED with a retry hint from the drain rate; tickets leave
without a trace. The drain-rate estimator runs on an injected clock."""

from __future__ import annotations

import gc
import weakref

import grpc
import pytest

from services.common.errors import Overloaded, grpc_status
from services.scheduler.admission import Admission, Ticket, TicketState
from services.scheduler.drain import DrainRate
from tests.clock import FakeClock


def turns(tickets: list[Ticket]) -> list[bool | None]:
    """Each ticket's turn: True (runs), False (left the queue), None (still waiting)."""
    return [t.turn.result() if t.turn.done() else None for t in tickets]


async def test_requests_run_up_to_capacity_then_queue_in_order_then_are_refused() -> None:
    admission = Admission(max_queue=2, capacity=lambda: 1)
    running = admission.enter("r0")
    first, second = admission.enter("r1"), admission.enter("r2")
    assert turns([running, first, second]) == [True, None, None]
    assert (admission.running, admission.waiting) == (1, 2)
    with pytest.raises(Overloaded) as refused:
        admission.enter("r3")
    assert refused.value.message == ("request r3: the scheduler's waiting queue is full (2 requests); "
                                     "retry after the hinted delay")
    assert grpc_status(refused.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.trailing_metadata() == (("retry-after", "60"), ("retry-after-ms", "60000"))  # no drain yet

    admission.leave(running)
    assert turns([first, second]) == [True, None]
    admission.leave(first)
    assert turns([second]) == [True]
    assert (admission.running, admission.waiting) == (1, 0)


async def test_the_head_waits_for_room_and_nobody_passes_it() -> None:
    room = {"big": False, "small": True}
    admission = Admission(max_queue=5, capacity=lambda: 4)
    big = admission.enter("big", lambda: room["big"])
    small = admission.enter("small", lambda: room["small"])  # it would fit, but the head waits
    assert turns([big, small]) == [None, None]
    admission.grant()
    assert turns([big, small]) == [None, None]
    room["big"] = True
    admission.grant()
    assert turns([big, small]) == [True, True]
    assert (admission.running, admission.waiting) == (2, 0)


async def test_a_requeued_request_goes_back_to_the_head_without_its_slot() -> None:
    room = {"a": True}
    admission = Admission(max_queue=5, capacity=lambda: 1)
    a = admission.enter("a", lambda: room["a"])
    b = admission.enter("b")
    assert turns([a, b]) == [True, None]
    room["a"] = False  # its Reserve was refused: no room after all
    admission.requeue(a)
    assert (a.state, admission.running, admission.waiting) == (TicketState.WAITING, 0, 2)
    assert turns([a, b]) == [None, None]  # b stays behind it
    room["a"] = True
    admission.grant()
    assert turns([a, b]) == [True, None]


async def test_tickets_that_leave_pass_their_place_or_slot_on_once() -> None:
    admission = Admission(max_queue=3, capacity=lambda: 1)
    running = admission.enter("r0")
    a, b, c = admission.enter("a"), admission.enter("b"), admission.enter("c")
    admission.leave(b)  # aborted while queued
    assert turns([b]) == [False] and admission.waiting == 2
    admission.leave(b)  # leaving twice changes nothing
    admission.leave(running)
    assert turns([a, c]) == [True, None] and admission.running == 1
    admission.leave(a)  # granted, but its request ended before it ran
    assert turns([c]) == [True] and (admission.running, admission.waiting) == (1, 0)


async def test_capacity_growth_lets_waiters_in() -> None:
    capacity = [0]
    admission = Admission(max_queue=5, capacity=lambda: capacity[0])
    tickets = [admission.enter(f"r{i}") for i in range(3)]
    capacity[0] = 2
    admission.grant()
    assert turns(tickets) == [True, True, None]
    assert (admission.running, admission.waiting) == (2, 1)


async def test_the_retry_hint_follows_the_drain_rate() -> None:
    clock = FakeClock()
    admission = Admission(max_queue=2, capacity=lambda: 1, drain=DrainRate(window_s=30.0, clock=clock))
    running = admission.enter("r0")
    for i in range(10):  # ten requests end in 20 s: 0.5 per second
        clock.now += 2.0
        admission.leave(running)
        running = admission.enter(f"next{i}")
    admission.enter("w1")
    admission.enter("w2")
    with pytest.raises(Overloaded) as refused:
        admission.enter("refused")
    # (2 waiting + 1) / 0.5 per second
    assert refused.value.trailing_metadata() == (("retry-after", "6"), ("retry-after-ms", "6000"))


async def test_a_ticket_that_left_frees_its_request_without_the_garbage_collector() -> None:
    """The readiness check refers back to its request, which holds the ticket: after leave() nothing
    of that cycle is left, so the request is freed at once (as the scheduler's states are, one per request)."""

    class Request:
        ticket: Ticket | None = None

    admission = Admission(max_queue=2, capacity=lambda: 1)
    gc.disable()
    try:
        for leaves_waiting in (False, True):
            blocker = admission.enter("blocker") if leaves_waiting else None
            request = Request()
            request.ticket = admission.enter("r", lambda request=request: request is not None)
            assert request.ticket.state is (TicketState.WAITING if leaves_waiting else TicketState.RUNNING)
            freed = weakref.ref(request)
            admission.leave(request.ticket)
            del request
            assert freed() is None
            if blocker is not None:
                admission.leave(blocker)
    finally:
        gc.enable()
    assert (admission.running, admission.waiting) == (0, 0)


def test_drain_rate_counts_the_sliding_window_only() -> None:
    clock = FakeClock()
    drain = DrainRate(window_s=10.0, clock=clock)
    assert drain.per_second() == 0.0 and drain.retry_after(waiting=3) == 60.0  # nothing drained: the longest hint
    clock.now += 5.0
    for _ in range(10):
        drain.record()
    assert drain.per_second() == 2.0  # 10 in the 5 s since it started
    assert drain.retry_after(waiting=3) == 2.0  # (3 + 1) / 2
    clock.now += 5.0
    assert drain.per_second() == 1.0  # 10 in the full 10 s window
    assert drain.retry_after(waiting=2) == 3.0
    assert drain.retry_after(waiting=0) == 1.0
    drain.record()
    assert drain.retry_after(waiting=0) == 1.0  # clamped: (0 + 1) / 1.1
    assert drain.retry_after(waiting=1000) == 60.0  # clamped
    clock.now += 5.0
    assert drain.per_second() == 0.1  # the first ten slid out of the window
