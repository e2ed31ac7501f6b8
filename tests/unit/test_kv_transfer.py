"""KV export/import: exact bytes into other block ids, chunk size bounds, and header checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.model_config import ModelConfig
from services.runtime.kv_cache import PagedKVCache
from services.runtime.kv_transfer import export_kv, import_kv

CONFIG = ModelConfig.from_dict(dict(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16,
                                    num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                                    head_dim=4, max_position_embeddings=64))
BLOCK_LAYER_BYTES = 2 * 4 * 2 * 4 * 4  # K and V x block_size 4 x 2 heads x 4 dims x fp32


def filled_cache() -> PagedKVCache:
    cache = PagedKVCache(CONFIG, num_blocks=10, block_size=4)
    cache.k.copy_(torch.randn_like(cache.k))
    cache.v.copy_(torch.randn_like(cache.v))
    return cache


def test_round_trip_into_other_block_ids():
    source, target = filled_cache(), PagedKVCache(CONFIG, num_blocks=10, block_size=4)
    chunks = list(export_kv(source, [7, 1, 4], max_chunk_bytes=2 * BLOCK_LAYER_BYTES))
    assert [(c.layer, c.first_block, c.num_blocks) for c in chunks] == [
        (0, 0, 2), (0, 2, 1), (1, 0, 2), (1, 2, 1), (2, 0, 2), (2, 2, 1)]
    assert all(len(c.data) <= 2 * BLOCK_LAYER_BYTES for c in chunks)
    for chunk in chunks:
        import_kv(target, [2, 9, 5], chunk)
    for src, dst in zip([7, 1, 4], [2, 9, 5]):
        assert torch.equal(target.k[:, dst], source.k[:, src]) and torch.equal(target.v[:, dst], source.v[:, src])
    assert sum(len(c.data) for c in chunks) == 3 * 3 * BLOCK_LAYER_BYTES


def test_chunk_bound_smaller_than_a_block_is_an_error():
    with pytest.raises(ValueError, match=r"one block of one layer is 256 bytes; max_chunk_bytes 100 is too small"):
        next(export_kv(filled_cache(), [0], max_chunk_bytes=100))


@pytest.mark.parametrize("change, message", [
    (dict(dtype="float16"), "KV chunk dtype float16 does not match this cache's float32"),
    (dict(shape=(2, 2, 4, 2, 8)), r"KV chunk shape \(2, 2, 4, 2, 8\) does not match the expected \(2, 2, 4, 2, 4\)"),
    (dict(layer=3), r"KV chunk layer 3 is outside \[0, 3\)"),
    (dict(first_block=2), r"KV chunk covers blocks 2..3 but only 3 blocks are reserved"),
    (dict(data=b"\0" * 10), "KV chunk carries 10 bytes; its header says 512"),
])
def test_bad_headers_are_refused(change, message):
    chunk = next(export_kv(filled_cache(), [0, 1], max_chunk_bytes=1 << 20))
    target = PagedKVCache(CONFIG, num_blocks=10, block_size=4)
    target.initialize([3, 4, 5])
    with pytest.raises(ValueError, match=message):
        import_kv(target, [3, 4, 5], dataclasses.replace(chunk, **change))
    assert not target.k[:, [3, 4, 5]].any() and not target.v[:, [3, 4, 5]].any()


def test_blocks_are_zeroed_when_first_handed_out_only():
    cache = PagedKVCache(CONFIG, num_blocks=10, block_size=4)
    cache.k.fill_(float("nan"))
    cache.initialize([2, 7])
    assert not cache.k[:, [2, 7]].any() and cache.k[:, 3].isnan().all()
    cache.k[:, 2] = 1.0
    cache.initialize([2, 3])  # 2 was handed out before: its contents stay
    assert (cache.k[:, 2] == 1.0).all() and not cache.k[:, 3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_into_a_buffer_writes_one_chunk_of_every_layer_back_to_back(dtype):
    source = PagedKVCache(CONFIG, num_blocks=10, block_size=4, dtype=dtype)
    source.k.copy_(torch.randn_like(source.k))
    source.v.copy_(torch.randn_like(source.v))
    block_ids = [7, 1, 4, 2]
    buffer = memoryview(bytearray(3 * source.block_bytes + 5))
    per_layer = list(export_kv(source, block_ids, max_chunk_bytes=3 * source.layer_block_bytes, start=1))
    placed = list(export_kv(source, block_ids, max_chunk_bytes=2 * source.layer_block_bytes, start=1, into=buffer))
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    assert [(c.layer, c.num_layers, c.first_block, c.num_blocks, c.dtype, c.shape) for c in placed] == [
        (0, 3, 1, 3, dtype_name, (2, 3, 4, 2, 4))]
    assert [(c.layer, c.num_layers) for c in per_layer] == [(0, 1), (1, 1), (2, 1)]
    assert bytes(placed[0].data) == bytes(buffer[: 3 * source.block_bytes]) == b"".join(c.data for c in per_layer)
    target = PagedKVCache(CONFIG, num_blocks=10, block_size=4, dtype=dtype)
    target.initialize([0, 5, 6, 8])
    import_kv(target, [0, 5, 6, 8], placed[0])
    for src, dst in zip([1, 4, 2], [5, 6, 8]):
        assert torch.equal(target.k[:, dst], source.k[:, src]) and torch.equal(target.v[:, dst], source.v[:, src])
    assert not target.k[:, 0].any() and not target.v[:, 0].any()  # the receiver's own block: not written


@pytest.mark.parametrize("num_layers, message", [
    (0, "KV chunk covers 0 layers from layer 1; this cache has 3"),
    (3, "KV chunk covers 3 layers from layer 1; this cache has 3"),
])
def test_a_chunk_past_the_last_layer_is_refused(num_layers, message):
    (chunk,) = export_kv(filled_cache(), [0, 1], max_chunk_bytes=1 << 20, into=memoryview(bytearray(1 << 12)))
    target = PagedKVCache(CONFIG, num_blocks=10, block_size=4)
    target.initialize([3, 4])
    with pytest.raises(ValueError, match=message):
        import_kv(target, [3, 4], dataclasses.replace(chunk, layer=1, num_layers=num_layers))
    assert not target.k[:, [3, 4]].any() and not target.v[:, [3, 4]].any()


def test_a_bfloat16_cache_ships_bfloat16_bytes_with_no_up_conversion():
    source = PagedKVCache(CONFIG, num_blocks=10, block_size=4, dtype=torch.bfloat16)
    source.k.copy_(torch.randn_like(source.k))
    source.v.copy_(torch.randn_like(source.v))
    (chunk, *_) = export_kv(source, [3, 5], max_chunk_bytes=1 << 20)
    assert (chunk.dtype, chunk.shape, len(chunk.data)) == ("bfloat16", (2, 2, 4, 2, 4), BLOCK_LAYER_BYTES)  # 2 x 2 B
    both = torch.frombuffer(bytearray(chunk.data), dtype=torch.bfloat16).view(chunk.shape)
    assert torch.equal(both[0], source.k[0, [3, 5]]) and torch.equal(both[1], source.v[0, [3, 5]])
