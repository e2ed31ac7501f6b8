"""KV block bookkeeping: block ids, reference counts, the free list and the prefix cache.

The manager owns no tensors; it decides which block of the paged KV cache holds what.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict

from services.common.block_hash import BlockHash, hash_chain, hash_next_block


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than are free or evictable."""


class BlockManager:
    """Ref-counted KV blocks with a hash-indexed prefix cache and LRU eviction.

    Invariants:
    - Every block is in exactly one state: *free* (on the free list, no hash), *cached* (hash
      known, ref count 0, in the LRU, evictable) or *referenced* (ref count > 0; it may also be
      indexed under a hash, and a hit on it shares it).
    - Eviction only takes cached blocks, oldest released first; a referenced block is never
      reused. Allocation order is deterministic: free blocks lowest id first, then eviction.
    - A hash maps to at most one block, and a hit compares the block's stored tokens as well,
      so even a forged hash collision never returns a block holding other tokens.

    A request's protocol: `match_prefix` -> `acquire` the hits -> `allocate` the rest (check
    `can_allocate` after acquiring: a hit on a cached block takes it out of the evictable pool)
    -> `commit` each block as it fills (under `hash_next`) -> `release` all of them when the request ends.

    `model` is the served name of the model whose KV the blocks hold ("" for an engine serving no
    name, in-process): the first key of every hash chain here, so no two models share a block.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True, model: str = "") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be at least 1")
        self.num_blocks = num_blocks
        self.model = model
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks))  # a heap: lowest id first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self._hash_of: dict[int, BlockHash] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[BlockHash, int] = {}
        self._num_referenced = 0
        # Net changes since the last drain; a hash is never in both at once.
        self._stored: dict[BlockHash, None] = {}
        self._evicted: dict[BlockHash, None] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: truly free plus cached with ref count 0."""
        return len(self._free) + len(self._lru)

    @property
    def num_referenced_blocks(self) -> int:
        return self._num_referenced

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the cached state: hash known, ref count 0, evictable."""
        return len(self._lru)

    def usage(self) -> float:
        """The fraction of blocks referenced by running sequences."""
        return self._num_referenced / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is indexed in the prefix cache (it may be referenced too)."""
        self._check_id(block_id)
        return block_id in self._hash_of

    def match_prefix(self, hashes: list[BlockHash], token_blocks: list[tuple[int, ...]]) -> list[int]:
        """The blocks of the longest leading run cached under `hashes` with equal stored tokens.

        Ref counts and LRU order are left alone: `acquire` the hits to keep them.
        """
        if len(hashes) != len(token_blocks):
            raise ValueError(f"got {len(hashes)} hashes but {len(token_blocks)} token blocks; pass one per block")
        if not self.enable_prefix_cache:
            return []
        hits: list[int] = []
        for block_hash, tokens in zip(hashes, token_blocks):
            block_id = self._block_of.get(block_hash)
            if block_id is None or self._tokens_of[block_id] != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def match_tokens(self, token_ids: list[int], num_blocks: int, salt: str = "",
                     lora: str = "") -> tuple[list[int], list[BlockHash]]:
        """`match_prefix` over the first `num_blocks` full blocks of `token_ids` (their hash chain under
        this model, `salt` and `lora`): the hit blocks, and the hashes of those hits."""
        size = self.block_size
        hashes = hash_chain(token_ids[: num_blocks * size], size, salt, lora, self.model)
        hits = self.match_prefix(hashes, [tuple(token_ids[i * size : (i + 1) * size]) for i in range(len(hashes))])
        return hits, hashes[: len(hits)]

    def hash_next(self, parent: BlockHash | None, tokens: tuple[int, ...], salt: str = "", lora: str = "") -> BlockHash:
        """The hash to `commit` a filled block under: the next link of `match_tokens`' chain."""
        return hash_next_block(parent, tokens, salt, lora, self.model)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with ref count 1: free ones lowest id first, then evicted LRU ones."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {n} KV blocks but only {self.num_free_blocks} of {self.num_blocks} are free or "
                "evictable; wait for running requests to finish or give the KV cache more memory"
            )
        blocks = [heapq.heappop(self._free) if self._free else self._evict_oldest() for _ in range(n)]
        for block_id in blocks:
            self._ref[block_id] = 1
        self._num_referenced += n
        return blocks

    def acquire(self, block_ids: list[int]) -> None:
        """Add a reference to each block (a prefix-cache hit); a cached block leaves the LRU."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref[block_id] == 0 and block_id not in self._lru:
                raise ValueError(f"block {block_id} is free; only referenced or cached blocks can be acquired")
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._lru[block_id]
                self._num_referenced += 1
            self._ref[block_id] += 1

    def commit(self, block_id: int, block_hash: BlockHash, tokens: tuple[int, ...]) -> None:
        """Record that a full block holds `tokens`, indexing it under `block_hash`.

        When the hash already maps to another block, that block stays the cached one and this
        one remains unindexed (it returns to the free list on release).
        """
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id} is not referenced; commit only blocks a sequence holds")
        if len(tokens) != self.block_size:
            raise ValueError(
                f"block {block_id} is committed with {len(tokens)} tokens; a full block has {self.block_size}"
            )
        if not self.enable_prefix_cache:
            return
        known = self._hash_of.get(block_id)
        if known is not None:
            if known != block_hash:
                raise ValueError(f"block {block_id} is already committed under hash {known}, not {block_hash}")
            return
        if block_hash in self._block_of:
            return
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = tuple(tokens)
        self._block_of[block_hash] = block_id
        self._note(block_hash, stored=True)

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; at ref 0 a cached block joins the LRU tail, others the free list.

        Blocks are released last to first, so a sequence's tail is evicted before its head.
        """
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref[block_id] < count:
                raise ValueError(
                    f"block {block_id} is released {count} time(s) but holds {self._ref[block_id]} reference(s)"
                )
        for block_id in reversed(block_ids):
            self._ref[block_id] -= 1
            if self._ref[block_id] > 0:
                continue
            self._num_referenced -= 1
            if block_id in self._hash_of:
                self._lru[block_id] = None
            else:
                heapq.heappush(self._free, block_id)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted) hashes since the last call, as net changes: no hash is in both lists."""
        stored, evicted = list(self._stored), list(self._evicted)
        self._stored.clear()
        self._evicted.clear()
        return stored, evicted

    def _evict_oldest(self) -> int:
        block_id, _ = self._lru.popitem(last=False)
        block_hash = self._hash_of.pop(block_id)
        del self._tokens_of[block_id]
        del self._block_of[block_hash]
        self._note(block_hash, stored=False)
        return block_id

    def _note(self, block_hash: BlockHash, stored: bool) -> None:
        # A hash stored then evicted within one window (or the reverse) cancels out.
        undo, record = (self._evicted, self._stored) if stored else (self._stored, self._evicted)
        if block_hash in undo:
            del undo[block_hash]
        else:
            record[block_hash] = None

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")
