"""The block-hash chain: deterministic, chained on the parent, keyed by model, salt and adapter on the first block only."""

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.block_hash import hash_block, hash_chain, hash_next_block


def test_hash_is_32_hex_chars_of_blake2b_over_the_documented_encoding():
    expected = hashlib.blake2b(
        b"\x00" + struct.pack("<I3Q", 3, 1, 2, 3) + struct.pack("<I", 1) + struct.pack("<I", 4) + b"salt",
        digest_size=16,
    ).hexdigest()
    assert hash_block(None, [1, 2, 3], ("salt",)) == expected
    assert len(expected) == 32


def test_parent_tokens_and_extra_keys_all_change_the_hash():
    root = hash_block(None, [1, 2])
    hashes = {
        root,
        hash_block(root, [1, 2]),
        hash_block(None, [2, 1]),
        hash_block(None, [1, 2], ("a",)),
        hash_block(None, [1, 2], ("b",)),
        hash_block(None, [1, 2], ("",)),
    }
    assert len(hashes) == 6


def test_length_prefixes_keep_different_splits_apart():
    assert hash_block(None, [1], ("ab",)) != hash_block(None, [1], ("a", "b"))
    assert hash_block(None, [1, 2], ()) != hash_block(None, [1], ("\x02",))
    assert hash_block(None, [], ("a",)) != hash_block(None, [], ("a", ""))


def test_chain_has_full_blocks_only_each_chained_on_its_parent():
    tokens = list(range(10))
    chain = hash_chain(tokens, block_size=4)
    assert len(chain) == 2
    assert chain[0] == hash_block(None, [0, 1, 2, 3])
    assert chain[1] == hash_block(chain[0], [4, 5, 6, 7])
    assert hash_chain(tokens[:3], block_size=4) == []
    assert hash_chain(tokens[:8], block_size=4) == chain


def test_salt_is_an_extra_key_of_the_first_block_only():
    chain = hash_chain(list(range(8)), block_size=4, salt="tenant-a")
    assert chain[0] == hash_block(None, [0, 1, 2, 3], ("salt", "tenant-a"))
    assert chain[1] == hash_block(chain[0], [4, 5, 6, 7])
    unsalted = hash_chain(list(range(8)), block_size=4)
    assert set(chain).isdisjoint(unsalted)
    assert set(chain).isdisjoint(hash_chain(list(range(8)), block_size=4, salt="tenant-b"))


def test_the_model_keys_the_first_block_so_two_models_share_no_block():
    tokens = list(range(12))
    smol = hash_chain(tokens, block_size=4, model="smol")
    assert smol[0] == hash_block(None, [0, 1, 2, 3], ("model", "smol"))
    assert smol[1:] == [hash_block(smol[0], [4, 5, 6, 7]), hash_block(smol[1], [8, 9, 10, 11])]
    other = hash_chain(tokens, block_size=4, model="smol-b")
    assert set(smol).isdisjoint(other) and set(smol).isdisjoint(hash_chain(tokens, block_size=4))
    assert hash_chain(tokens, block_size=4, model="smol") == smol  # deterministic: a worker and the scheduler agree
    everything = hash_chain(tokens, block_size=4, salt="t", adapter="a", model="smol")
    assert everything[0] == hash_block(None, [0, 1, 2, 3], ("model", "smol", "salt", "t", "lora", "a"))


def test_the_next_block_continues_the_chain_of_the_same_keys():
    tokens = list(range(8))
    chain = hash_chain(tokens, block_size=4, salt="t", adapter="a", model="m")
    first = hash_next_block(None, tokens[:4], "t", "a", "m")
    assert [first, hash_next_block(first, tokens[4:], "t", "a", "m")] == chain
    assert hash_next_block(first, tokens[4:]) == chain[1]  # later blocks take their keys from the parent only


def test_tagged_keys_keep_every_model_salt_and_adapter_apart():
    """Swapping values between the fields, or empty against missing, never gives the same first block."""
    combos = [(model, salt, adapter) for model in ("", "model", "lora") for salt in ("", "model", "lora")
              for adapter in ("", "model", "salt")]
    firsts = {hash_chain([1, 2], block_size=2, salt=salt, adapter=adapter, model=model)[0]
              for model, salt, adapter in combos}
    assert len(firsts) == len(combos) == 27


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        hash_chain([1, 2], block_size=0)
    with pytest.raises(ValueError, match="32 hex characters"):
        hash_block("not-a-hash", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token ids"):
        hash_block(None, [-1])


@settings(deadline=None)  # no per-example time limit: a loaded machine only adds time
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8))
def test_chain_of_a_prefix_is_a_prefix_of_the_chain(tokens, block_size):
    chain = hash_chain(tokens, block_size)
    assert len(chain) == len(tokens) // block_size
    for cut in range(len(tokens) + 1):
        assert hash_chain(tokens[:cut], block_size) == chain[: cut // block_size]
