"""The embedded store's prefix index: block hash -> the workers caching it, as a bit mask over worker
slots. An int holds no references, so the garbage collector never walks the index (a million blocks
held as sets of worker ids made each full collection of the scheduler take 0.1 to 0.4 s), and a
chain's unbroken leading run is a running AND of its blocks' masks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.block_hash import BlockHash


class PrefixIndex:
    """Invariant: a worker has a slot from its first add() until forget(); bit `slot` is set in a
    block's mask exactly while the block is among the worker's blocks. A forgotten worker's slot is
    reused, its bits all cleared first."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}  # block -> mask of the slots caching it
        self._blocks: dict[str, dict[BlockHash, None]] = {}  # worker -> its blocks (a dict of str: not gc-tracked)
        self._slots: dict[str, int] = {}  # worker -> its slot
        self._slot_workers: list[str | None] = []  # slot -> worker (None: free)

    def add(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        """The worker caches these blocks."""
        bit = 1 << self._slot(worker_id)
        owned = self._blocks[worker_id]
        holders = self._holders
        for block_hash in hashes:
            owned[block_hash] = None
            holders[block_hash] = holders.get(block_hash, 0) | bit

    def remove(self, worker_id: str, hashes: Iterable[BlockHash]) -> None:
        """The worker evicted these blocks (unknown ones are skipped)."""
        owned = self._blocks.get(worker_id)
        if owned is None:
            return
        keep = ~(1 << self._slots[worker_id])
        for block_hash in hashes:
            if owned.pop(block_hash, 0) is None:  # it held the block
                self._clear(block_hash, keep)

    def forget(self, worker_id: str) -> None:
        """Drop every block of the worker and free its slot."""
        owned = self._blocks.pop(worker_id, None)
        slot = self._slots.pop(worker_id, None)
        if owned is None or slot is None:
            return
        keep = ~(1 << slot)
        for block_hash in owned:
            self._clear(block_hash, keep)
        self._slot_workers[slot] = None

    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Per worker holding hashes[0], how many leading blocks of the chain it holds. A block counts
        only if every block before it is held too: a worker's cache can only reuse an unbroken prefix."""
        matched: dict[str, int] = {}
        holding = self._holders.get(hashes[0], 0) if hashes else 0
        for i in range(1, len(hashes)):
            still = holding & self._holders.get(hashes[i], 0)
            self._record(holding & ~still, i, matched)
            holding = still
            if not holding:
                return matched
        self._record(holding, len(hashes), matched)
        return matched

    def _record(self, mask: int, count: int, matched: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            matched[self._slot_workers[low.bit_length() - 1]] = count
            mask ^= low

    def _slot(self, worker_id: str) -> int:
        """The worker's slot, the lowest free one given on its first add."""
        slot = self._slots.get(worker_id)
        if slot is not None:
            return slot
        try:
            slot = self._slot_workers.index(None)
        except ValueError:
            slot = len(self._slot_workers)
            self._slot_workers.append(None)
        self._slot_workers[slot] = worker_id
        self._slots[worker_id] = slot
        self._blocks[worker_id] = {}
        return slot

    def _clear(self, block_hash: BlockHash, keep: int) -> None:
        mask = self._holders.get(block_hash, 0) & keep
        if mask:
            self._holders[block_hash] = mask
        else:
            self._holders.pop(block_hash, None)
