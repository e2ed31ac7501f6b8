"""Keeps the scheduler's prefix index true for this worker: the stored and evicted block hashes
drained from the engine after each step, attached to the step's TokenBatch on the ReportTokens
stream (`attach`: in order with the events, no call of their own), or sent with ReportBlocks while a
full resend is due or under way (the changes then follow it).

It mirrors the whole cache contents of each resident model's engine (stored minus evicted), so
after registering again, or after a report was lost, it can resend everything with `reset`. The
served model keys each hash chain, so two resident models never hold the same hash; the mirror still
holds a hash while any model does, and a model's eviction (`drop`) reports only the blocks no other
model holds, so a report can never drop a block that is still cached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import grpc

from services.common.block_hash import BlockHash
from services.worker.registration import RPC_TIMEOUT_S
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


class BlockReporter:
    """Call `note` with each step's drained events (on the asyncio loop), then `flush` to report them."""

    def __init__(
        self,
        channel: grpc.aio.Channel | None,
        worker_id: str,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel) if channel is not None else None
        self._worker_id = worker_id
        self._metadata = metadata
        self._by_model: dict[str, set[BlockHash]] = {}
        self._holders: dict[BlockHash, int] = {}  # hash -> models holding it
        self._stored: dict[BlockHash, None] = {}
        self._evicted: dict[BlockHash, None] = {}
        self._needs_reset = False
        self._changed_at: float | None = None  # time.monotonic() of the oldest change not yet taken
        self._evicted_at: float | None = None  # ... of the oldest eviction not yet taken
        self._lock = asyncio.Lock()
        self._flushing: asyncio.Task | None = None

    @property
    def cached(self) -> set[BlockHash]:
        """Every hash some resident model holds."""
        return set(self._holders)

    @property
    def num_cached(self) -> int:
        return len(self._holders)

    def note(self, model: str, stored: Iterable[BlockHash], evicted: Iterable[BlockHash]) -> None:
        """Apply one model's drained events to the mirror and to the pending report (net changes)."""
        held = self._by_model.setdefault(model, set())
        for block_hash in stored:
            if block_hash not in held:
                held.add(block_hash)
                self._hold(block_hash)
        for block_hash in evicted:
            if block_hash in held:
                held.discard(block_hash)
                self._let_go(block_hash)
        self._note_change()

    def drop(self, model: str) -> None:
        """The model left memory: its blocks are evicted (those no other model holds)."""
        for block_hash in self._by_model.pop(model, set()):
            self._let_go(block_hash)
        self._note_change()

    def _note_change(self) -> None:
        if self._changed_at is None and (self._stored or self._evicted):
            self._changed_at = time.monotonic()
        if self._evicted_at is None and self._evicted:
            self._evicted_at = time.monotonic()

    def _hold(self, block_hash: BlockHash) -> None:
        self._holders[block_hash] = self._holders.get(block_hash, 0) + 1
        if self._holders[block_hash] == 1:
            _record(block_hash, undo=self._evicted, record=self._stored)

    def _let_go(self, block_hash: BlockHash) -> None:
        self._holders[block_hash] -= 1
        if self._holders[block_hash] == 0:
            del self._holders[block_hash]
            _record(block_hash, undo=self._stored, record=self._evicted)

    def attach(self, batch: scheduler_pb2.TokenBatch, min_wait_s: float = 0.0,
               evicted_wait_s: float | None = None) -> bool:
        """Move the pending changes onto `batch` for the token stream if the oldest waited `min_wait_s`,
        or the oldest eviction `evicted_wait_s` (None: the same). False, leaving them pending, when they
        are younger, when there are none, when this worker reports no blocks, or while a full resend is
        due or under way (`resend_soon`: they follow it)."""
        if self._stub is None or self._needs_reset or self._lock.locked() or not (self._stored or self._evicted):
            return False
        if not self._due(time.monotonic(), min_wait_s, min_wait_s if evicted_wait_s is None else evicted_wait_s):
            return False
        batch.stored_blocks.extend(self._stored)
        batch.evicted_blocks.extend(self._evicted)
        self._stored.clear()
        self._evicted.clear()
        self._changed_at = self._evicted_at = None
        return True

    def _due(self, now: float, min_wait_s: float, evicted_wait_s: float) -> bool:
        if self._changed_at is None or now - self._changed_at >= min_wait_s:
            return True
        return bool(self._evicted) and self._evicted_at is not None and now - self._evicted_at >= evicted_wait_s

    def report_to(self, channel: grpc.aio.Channel) -> None:
        """ReportBlocks goes to this scheduler from now on (another replica, when the one it went to
        was lost); nothing changes for a worker that reports no blocks."""
        if self._stub is not None:
            self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)

    def resend_soon(self) -> None:
        """Start the full resend, with the changes after it, when one is due (`stream_lost`)."""
        if self._needs_reset:
            self.flush_soon()

    def stream_lost(self) -> None:
        """Changes attached to a token stream that broke may never have been applied: the next
        report resends the whole cache."""
        self._needs_reset = True

    @property
    def pending(self) -> bool:
        return bool(self._stored or self._evicted or self._needs_reset)

    def flush_soon(self) -> None:
        """Start a flush in the background unless one is already on its way."""
        if self._stub is None or not self.pending:
            return
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.create_task(self.flush(), name="report-blocks")

    async def flush(self) -> None:
        """Report the pending changes (or everything, after a failure or `reset`)."""
        if self._stub is None:
            return
        async with self._lock:
            while self.pending:  # events noted during a report go out right after it
                request = self._take_request()
                try:
                    await self._stub.ReportBlocks(request, timeout=RPC_TIMEOUT_S, metadata=self._metadata)
                except grpc.aio.AioRpcError as error:
                    log.warning("ReportBlocks failed (%s); the next report resends the whole cache",
                                error.code().name)
                    self._needs_reset = True
                    return

    async def reset(self) -> None:
        """Resend the whole cache contents, replacing what the scheduler's index knew."""
        self._needs_reset = True
        await self.flush()

    def _take_request(self) -> scheduler_pb2.ReportBlocksRequest:
        if self._needs_reset:
            request = scheduler_pb2.ReportBlocksRequest(worker_id=self._worker_id, stored=sorted(self.cached),
                                                        reset=True)
        else:
            request = scheduler_pb2.ReportBlocksRequest(worker_id=self._worker_id, stored=list(self._stored),
                                                        evicted=list(self._evicted))
        self._stored.clear()
        self._evicted.clear()
        self._changed_at = self._evicted_at = None
        self._needs_reset = False
        return request


def _record(block_hash: BlockHash, undo: dict[BlockHash, None], record: dict[BlockHash, None]) -> None:
    """A hash stored then evicted before a report (or the reverse) cancels out."""
    if block_hash in undo:
        del undo[block_hash]
    else:
        record[block_hash] = None
