"""The native kernels (services/runtime/native) against the torch path they replace, op by op, in
float32, bfloat16 and float16: element-wise results equal to the bit where the torch path rounds the
same way, reductions (the norm's sum of squares, attention) within float32 rounding.

The extension is built once per machine (the session fixture compiles it when the sources changed,
about a minute on 2 cores); without a C++ compiler on PATH the module is skipped."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from services.runtime import native
from services.runtime.attention import BatchMetadata, PrefillSegment, TorchAttention, write_kv
from services.runtime.layer_ops import rms_norm, rotate
from services.runtime.model_runner import ModelRunner

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="session")
def ops():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: the native kernels cannot be built (the torch path runs)")
    native.build()
    assert native.loaded()
    return torch.ops.tandem


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32 within reduction-order rounding; 16-bit types within one unit in the last place."""
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch(ops, dtype):
    torch.manual_seed(0)
    x, weight = torch.randn(7, 576).to(dtype), torch.randn(576).to(dtype)
    got = ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    _close(got, rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_then_normalizes(ops, dtype):
    torch.manual_seed(1)
    hidden, delta, weight = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype), torch.randn(576).to(dtype)
    want_hidden = hidden + delta
    got = ops.add_rms_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, want_hidden)  # the residual add rounds as torch's does
    _close(got, rms_norm(want_hidden, weight, 1e-6), dtype)


