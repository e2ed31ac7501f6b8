"""The worker's unacknowledged final events to one scheduler: a batch with a final event is numbered
and its final events (only) kept until an ack covers the number; the rest of the batch and batches
without one go unnumbered and are not kept; the oldest go first past the bound."""

from __future__ import annotations

from services.worker.final_outbox import FinalOutbox
from tandem.v1 import common_pb2, scheduler_pb2


def event(request_id: str, finish: int = common_pb2.FINISH_REASON_UNSPECIFIED) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id=request_id, token_ids=[7], finish_reason=finish)


def batch(*events: scheduler_pb2.TokenEvent, stored: tuple[str, ...] = ()) -> scheduler_pb2.TokenBatch:
    return scheduler_pb2.TokenBatch(worker_id="w-1", iteration=3, events=events, batch_size=2, stored_blocks=stored)


def ids(batches: list[scheduler_pb2.TokenBatch]) -> list[tuple[int, list[str]]]:
    return [(b.sequence, [e.request_id for e in b.events]) for b in batches]


def test_only_batches_with_a_final_event_are_numbered_and_only_their_final_events_kept() -> None:
    outbox = FinalOutbox()
    first_only = batch(event("a"))
    assert outbox.number(first_only) is first_only and first_only.sequence == 0
    mixed = batch(event("b"), event("c", common_pb2.FINISH_REASON_LENGTH), stored=("h1",))
    sent = outbox.number(mixed)
    assert sent is mixed  # numbered in place: each scheduler's reporter gets batches of its own
    assert (sent.sequence, [e.request_id for e in sent.events], list(sent.stored_blocks)) == (1, ["b", "c"], ["h1"])
    outbox.number(batch(event("d", common_pb2.FINISH_REASON_ERROR)))
    assert ids(outbox.unacked(2)) == [(1, ["c"]), (2, ["d"])]
    assert not outbox.unacked(2)[0].stored_blocks and outbox.last == 2


def test_an_ack_forgets_every_batch_up_to_its_number_and_a_resend_stops_at_its_bound() -> None:
    outbox = FinalOutbox()
    for name in "abc":
        outbox.number(batch(event(name, common_pb2.FINISH_REASON_STOP)))
    assert ids(outbox.unacked(2)) == [(1, ["a"]), (2, ["b"])]  # 3 is still queued: it goes in its turn
    outbox.acked(2)
    assert ids(outbox.unacked(3)) == [(3, ["c"])] and len(outbox) == 1
    outbox.acked(1)  # a late, older ack changes nothing
    assert len(outbox) == 1
    outbox.acked(3)
    assert outbox.unacked(3) == [] and len(outbox) == 0


def test_past_the_bound_the_oldest_batch_is_forgotten_with_one_warning_until_an_ack(caplog) -> None:
    outbox = FinalOutbox(max_unacked=2)
    for name in "abcd":
        outbox.number(batch(event(name, common_pb2.FINISH_REASON_ABORT)))
    assert ids(outbox.unacked(4)) == [(3, ["c"]), (4, ["d"])]
    outbox.acked(3)
    for name in "ef":
        outbox.number(batch(event(name, common_pb2.FINISH_REASON_ABORT)))
    assert ids(outbox.unacked(6)) == [(5, ["e"]), (6, ["f"])]
    assert [r.getMessage().split(": ")[1] for r in caplog.records] == [
        "the oldest are forgotten from batch 1 on", "the oldest are forgotten from batch 4 on"]
