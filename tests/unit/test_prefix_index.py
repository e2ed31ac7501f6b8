"""The embedded prefix index: exact leading runs from worker bit masks, slot reuse, and an index the
garbage collector never walks."""

from __future__ import annotations

import gc

from services.common.block_hash import BlockHash
from services.common.prefix_index import PrefixIndex

H = [BlockHash(f"{i:032x}") for i in range(6)]


def test_each_worker_counts_its_unbroken_leading_run() -> None:
    index = PrefixIndex()
    index.add("a", H[:4])
    index.add("b", [H[0], H[1], H[3]])  # a gap at H[2]
    index.add("c", H[1:4])  # not the first block
    assert index.match(H[:4]) == {"a": 4, "b": 2}
    assert index.match(H[:1]) == {"a": 1, "b": 1}
    assert index.match(H[1:4]) == {"a": 3, "c": 3, "b": 1}
    assert index.match([H[5]]) == {}
    assert index.match([]) == {}


def test_remove_breaks_the_run_and_ignores_blocks_not_held() -> None:
    index = PrefixIndex()
    index.add("a", H[:4])
    index.add("b", H[:4])
    index.remove("a", [H[2], H[5]])
    index.remove("nobody", [H[0]])
    assert index.match(H[:4]) == {"a": 2, "b": 4}
    index.remove("b", H[:4])
    assert index.match(H[:4]) == {"a": 2}


def test_a_forgotten_workers_slot_is_reused_without_its_blocks() -> None:
    index = PrefixIndex()
    index.add("a", H[:3])
    index.add("b", H[:2])
    index.forget("a")
    index.forget("a")  # no-op
    index.add("c", [H[4]])  # takes a's slot
    assert index.match(H[:3]) == {"b": 2}
    assert index.match([H[4]]) == {"c": 1}
    index.add("c", H[:3])
    assert index.match(H[:3]) == {"c": 3, "b": 2}


def test_the_garbage_collector_tracks_no_object_per_block() -> None:
    index = PrefixIndex()
    gc.collect()
    tracked = len(gc.get_objects())
    for w in range(100):
        index.add(f"w{w}", [BlockHash(f"{w:08x}{i:024x}") for i in range(100)])
    assert len(gc.get_objects()) - tracked < 100  # 10,000 blocks held as sets: 10,000 more
