"""Admission: requests run up to the capacity, then wait in a bounded FIFO queue; a full queue is
RESOURCE_EXHAUSTED with a retry hint; withdrawn tickets leave no trace."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import Overloaded, grpc_status
from services.scheduler.admission import Admission


async def test_requests_run_up_to_capacity_then_queue_then_are_refused() -> None:
    admission = Admission(max_queue=2, capacity=lambda: 1)
    assert admission.enter() is None
    first, second = admission.enter(), admission.enter()
    assert (admission.running, admission.waiting) == (1, 2)
    with pytest.raises(Overloaded, match=r"waiting queue is full \(2 requests\)") as refused:
        admission.enter()
    assert grpc_status(refused.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.trailing_metadata() == (("retry-after", "3"),)  # 1 s per request, 3 rounds ahead

    admission.release(service_s=1.0)
    assert first.done() and first.result() is True and not second.done()
    assert (admission.running, admission.waiting) == (1, 1)


async def test_withdrawn_tickets_leave_the_queue_and_granted_ones_pass_their_slot_on() -> None:
    admission = Admission(max_queue=3, capacity=lambda: 1)
    assert admission.enter() is None
    a, b, c = admission.enter(), admission.enter(), admission.enter()
    admission.withdraw(b)  # aborted while queued
    assert b.result() is False and admission.waiting == 2
    admission.release()
    assert a.result() is True and admission.running == 1
    admission.withdraw(a)  # granted, but its request was cancelled before it ran
    assert c.result() is True and (admission.running, admission.waiting) == (1, 0)


async def test_capacity_growth_lets_waiters_in() -> None:
    capacity = [0]
    admission = Admission(max_queue=5, capacity=lambda: capacity[0])
    tickets = [admission.enter() for _ in range(3)]
    capacity[0] = 2
    admission.grant()
    assert [t.done() for t in tickets] == [True, True, False]
    assert (admission.running, admission.waiting) == (2, 1)


async def test_the_retry_hint_follows_the_pace_of_service() -> None:
    admission = Admission(max_queue=0, capacity=lambda: 2)
    assert admission.enter() is None and admission.enter() is None
    for _ in range(30):
        admission.running += 1
        admission.release(service_s=10.0)
    with pytest.raises(Overloaded) as refused:
        admission.enter()
    assert refused.value.retry_after == 5.0  # ~10 s per request, 2 at a time, nobody queued
