"""The per-request relay: events from two workers, out of order and duplicated, come out in
output order exactly once; failures and aborts end the stream at once; deadlines hold."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import DeadlineExceeded, FailedPrecondition, Unavailable, grpc_status
from services.gateway.relay import Relay
from tandem.v1 import common_pb2, scheduler_pb2

STOP = common_pb2.FINISH_REASON_STOP


def event(offset: int, *tokens: int, finish: int = 0, worker: str = "d-0") -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", output_offset=offset, token_ids=tokens, finish_reason=finish,
                                    worker_id=worker, logprobs=[common_pb2.TokenLogprob(token_id=t) for t in tokens])


async def drain(relay: Relay) -> list[tuple[int, list[int], int]]:
    return [(e.output_offset, list(e.token_ids), e.finish_reason) async for e in relay.events(lambda: 1.0)]


async def test_out_of_order_events_are_delivered_in_output_order() -> None:
    relay = Relay("r")
    relay.push(event(5, 60, finish=STOP))  # the decode worker's final event, first to arrive
    relay.push(event(3, 40, 50))
    relay.push(event(1, 20, 30))
    assert relay.next_offset == 0
    relay.push(event(0, 10, worker="p-0"))  # the prefill worker's first token, last to arrive
    # tokens from the same worker the reader has not taken yet join one event; the final one stays its own
    assert await drain(relay) == [(0, [10], 0), (1, [20, 30, 40, 50], 0), (5, [60], STOP)]
    assert relay.closed and relay.next_offset == 6


async def test_an_event_the_reader_took_is_never_joined_and_an_interrupt_ends_joining() -> None:
    relay = Relay("r")
    events = relay.events(lambda: 5.0)
    relay.push(event(0, 10))
    assert list((await anext(events)).token_ids) == [10]
    relay.push(event(1, 20))
    relay.push(event(2, 30))
    relay.interrupt(Unavailable("worker d-0 was lost"))
    relay.push(event(0, 40))  # the continuation numbers from 0: shifted by the 3 delivered
    relay.push(event(1, 50, finish=STOP))
    assert list((await anext(events)).token_ids) == [20, 30]
    with pytest.raises(Exception, match="worker d-0 was lost"):
        await anext(events)
    assert await drain(relay) == [(3, [40], 0), (4, [50], STOP)]


async def test_held_events_behind_a_final_one_are_dropped() -> None:
    relay = Relay("r")
    relay.push(event(1, 20, finish=STOP))
    relay.push(event(2, 30))  # a stray event past the end
    relay.push(event(0, 10))
    assert await drain(relay) == [(0, [10], 0), (1, [20], STOP)]


async def test_duplicates_are_dropped_and_overlaps_trimmed_with_their_logprobs() -> None:
    relay = Relay("r")
    relay.push(event(0, 10, worker="p-0"))
    relay.push(event(0, 10, worker="prefill-response"))  # token 0 repeated by the PrefillResponse
    overlap = event(0, 10, 20, 30)
    relay.push(overlap)
    relay.push(event(3, finish=STOP))
    assert await drain(relay) == [(0, [10], 0), (1, [20, 30], 0), (3, [], STOP)]
    assert [lp.token_id for lp in overlap.logprobs] == [20, 30]


async def test_a_final_event_repeating_delivered_tokens_still_ends_the_stream() -> None:
    relay = Relay("r")
    relay.push(event(0, 10))
    relay.push(event(0, 10, finish=STOP))  # the prefill worker's own event, after the response's copy
    assert await drain(relay) == [(0, [10], 0), (1, [], STOP)]


async def test_a_stale_final_event_behind_the_cursor_is_ignored() -> None:
    relay = Relay("r")
    relay.push(event(0, 10, 20, 30))
    relay.push(event(1, finish=STOP))  # claims the output ended at 1 token: a stale copy
    relay.push(event(3, 40, finish=STOP))
    assert await drain(relay) == [(0, [10, 20, 30], 0), (3, [40], STOP)]


async def test_a_failure_ends_the_stream_at_once_with_its_status() -> None:
    relay = Relay("r")
    relay.push(event(0, 10))
    relay.push(event(2, 30))  # held: token 1 is missing
    relay.fail(FailedPrecondition("request r: a worker failed it with FAILED_PRECONDITION"))
    relay.push(event(1, 20))
    events = relay.events(lambda: 1.0)
    assert list((await anext(events)).token_ids) == [10]
    with pytest.raises(FailedPrecondition, match="^request r: a worker failed it") as error:
        await anext(events)
    assert grpc_status(error.value) == grpc.StatusCode.FAILED_PRECONDITION


async def test_an_abort_from_a_worker_or_the_scheduler_ends_with_finish_abort() -> None:
    abort = common_pb2.FINISH_REASON_ABORT
    relay = Relay("r")
    relay.push(event(0, 10))
    relay.push(event(2, 30))
    relay.push(event(7, finish=abort))
    assert await drain(relay) == [(0, [10], 0), (1, [], abort)]

    relay = Relay("r")
    relay.push(event(0, 10, 20))
    relay.finish(abort)
    relay.push(event(2, 30))
    assert await drain(relay) == [(0, [10, 20], 0), (2, [], abort)]


async def test_fail_and_deadline_raise_their_errors() -> None:
    relay = Relay("r")
    relay.fail(Unavailable("decode worker d-0 was lost"))
    with pytest.raises(Unavailable, match="d-0 was lost"):
        await drain(relay)

    relay = Relay("slow")
    relay.push(event(0, 10))
    events = relay.events(lambda: 0.05)
    assert list((await anext(events)).token_ids) == [10]
    with pytest.raises(DeadlineExceeded, match=r"^request slow: its deadline passed after 1 token\(s\)$"):
        await anext(events)
