"""The acks on one ReportTokens stream: the first at once, then at most one an interval, cumulative
(the highest number applied, with the stream's batch count), none while nothing new was applied,
and none after the stream's end."""

from __future__ import annotations

from services.scheduler.report_acks import StreamAcks
from tandem.v1 import scheduler_pb2
from tests.waiting import eventually


async def test_acks_are_cumulative_coalesced_within_the_interval_and_stop_at_the_end() -> None:
    acks: list[tuple[int, int]] = []

    async def write(ack: scheduler_pb2.ReportAck) -> None:
        acks.append((ack.batches, ack.applied_through))

    stream = StreamAcks(write, interval_s=0.05)
    stream.applied(0, 1)  # unnumbered: nothing due, no writer started
    stream.applied(1, 2)
    await eventually(lambda: acks, "the first ack")
    stream.applied(2, 3)
    stream.applied(1, 4)  # an old number (a resend): changes nothing
    stream.applied(3, 5)
    await eventually(lambda: len(acks) == 2, "the second ack")
    stream.applied(4, 6)
    await stream.close()
    assert acks == [(2, 1), (5, 3)]  # 4's ack was due within the interval: dropped with the stream
