"""BlockManager: exact block ids, ref counts, LRU eviction order, hit verification and events."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common import block_hash
from services.common.block_hash import hash_chain
from services.runtime.block_manager import BlockManager, NoFreeBlocksError

BS = 2


def blocks_of(tokens: list[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + BS]) for i in range(0, len(tokens) - BS + 1, BS)]


def start(bm: BlockManager, tokens: list[int], salt: str = "") -> tuple[list[int], int]:
    """What the engine does for a new prompt: hits, then fresh blocks, then commit every full block."""
    hashes, token_blocks = hash_chain(tokens, BS, salt), blocks_of(tokens)
    hits = bm.match_prefix(hashes, token_blocks)
    bm.acquire(hits)
    blocks = hits + bm.allocate(len(token_blocks) - len(hits))
    for block_id, block_hash, block_tokens in zip(blocks, hashes, token_blocks):
        bm.commit(block_id, block_hash, block_tokens)
    return blocks, len(hits)


def states(bm: BlockManager) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"free": [], "cached": [], "referenced": []}
    for block_id in range(bm.num_blocks):
        if bm.ref_count(block_id) > 0:
            out["referenced"].append(block_id)
        elif bm.is_cached(block_id):
            out["cached"].append(block_id)
        else:
            out["free"].append(block_id)
    return out


def test_allocation_takes_the_lowest_free_ids_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    bm.release([1])
    assert bm.allocate(2) == [1, 5]
    assert [bm.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 1, 0, 0]
    assert (bm.num_free_blocks, bm.num_referenced_blocks, bm.num_cached_blocks) == (2, 6, 0)
    assert bm.usage() == 6 / 8
    assert bm.allocate(0) == []


def test_cached_blocks_are_evicted_in_lru_order_tail_of_a_sequence_first():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a, _ = start(bm, [1, 2, 3, 4])
    b, _ = start(bm, [5, 6, 7, 8])
    assert (a, b) == ([0, 1], [2, 3])
    bm.release(a)
    bm.release(b)
    assert states(bm) == {"free": [4], "cached": [0, 1, 2, 3], "referenced": []}
    assert bm.num_free_blocks == 5
    # The free block goes first, then the LRU: a's tail, a's head, b's tail, b's head.
    assert bm.allocate(2) == [4, 1]
    assert bm.allocate(2) == [0, 3]
    assert states(bm) == {"free": [], "cached": [2], "referenced": [0, 1, 3, 4]}
    assert not bm.is_cached(1)


def test_a_hit_shares_blocks_and_takes_them_out_of_the_lru():
    bm = BlockManager(num_blocks=6, block_size=BS)
    first, hits = start(bm, [1, 2, 3, 4, 5, 6])
    assert (first, hits) == ([0, 1, 2], 0)
    second, hits = start(bm, [1, 2, 3, 4, 9, 9])
    assert (second, hits) == ([0, 1, 3], 2)
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    bm.release(first)
    assert states(bm) == {"free": [4, 5], "cached": [2], "referenced": [0, 1, 3]}
    assert bm.match_prefix(hash_chain([1, 2, 3, 4, 5, 6], BS), blocks_of([1, 2, 3, 4, 5, 6])) == [0, 1, 2]
    bm.acquire([2])
    assert (bm.ref_count(2), bm.num_cached_blocks, bm.num_free_blocks) == (1, 0, 2)
    bm.release([2])
    bm.release(second)
    # Released last: block 2 first, then second's blocks tail to head.
    assert bm.allocate(6) == [4, 5, 2, 3, 1, 0]


def test_match_prefix_stops_at_the_first_miss_and_changes_no_refs():
    bm = BlockManager(num_blocks=4, block_size=BS)
    blocks, _ = start(bm, [1, 2, 3, 4])
    bm.release(blocks)
    tokens = [1, 2, 7, 7, 3, 4]
    assert bm.match_prefix(hash_chain(tokens, BS), blocks_of(tokens)) == [0]
    assert bm.match_prefix([], []) == []
    assert (bm.ref_count(0), bm.num_cached_blocks) == (0, 2)
    with pytest.raises(ValueError, match="2 hashes but 1 token blocks"):
        bm.match_prefix(hash_chain([1, 2, 3, 4], BS), [(1, 2)])


def test_different_salts_share_no_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, hits_a = start(bm, [1, 2, 3, 4], salt="tenant-a")
    b, hits_b = start(bm, [1, 2, 3, 4], salt="tenant-b")
    again, hits_again = start(bm, [1, 2, 3, 4], salt="tenant-a")
    assert (a, b, again) == ([0, 1], [2, 3], [0, 1])
    assert (hits_a, hits_b, hits_again) == (0, 0, 2)


def test_a_forged_hash_collision_never_returns_a_wrong_block(monkeypatch):
    bm = BlockManager(num_blocks=4, block_size=BS)
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, tokens, extra_keys=(): "0" * 32)
    a, _ = start(bm, [1, 2])
    b, hits = start(bm, [3, 4])
    assert (a, b, hits) == ([0], [1], 0)
    assert hash_chain([1, 2], BS) == hash_chain([3, 4], BS)
    # The hash keeps its first block; the colliding one stays unindexed and frees on release.
    assert (bm.is_cached(0), bm.is_cached(1)) == (True, False)
    assert bm.match_prefix(["0" * 32], [(3, 4)]) == []
    assert bm.match_prefix(["0" * 32], [(1, 2)]) == [0]
    bm.release(b)
    assert states(bm) == {"free": [1, 2, 3], "cached": [], "referenced": [0]}


def test_drain_events_reports_net_stored_and_evicted_hashes():
    bm = BlockManager(num_blocks=2, block_size=BS)
    hashes = hash_chain([1, 2, 3, 4], BS)
    blocks, _ = start(bm, [1, 2, 3, 4])
    assert bm.drain_events() == (hashes, [])
    assert bm.drain_events() == ([], [])
    bm.release(blocks)
    bm.allocate(1)
    assert bm.drain_events() == ([], [hashes[1]])
    # Stored and evicted again within one window: no net change to report.
    other = bm.allocate(1)
    bm.commit(other[0], hash_chain([9, 9], BS)[0], (9, 9))
    bm.release(other)
    bm.allocate(1)
    assert bm.drain_events() == ([], [hashes[0]])


def test_recommitting_the_same_block_is_a_no_op_and_a_different_hash_is_refused():
    bm = BlockManager(num_blocks=2, block_size=BS)
    [block] = bm.allocate(1)
    h1, h2 = hash_chain([1, 2], BS)[0], hash_chain([3, 4], BS)[0]
    bm.commit(block, h1, (1, 2))
    bm.commit(block, h1, (1, 2))
    assert bm.drain_events() == ([h1], [])
    with pytest.raises(ValueError, match=f"already committed under hash {h1}"):
        bm.commit(block, h2, (3, 4))


def test_without_prefix_cache_nothing_is_indexed():
    bm = BlockManager(num_blocks=3, block_size=BS, enable_prefix_cache=False)
    blocks, _ = start(bm, [1, 2, 3, 4])
    bm.release(blocks)
    again, hits = start(bm, [1, 2, 3, 4])
    assert (again, hits) == ([0, 1], 0)
    assert bm.drain_events() == ([], [])
    assert states(bm)["cached"] == []


def test_errors_say_what_went_wrong():
    bm = BlockManager(num_blocks=4, block_size=BS)
    with pytest.raises(NoFreeBlocksError, match="asked for 5 KV blocks but only 4 of 4 are free or evictable"):
        bm.allocate(5)
    assert not bm.can_allocate(5) and bm.can_allocate(4)
    with pytest.raises(ValueError, match="block 0 is released 1 time"):
        bm.release([0])
    [block] = bm.allocate(1)
    with pytest.raises(ValueError, match="block 0 is released 2 time"):
        bm.release([block, block])
    assert bm.ref_count(block) == 1
    with pytest.raises(ValueError, match="block 1 is free"):
        bm.acquire([block, 1])
    assert bm.ref_count(block) == 1
    with pytest.raises(ValueError, match="block 1 is not referenced"):
        bm.commit(1, hash_chain([1, 2], BS)[0], (1, 2))
    with pytest.raises(ValueError, match="committed with 1 tokens; a full block has 2"):
        bm.commit(block, hash_chain([1, 2], BS)[0], (1,))
    with pytest.raises(ValueError, match=r"block id 9 is out of range \[0, 4\)"):
        bm.ref_count(9)
    with pytest.raises(ValueError, match="must be at least 1"):
        BlockManager(num_blocks=0, block_size=BS)


operations = st.lists(
    st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=0, max_size=9), st.integers(0, 10**6)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_no_leaks_and_every_block_holds_what_its_sequences_think(ops):
    bm = BlockManager(num_blocks=6, block_size=BS)
    live: list[list[tuple[int, str, tuple[int, ...]]]] = []
    for is_start, tokens, pick in ops:
        if is_start:
            hashes = hash_chain(tokens, BS)
            hits = bm.match_prefix(hashes, blocks_of(tokens))
            bm.acquire(hits)
            if not bm.can_allocate(len(hashes) - len(hits)):
                bm.release(hits)
                continue
            blocks = hits + bm.allocate(len(hashes) - len(hits))
            for block_id, block_hash, block_tokens in zip(blocks, hashes, blocks_of(tokens)):
                bm.commit(block_id, block_hash, block_tokens)
            live.append(list(zip(blocks, hashes, blocks_of(tokens))))
        elif live:
            bm.release([block_id for block_id, _, _ in live.pop(pick % len(live))])
        check_invariants(bm, live)
    for sequence in live:
        bm.release([block_id for block_id, _, _ in sequence])
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks


def check_invariants(bm: BlockManager, live: list[list[tuple[int, str, tuple[int, ...]]]]) -> None:
    seen = states(bm)
    assert len(seen["free"]) + len(seen["cached"]) + len(seen["referenced"]) == bm.num_blocks
    assert len(seen["cached"]) == bm.num_cached_blocks
    assert len(seen["referenced"]) == bm.num_referenced_blocks
    assert bm.num_free_blocks == len(seen["free"]) + len(seen["cached"])
    holders: dict[int, int] = {}
    for sequence in live:
        assert len({block_id for block_id, _, _ in sequence}) == len(sequence)
        for block_id, block_hash, tokens in sequence:
            holders[block_id] = holders.get(block_id, 0) + 1
    for sequence in live:
        for block_id, block_hash, tokens in sequence:
            # A shared block came from a hit, so it is indexed under this very hash and tokens.
            if holders[block_id] > 1 or bm.is_cached(block_id):
                assert bm.match_prefix([block_hash], [tokens]) == [block_id]
    assert {b: bm.ref_count(b) for b in range(bm.num_blocks) if bm.ref_count(b)} == holders
