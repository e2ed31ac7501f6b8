"""The native int4 / int8 matrix kernels (services/runtime/native/quant_gemv.cpp) against
float32 references and torch's kernels, on the model's shapes and odd ones.

Tolerances: the native kernels multiply exactly and sum in float32, so against a float32 product of
the same dequantized weights they differ by the output's rounding to 16 bits (half a unit in the
last place: relative 2^-8 for bfloat16, 2^-11 for float16, at worst) plus float32 summation error
(the int4 kernel sums 128 + code, so its sums are ~10x larger than the result: 1e-4 absolute).
torch's int4 kernel rounds each group's scale and zero point to bfloat16, so it differs from both by
up to 2^-9 of (|zero| + 8 scale) per weight: 3e-2 absolute on these outputs."""

from __future__ import annotations

import pytest
import torch

from services.runtime import native
from services.runtime.quantization import (Int4Groups, Int4Linear, Int8Linear, NativeInt4Linear, NativeInt8Linear,
                                             int4_linear, int8_linear)
from tests.unit.test_native import ops  # noqa: F401  (the session fixture that builds the extension)

# (out, in): fused qkv, o_proj, fused gate/up, down_proj.
INT4_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = [1, 2, 5, 8, 13, 32]  # the int4 kernel tiles x by 8 rows: full tiles and each remainder
BF16_HALF_ULP = 2.0**-8  # half a unit in the last place of bfloat16, relative, at the bottom of a binade


def int4_groups(out_features: int, in_features: int, seed: int = 0) -> Int4Groups:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    return Int4Groups.quantize(weight)


