"""Decode attention over the paged cache equals SDPA over each sequence's own context, for a batch of
sequences of different lengths (padded tables, additive bias), with other slots full of garbage, in
float32 and in bfloat16 (computed in float32 inside, returned in the cache's dtype)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.common.blocks import ceil_div
from services.runtime.attention import BatchMetadata, TorchAttention
from services.runtime.model_runner import ModelRunner

BLOCK, KV_HEADS, HEADS, HEAD_DIM = 4, 2, 6, 8


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_matches_sdpa_over_each_context(dtype, tolerance):
    torch.manual_seed(0)
    k_cache = torch.full((16, BLOCK, KV_HEADS, HEAD_DIM), 1e4, dtype=dtype)  # unwritten slots: garbage the bias must hide
    v_cache = torch.full((16, BLOCK, KV_HEADS, HEAD_DIM), 1e4, dtype=dtype)
    lens = [3, 9, 6]  # tokens in context, the new one included
    tables = [[5], [2, 7, 11], [0, 9]]
    contexts = []
    for length, table in zip(lens, tables):
        keys = torch.randn(length, KV_HEADS, HEAD_DIM).to(dtype)
        values = torch.randn(length, KV_HEADS, HEAD_DIM).to(dtype)
        for pos in range(length):
            k_cache[table[pos // BLOCK], pos % BLOCK] = keys[pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = values[pos]
        contexts.append((keys, values))
    padded, context_lens, bias = ModelRunner._decode_tensors(tables, lens, BLOCK, torch.device("cpu"))
    meta = BatchMetadata(positions=context_lens - 1, slot_mapping=torch.empty(0, dtype=torch.long),
                         num_decode_tokens=3, decode_block_tables=padded, decode_context_lens=context_lens,
                         decode_bias=bias, prefills=[], logits_indices=torch.arange(3))
    q = torch.randn(3, HEADS, HEAD_DIM).to(dtype)
    got = TorchAttention._decode(q, k_cache, v_cache, meta, 0.3)
    assert got.dtype == dtype
    for row, (keys, values) in enumerate(contexts):
        want = F.scaled_dot_product_attention(q[row][:, None].float(), keys.transpose(0, 1).float(),
                                              values.transpose(0, 1).float(), scale=0.3, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[row].float(), want, atol=tolerance, rtol=tolerance)
    assert padded.tolist() == [[5, 5, 5], [2, 7, 11], [0, 9, 0]]
    assert ceil_div(max(lens), BLOCK) == padded.shape[1]
