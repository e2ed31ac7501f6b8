"""The final events a worker reported to one scheduler that it has not yet acknowledged.

A batch carrying a final event (a finish reason: the request's end, error or abort) gets the next
number (TokenBatch.sequence); its final events stay here until an ack's `applied_through` covers the
number, and are resent, numbered as before, first on the next stream. So a request's end reaches
the scheduler even when a stream breaks on the worker's side only and the batches written to it
were lost; the scheduler applies a final event for a request it no longer holds as a no-op.
"""

from __future__ import annotations

import logging

from tandem.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

# Batches kept at most: a scheduler gone for good must not grow this without end; the oldest go
# first (their requests' deadlines have long passed at any real rate).
MAX_UNACKED = 10_000


class FinalOutbox:
    """Call order: number(batch) for each batch sent -> acked(through) as acks come;
    unacked(through) lists what to resend on a new stream."""

    def __init__(self, max_unacked: int = MAX_UNACKED) -> None:
        self._max_unacked = max_unacked
        self._unacked: dict[int, scheduler_pb2.TokenBatch] = {}  # by number, oldest first
        self.last = 0  # the last number given
        self._overflowing = False  # warned of forgetting since the last ack (a scheduler that never acks)

    def __len__(self) -> int:
        return len(self._unacked)

    def number(self, batch: scheduler_pb2.TokenBatch) -> scheduler_pb2.TokenBatch:
        """The batch to send, `batch` itself: numbered when it carries a final event, whose final events
        are then kept. (Each scheduler's reporter gets batches of its own: no batch is numbered twice.)"""
        finals = [event for event in batch.events if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
        if not finals:
            return batch
        self.last += 1
        batch.sequence = self.last
        self._unacked[self.last] = scheduler_pb2.TokenBatch(worker_id=batch.worker_id, iteration=batch.iteration,
                                                            events=finals, sequence=self.last)
        if len(self._unacked) > self._max_unacked:
            dropped = self._unacked.pop(next(iter(self._unacked)))
            if not self._overflowing:
                log.warning("over %d unacknowledged final-event batches (no ack from the scheduler): the oldest "
                            "are forgotten from batch %d on", self._max_unacked, dropped.sequence)
            self._overflowing = True
        return batch

    def acked(self, through: int) -> None:
        """The scheduler applied every numbered batch up to `through`: forget them."""
        while self._unacked and (oldest := next(iter(self._unacked))) <= through:
            del self._unacked[oldest]
            self._overflowing = False

    def unacked(self, through: int) -> list[scheduler_pb2.TokenBatch]:
        """The kept batches numbered up to `through`, oldest first (their final events only)."""
        return [batch for sequence, batch in self._unacked.items() if sequence <= through]