def dequantized(groups: Int4Groups) -> torch.Tensor:
    out_features, in_features = groups.codes.shape
    codes = groups.codes.view(out_features, in_features // 32, 32)
    return (codes * groups.scale[..., None] + groups.minimum[..., None]).view(out_features, in_features)


def activations(rows: int, in_features: int, dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int4_matches_its_dequantized_weights_and_torchs_kernel(ops, shape, rows):
    groups = int4_groups(*shape)
    layer = NativeInt4Linear.pack(groups, None, torch.bfloat16)
    x = activations(rows, shape[1])
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    want = x.float() @ dequantized(groups).T
    torch.testing.assert_close(got.float(), want, rtol=BF16_HALF_ULP, atol=1e-4)
    torch.testing.assert_close(got.float(), Int4Linear.pack(groups, None, torch.bfloat16)(x).float(),
                               rtol=BF16_HALF_ULP, atol=3e-2)


@pytest.mark.parametrize("shape", [(960, 576), (48, 96)])
def test_int4_portable_path_matches_the_vector_path(ops, shape):
    layer = NativeInt4Linear.pack(int4_groups(*shape), None, torch.bfloat16)
    x = activations(11, shape[1])
    vector = ops.int4_mm(x, layer.codes, layer.scales, layer.offsets)
    portable = ops.int4_mm_portable(x, layer.codes, layer.scales, layer.offsets)
    # Each rounds its own float32 sum to bf16: the two may land one unit apart.
    torch.testing.assert_close(portable.float(), vector.float(), rtol=2 * BF16_HALF_ULP, atol=1e-4)


def test_int4_odd_group_count_and_a_bias(ops):
    groups = int4_groups(48, 96)  # 3 groups, 3 blocks of 16 rows
    bias = torch.arange(48.0) / 8
    layer = NativeInt4Linear.pack(groups, bias, torch.bfloat16)
    assert layer.codes.shape == (3, 3, 256) and layer.scales.shape == (3, 3, 16) and layer.offsets.shape == (3, 3, 16)
    assert layer.scales[1, 2].tolist() == groups.scale[16:32, 2].tolist()
    x = activations(3, 96)
    want = x.float() @ dequantized(groups).T
    torch.testing.assert_close(layer(x).float(), (want.bfloat16() + bias.bfloat16()).float(),
                               rtol=2 * BF16_HALF_ULP, atol=1e-2)


def test_int4_packs_row_pairs_of_inputs_low_half_first(ops):
    # Row r's code at input k is (r + k) % 16, one group of 32 inputs.
    codes = (torch.arange(16.0)[:, None] + torch.arange(32.0)[None, :]).remainder(16)
    layer = NativeInt4Linear.pack(Int4Groups(codes, torch.ones(16, 1), torch.zeros(16, 1)), None, torch.bfloat16)
    packed = layer.codes[0, 0]
    for q, row, e in [(0, 0, 0), (0, 3, 1), (5, 15, 0), (7, 9, 1)]:
        low, high = (row + 4 * q + e) % 16, (row + 4 * q + 2 + e) % 16
        assert packed[32 * q + 2 * row + e].item() == low | (high << 4)
    assert layer.offsets[0, 0].tolist() == [-128.0] * 16
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 17] = 1.0  # picks each row's code at input 17: (row + 17) % 16
    assert layer(x)[0].tolist() == [float((r + 17) % 16) for r in range(16)]


def test_int4_refuses_what_it_cannot_run(ops):
    layer = NativeInt4Linear.pack(int4_groups(16, 64), None, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"int4_mm: x must be bfloat16, got Half"):
        ops.int4_mm(activations(1, 64, torch.float16), layer.codes, layer.scales, layer.offsets)
    with pytest.raises(RuntimeError, match=r"int4_mm: x has 96 columns; these codes take 64"):
        ops.int4_mm(activations(1, 96), layer.codes, layer.scales, layer.offsets)
    with pytest.raises(RuntimeError, match=r"int4_mm: offsets must be float32 \[1, 2, 16\], got Float\[2, 16\]"):
        ops.int4_mm(activations(1, 64), layer.codes, layer.scales, layer.offsets[0])


@pytest.fixture(scope="module")
def lm_head() -> torch.Tensor:
    return torch.randn(49152, 576, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int8_lm_head_matches_its_dequantized_weights(ops, lm_head, dtype, rows):
    layer = Int8Linear.quantize(lm_head, None, dtype)
    x = activations(rows, 576, dtype)
    got = ops.int8_gemv(x, layer.qweight, layer.scales)
    assert got.dtype == dtype and got.shape == (rows, 49152)
    want = x.float() @ (layer.qweight.float() * layer.scales.float()[:, None]).T
    rtol = {torch.bfloat16: BF16_HALF_ULP, torch.float16: 2.0**-11, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=1e-3)
    if dtype != torch.float32:
        torch.testing.assert_close(got, torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales),
                                   rtol=2 * rtol, atol=1e-3)


def test_int8_columns_off_the_vector_width_and_the_portable_path(ops):
    layer = Int8Linear.quantize(torch.randn(37, 40, generator=torch.Generator().manual_seed(3)), None, torch.bfloat16)
    x = activations(5, 40)
    want = x.float() @ (layer.qweight.float() * layer.scales.float()[:, None]).T
    for kernel in (ops.int8_gemv, ops.int8_gemv_portable):
        torch.testing.assert_close(kernel(x, layer.qweight, layer.scales).float(), want, rtol=BF16_HALF_ULP, atol=1e-3)


def test_int8_refuses_mismatched_shapes(ops):
    with pytest.raises(RuntimeError, match=r"int8_gemv: x \[rows, in_features\] and qweight \[out_features, "
                                           r"in_features\] must agree, got \[1, 64\] and \[8, 32\]"):
        ops.int8_gemv(torch.zeros(1, 64), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8))


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 32])
def test_int8_matrix_kernel_matches_int8linear_on_the_lm_head(ops, lm_head, rows):
    reference = Int8Linear.quantize(lm_head, None, torch.bfloat16)
    layer = NativeInt8Linear.pack(reference)
    x = activations(rows, 576)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 49152)
    want = x.float() @ (reference.qweight.float() * reference.scales.float()[:, None]).T
    torch.testing.assert_close(got.float(), want, rtol=BF16_HALF_ULP, atol=1e-3)


