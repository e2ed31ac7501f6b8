"""The in-flight table: a request's Status only moves forward, through the table; a continuation
is found by its own attempt id; closing happens once and takes both ids out."""

from __future__ import annotations

from opentelemetry import trace

from services.scheduler.deadline import Deadline
from services.scheduler.inflight import InflightTable, Placement, RequestState, Status
from services.scheduler.ending import Ending
from tandem.v1 import scheduler_pb2


def request(request_id: str) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, token_ids=[1, 2, 3])


def opened(table: InflightTable, attempt_id: str = "r1") -> RequestState:
    state = RequestState(request("r1"), Deadline(), trace.INVALID_SPAN, Ending("r1"), Placement(request(attempt_id)))
    table.add(state)
    return state


async def test_a_status_moves_forward_only() -> None:
    table = InflightTable()
    state = opened(table)
    assert state.status is Status.PENDING
    table.advance(state, Status.DECODING)  # the decode worker reported before token 0 came back
    table.advance(state, Status.GENERATING)
    assert state.status is Status.DECODING
    table.advance(state, Status.CLOSED)  # only close() closes
    assert state.status is Status.DECODING and "r1" in table


async def test_a_continuation_is_found_by_its_attempt_id() -> None:
    table = InflightTable()
    state = opened(table, "r1#migrated-1")
    assert table.by_attempt("r1") is None and table.by_attempt("r1#migrated-1") is state
    assert table.get("r1") is state and "r1#migrated-1" in table


async def test_closing_happens_once_and_takes_both_ids_out() -> None:
    table = InflightTable()
    state = opened(table, "r1#migrated-1")
    assert table.close(state) is True and state.status is Status.CLOSED
    assert table.close(state) is False
    assert "r1" not in table and "r1#migrated-1" not in table and len(table) == 0
    table.advance(state, Status.GENERATING)
    assert state.status is Status.CLOSED