def test_norm_rejects_a_weight_of_the_wrong_size(ops):
    with pytest.raises(RuntimeError, match=r"the last dim of x \(576\) must equal the weight's size \(64\)"):
        ops.rms_norm(torch.randn(2, 576), torch.randn(64), 1e-5)


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_equals_rotate_then_write_to_the_bit(ops, dtype):
    torch.manual_seed(2)
    qkv = torch.randn(5, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
    cos, sin = torch.randn(100, HEAD_DIM).to(dtype), torch.randn(100, HEAD_DIM).to(dtype)
    positions, slots = torch.tensor([3, 7, 50, 99, 0]), torch.tensor([0, 17, 33, 5, 60])
    k_cache, v_cache = torch.zeros(8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype), torch.zeros(8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    qk, v = qkv.split((HEADS + KV_HEADS, KV_HEADS), dim=1)
    want = rotate(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    write_kv(want[:, HEADS:], v, want_k_cache, want_v_cache, slots)
    ops.rope_write_kv(qkv, cos, sin, positions, k_cache, v_cache, slots, HEADS)
    assert torch.equal(qkv[:, :HEADS + KV_HEADS], want)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)


def test_rope_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(ops):
    qkv = torch.randn(2, HEADS + 2 * KV_HEADS, HEAD_DIM)
    before = qkv.clone()
    k_cache, v_cache = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM), torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM)
    table = torch.randn(10, HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"rope_write_kv: slot 32 is outside the 32-slot cache"):
        ops.rope_write_kv(qkv, table, table, torch.tensor([0, 1]), k_cache, v_cache, torch.tensor([1, 32]), HEADS)
    assert torch.equal(qkv, before) and not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(ops, dtype):
    torch.manual_seed(3)
    gate_up = (torch.randn(4, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.shape == (4, 1536) and got.dtype == dtype
    _close(got, F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_the_torch_path_over_paged_blocks(ops, dtype):
    """Three sequences of different lengths over scattered blocks, queries a strided view of a fused
    qkv row (as the model passes them), unwritten slots full of garbage the lengths must hide."""
    torch.manual_seed(4)
    k_cache = torch.full((8, BLOCK, KV_HEADS, HEAD_DIM), 1e4).to(dtype)
    v_cache = torch.full((8, BLOCK, KV_HEADS, HEAD_DIM), 1e4).to(dtype)
    lens, tables = [3, 40, 17], [[5], [2, 7, 1], [0, 4]]
    for length, table in zip(lens, tables):
        for pos in range(length):
            k_cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(KV_HEADS, HEAD_DIM).to(dtype)
            v_cache[table[pos // BLOCK], pos % BLOCK] = torch.randn(KV_HEADS, HEAD_DIM).to(dtype)
    padded, context_lens, bias = ModelRunner._decode_tensors(tables, lens, BLOCK, torch.device("cpu"))
    meta = BatchMetadata(positions=context_lens - 1, slot_mapping=torch.empty(0, dtype=torch.long),
                         num_decode_tokens=3, decode_block_tables=padded, decode_context_lens=context_lens,
                         decode_bias=bias, prefills=[], logits_indices=torch.arange(3))
    q = torch.randn(3, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)[:, :HEADS]
    got = ops.decode_attention(q, k_cache, v_cache, padded, context_lens, 0.125)
    assert got.shape == (3, HEADS, HEAD_DIM) and got.dtype == dtype
    _close(got, TorchAttention._decode(q, k_cache, v_cache, meta, 0.125), dtype)


def test_decode_attention_refuses_a_context_longer_than_its_blocks(ops):
    cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"sequence 0's context of 17 tokens does not fit its 1 blocks of 16"):
        ops.decode_attention(torch.zeros(1, HEADS, HEAD_DIM), cache, cache, torch.tensor([[0]]), torch.tensor([17]), 1.0)


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a fresh chunk in float32 (SDPA), `[tokens, heads, head_dim]` as the kernel's."""
    def heads_first(x):
        return x.float().transpose(0, 1)[None]

    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("kernel", ["prefill_attention", "prefill_attention_portable"])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [
    (1, HEADS, KV_HEADS, HEAD_DIM), (37, HEADS, KV_HEADS, HEAD_DIM), (160, HEADS, KV_HEADS, HEAD_DIM),
    (45, 8, 2, 128), (33, 4, 4, 48),
])
def test_prefill_attention_matches_causal_float32_attention_in_bfloat16(ops, kernel, tokens, heads, kv_heads, head_dim):
    """q, k and v strided views of one fused qkv tensor, as the model passes them; token counts off the
    kernel's 16-row blocks, head_dim 64 and 128 (the vector path) and 48 (the portable loop)."""
    torch.manual_seed(5)
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, head_dim) * 2).to(torch.bfloat16)
    q, k, v = qkv.split_with_sizes((heads, kv_heads, kv_heads), 1)
    got = getattr(ops, kernel)(q, k, v, head_dim**-0.5)
    assert got.shape == (tokens, heads, head_dim) and got.dtype == torch.bfloat16 and got.is_contiguous()
    _close(got, _causal_reference(q, k, v, head_dim**-0.5), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_runs_other_dtypes_on_the_portable_loop(ops, dtype):
    torch.manual_seed(6)
    qkv = torch.randn(29, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
    q, k, v = qkv.split_with_sizes((HEADS, KV_HEADS, KV_HEADS), 1)
    got = ops.prefill_attention(q, k, v, 0.125)
    assert got.dtype == dtype
    _close(got, _causal_reference(q, k, v, 0.125).to(dtype), dtype)


def test_prefill_attention_refuses_keys_for_other_rows(ops):
    q, kv = torch.zeros(8, HEADS, HEAD_DIM, dtype=torch.bfloat16), torch.zeros(7, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"k and v must be \[8, kv_heads, 64\] like q's rows, got \[7, 3, 64\]"):
        ops.prefill_attention(q, kv, kv, 0.125)


def test_a_fresh_bfloat16_chunk_attends_by_the_native_kernel_as_sdpa_does(ops, monkeypatch):
    """TorchAttention(native=True) sends a fresh bfloat16 chunk to the kernel (counted) and agrees with SDPA."""
    torch.manual_seed(7)
    tokens = 40
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    q, k, v = qkv.split_with_sizes((HEADS, KV_HEADS, KV_HEADS), 1)
    cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    meta = BatchMetadata(positions=torch.arange(tokens), slot_mapping=torch.arange(tokens), num_decode_tokens=0,
                         decode_block_tables=None, decode_context_lens=None, decode_bias=None,
                         prefills=[PrefillSegment(0, tokens, tokens, torch.arange(3))], logits_indices=torch.tensor([39]))
    calls = []
    kernel = torch.ops.tandem.prefill_attention
    monkeypatch.setattr(torch.ops.tandem, "prefill_attention", lambda *args: calls.append(1) or kernel(*args))
    got = TorchAttention(native=True).attend(q, k, v, cache, cache, meta, 0.125)
    assert calls == [1]
    _close(got, TorchAttention().attend(q, k, v, cache, cache, meta, 0.125), torch.bfloat16)


def test_without_a_build_the_torch_path_runs_and_the_log_says_how_to_build(ops, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    native.loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not native.loaded() and not native.active(torch.device("cpu"))
        assert caplog.messages == [f"native kernels: no build for these sources at {native.library_path()}; the "
                                   "torch path runs. Build it with `python -m services.runtime.native` (make setup does)"]
    finally:
        monkeypatch.undo()
        native.loaded.cache_clear()
    assert native.loaded()
