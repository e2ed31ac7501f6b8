"""The workers' ReportTokens streams: long-lived streams, each named by the worker id of its first
TokenBatch, carrying each request's first and final event (never the tokens between, which go to the
gateway) and the changes to the worker's prefix cache since its last batch (applied before the events,
in the stream's order, so a block report costs no call of its own). A worker is lost when the last of
its open streams ends: its requests can no longer be seen to end, and `on_closed(worker_id, reason)`
ends their attempts and drops the worker. A worker that reconnects before its old stream's end is seen
keeps its worker, and so does one whose id a stray stream also names: the stray's end means nothing
while the real stream is open. (A killed or cancelled worker's stream may end cleanly or with an error:
both mean the same here.)

A batch that carries a final event is numbered (TokenBatch.sequence) and acknowledged once applied
(report_acks.py); the worker resends those not acknowledged at the head of its next stream, so a
stream that broke on the worker's side only (this one still open) loses no request's end. A final
event for a request that has ended already is a no-op (Dispatcher.on_token_batch), so a resend is
applied at most once."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

from services.common.block_hash import BlockHash
from services.scheduler import message_counts
from services.scheduler.message_counts import IN, REPORT_TOKENS
from services.scheduler.report_acks import StreamAcks, WriteAck
from tandem.v1 import scheduler_pb2

OnBlocks = Callable[[str, list[BlockHash], list[BlockHash]], Awaitable[None]]


class TokenStreams:
    """`on_blocks(worker_id, stored, evicted)` applies a batch's prefix-cache changes, `on_batch` its
    events; `on_closed(worker_id, reason)` when a worker's last stream ends."""

    def __init__(self, on_batch: Callable[[str, scheduler_pb2.TokenBatch], None],
                 on_closed: Callable[[str, str], None], on_blocks: OnBlocks) -> None:
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._on_blocks = on_blocks
        self._open: Counter[str] = Counter()

    def is_open(self, worker_id: str) -> bool:
        return self._open[worker_id] > 0

    async def consume(self, batches: AsyncIterator[scheduler_pb2.TokenBatch], write_ack: WriteAck | None = None) -> int:
        """Feed one stream's batches to on_batch until it ends, acknowledging the numbered ones with
        `write_ack` (None: the caller reads no acks); returns how many arrived."""
        worker_id: str | None = None
        count = 0
        acks = StreamAcks(write_ack) if write_ack is not None else None
        try:
            async for batch in batches:
                count += 1
                message_counts.count(REPORT_TOKENS, IN)
                if worker_id is None and batch.worker_id:
                    worker_id = batch.worker_id
                    self._open[worker_id] += 1
                if worker_id is None:
                    continue
                if batch.stored_blocks or batch.evicted_blocks:
                    await self._on_blocks(worker_id, [BlockHash(h) for h in batch.stored_blocks],
                                          [BlockHash(h) for h in batch.evicted_blocks])
                self._on_batch(worker_id, batch)
                if acks is not None:
                    acks.applied(batch.sequence, count)
        finally:
            # The stream's end is accounted before anything is awaited: a loss must not wait on an ack
            # being written to the worker that is gone, nor be skipped by a cancellation meanwhile.
            if worker_id is not None:
                self._open[worker_id] -= 1
                if self._open[worker_id] == 0:
                    del self._open[worker_id]
                    self._on_closed(worker_id, "its token stream closed")
            if acks is not None:
                await acks.close()
        return count