def test_int8_matrix_kernel_packing_portable_path_and_an_odd_pair_count(ops):
    weight = torch.randn(32, 38, generator=torch.Generator().manual_seed(5))  # 19 input pairs
    reference = Int8Linear.quantize(weight, torch.arange(32.0), torch.bfloat16)
    layer = NativeInt8Linear.pack(reference)
    assert layer.codes.shape == (2, 19, 32) and layer.scales.shape == (2, 16)
    assert layer.codes[1, 4, 2 * 3 + 1] == reference.qweight[16 + 3, 2 * 4 + 1]  # block 1, pair 4, row 3, input 1
    x = activations(5, 38)
    vector = ops.int8_mm(x, layer.codes, layer.scales)
    portable = ops.int8_mm_portable(x, layer.codes, layer.scales)
    want = x.float() @ (reference.qweight.float() * reference.scales.float()[:, None]).T
    torch.testing.assert_close(vector.float(), want, rtol=BF16_HALF_ULP, atol=1e-3)
    torch.testing.assert_close(portable.float(), vector.float(), rtol=2 * BF16_HALF_ULP, atol=1e-3)
    torch.testing.assert_close(layer(x), reference(x), rtol=2 * BF16_HALF_ULP, atol=1e-2)


def test_int8_matrix_kernel_refuses_what_it_cannot_run(ops):
    layer = NativeInt8Linear.pack(Int8Linear.quantize(torch.randn(16, 64), None, torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"int8_mm: x must be bfloat16 \[rows, in_features\], got Float\[1, 64\]"):
        ops.int8_mm(torch.zeros(1, 64), layer.codes, layer.scales)
    with pytest.raises(RuntimeError, match=r"int8_mm: x has 96 columns; these codes take 64"):
        ops.int8_mm(activations(1, 96), layer.codes, layer.scales)
    with pytest.raises(RuntimeError, match=r"int8_mm: scales must be float32 \[1, 16\], got Float\[16\]"):
        ops.int8_mm(activations(1, 64), layer.codes, layer.scales[0])


def test_int8_linear_packs_for_the_matrix_kernel_where_it_runs(ops):
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(6))
    assert isinstance(int8_linear(weight, None, torch.bfloat16), NativeInt8Linear)
    assert isinstance(int8_linear(weight, None, torch.float16), Int8Linear)  # int8_mm takes bf16 only
    assert isinstance(int8_linear(weight[:24], None, torch.bfloat16), Int8Linear)  # 24 rows: no 16-row block


def test_int8_chooses_its_kernel_when_quantized(ops, monkeypatch):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    x = activations(2, 64)
    native_layer = Int8Linear.quantize(weight, None, torch.bfloat16)
    assert native_layer.kernel == torch.ops.tandem.int8_gemv
    monkeypatch.setattr(native, "active", lambda device: False)
    torch_layer = Int8Linear.quantize(weight, None, torch.bfloat16)
    assert torch_layer.kernel == torch.ops.aten._weight_int8pack_mm
    monkeypatch.undo()  # the choice stays with each layer, whatever native.active says later
    torch.testing.assert_close(torch_layer(x), torch.ops.aten._weight_int8pack_mm(x, torch_layer.qweight,
                                                                                   torch_layer.scales))
    torch.testing.assert_close(native_layer(x), ops.int8_gemv(x, native_layer.qweight, native_layer.scales))


def test_layers_run_the_native_kernels_where_loaded(ops):
    groups = int4_groups(16, 64)
    assert native.loaded()
    assert isinstance(int4_linear(groups, None, torch.bfloat16), NativeInt4Linear)
    assert isinstance(int4_linear(groups, None, torch.float16), Int4Linear)  # native int4 takes bf16 only
