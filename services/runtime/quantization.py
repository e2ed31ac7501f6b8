"""The model's linear layers: dense, or with weight-only int8 or int4 weights, behind one callable.

int8 keeps one symmetric scale per output row; int4 keeps a scale and a minimum per group of 32
input weights (GGUF's Q4_1 layout). Where the native kernels are loaded (services/runtime/native,
`quant_gemv.cpp`), both run Tandem's own kernels: under bfloat16 activations the matrix kernels
`torch.ops.tandem.int4_mm` and `int8_mm` (AVX-512 bf16 dot products where the CPU has them), on
their own packings of the codes made at load time (one copy); they measured faster than torch's
weight-only kernels at every size and than dense bfloat16 from 1 to 32 rows. int8 under float16
or float32 activations runs `int8_gemv`. Elsewhere they run torch's CPU kernels,
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, which take 16-bit activations; under
float16 int4 stays on torch's kernel. Each layer picks its kernel once, when it is built. A
`SplitLinear` keeps a dense copy too and runs it from a batch size on, where the probe
(services/runtime/precision.py) found the quantized kernel slower than the dense one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.runtime import native

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32
INT4_ROW_MULTIPLE = 16  # both int4 packings take output rows in tiles of 16
INT4_LEVELS = 15
INT4_CODE_BIAS = 128  # the native int4 kernel dots x with 128 + code (see quant_gemv.cpp)
INT4_ROW_BLOCK = INT4_ROW_MULTIPLE  # the native int4 and int8 matrix kernels' output rows per block


class Linear(Protocol):
    """y = x @ W.T (+ bias) for a 2-D activation `x` of shape [rows, in_features]."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class DenseLinear:
    weight: torch.Tensor  # [out, in], in the activation dtype
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True, slots=True)
class Int8Linear:
    """int8 weights, run by the kernel chosen when they are quantized (as `int4_linear` chooses):
    the native `tandem.int8_gemv` where it runs, torch's `_weight_int8pack_mm` otherwise."""

    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out], in the activation dtype: W = qweight * scales[:, None]
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    bias: torch.Tensor | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        native_kernel = native.active(qweight.device)
        kernel = torch.ops.tandem.int8_gemv if native_kernel else torch.ops.aten._weight_int8pack_mm
        return cls(qweight.contiguous(), scales.to(dtype), kernel, _cast(bias, dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel(x.contiguous(), self.qweight, self.scales)
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True, slots=True)
class NativeInt8Linear:
    """int8 weights in the native matrix kernel's packing (quant_gemv.cpp), run by `tandem.int8_mm` on
    bfloat16 activations: by block of 16 output rows, each input pair p of a block as 32 bytes (row
    r's codes at inputs 2p and 2p + 1 in bytes 2r and 2r + 1). Computes what `Int8Linear` does."""

    codes: torch.Tensor  # int8 [out / 16, in / 2, 32]
    scales: torch.Tensor  # float32 [out / 16, 16]: Int8Linear's bfloat16 scales, widened
    bias: torch.Tensor | None = None

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        out_features, in_features = weight.shape
        return out_features % INT4_ROW_BLOCK == 0 and in_features % 2 == 0

    @classmethod
    def pack(cls, layer: Int8Linear) -> NativeInt8Linear:
        out_features, in_features = layer.qweight.shape
        blocks, pairs = out_features // INT4_ROW_BLOCK, in_features // 2
        codes = layer.qweight.view(blocks, INT4_ROW_BLOCK, pairs, 2).permute(0, 2, 1, 3)
        scales = layer.scales.float().view(blocks, INT4_ROW_BLOCK)
        return cls(codes.reshape(blocks, pairs, 2 * INT4_ROW_BLOCK).contiguous(), scales.contiguous(), layer.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.tandem.int8_mm(x.contiguous(), self.codes, self.scales)
        return out if self.bias is None else out + self.bias


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """The int8 layer for `weight`: the native matrix kernel's packing where it runs (loaded, bfloat16
    activations, rows a multiple of 16, an even column count), `Int8Linear` otherwise."""
    layer = Int8Linear.quantize(weight, bias, dtype)
    if dtype == torch.bfloat16 and native.active(layer.qweight.device) and NativeInt8Linear.fits(weight):
        return NativeInt8Linear.pack(layer)
    return layer


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """int4 weights before packing: W = codes * scale + minimum per group of 32 input weights."""

    codes: torch.Tensor  # [out, in], 0..15
    scale: torch.Tensor  # [out, in / 32], float32
    minimum: torch.Tensor  # [out, in / 32], float32

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        out_features, in_features = weight.shape
        return out_features % INT4_ROW_MULTIPLE == 0 and in_features % INT4_GROUP == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Groups:
        """Rounds each group of 32 weights to 16 levels between its minimum and maximum."""
        out_features, in_features = weight.shape
        groups = weight.float().view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        minimum = groups.amin(dim=-1)
        scale = ((groups.amax(dim=-1) - minimum) / INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS)
        return cls(codes.view(out_features, in_features), scale, minimum)


@dataclass(frozen=True, slots=True)
class Int4Linear:
    """int4 weights in torch's CPU packing, run by `_weight_int4pack_mm_for_cpu`."""

    packed: torch.Tensor  # uint8, torch's CPU int4 packing of the 0..15 codes
    scale_zeros: torch.Tensor  # [in / 32, out, 2]: W = (code - 8) * scale + zero per group
    bias: torch.Tensor | None = None

    @classmethod
    def pack(cls, groups: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> Int4Linear:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32).contiguous(), 1)
        zeros = groups.minimum + 8 * groups.scale  # the kernel centres codes on 8
        scale_zeros = torch.stack([groups.scale.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        return cls(packed, scale_zeros, _cast(bias, dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scale_zeros)
        return out if self.bias is None else out + self.bias


@dataclass(frozen=True, slots=True)
class NativeInt4Linear:
    """int4 weights in the native kernel's packing (quant_gemv.cpp), run by `tandem.int4_mm` on
    bfloat16 activations: by block of 16 output rows, each block's group of 32 inputs as 256 bytes
    whose 32-byte runs unpack to two [16 rows x 2 inputs] vectors (inputs 4q + e and 4q + 2 + e of
    the group in the low and high nibbles of byte 32q + 2 * row + e)."""

    codes: torch.Tensor  # uint8 [out / 16, groups, 256]
    scales: torch.Tensor  # float32 [out / 16, groups, 16]
    offsets: torch.Tensor  # float32 [out / 16, groups, 16]: minimum - 128 * scale
    bias: torch.Tensor | None = None

    @classmethod
    def pack(cls, groups: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> NativeInt4Linear:
        out_features, in_features = groups.codes.shape
        blocks, count = out_features // INT4_ROW_BLOCK, in_features // INT4_GROUP
        # codes[block, row, group, q, half, e]: input 32 group + 4 q + 2 half + e of that row
        codes = groups.codes.to(torch.uint8).view(blocks, INT4_ROW_BLOCK, count, INT4_GROUP // 4, 2, 2)
        codes = codes.permute(0, 2, 3, 4, 1, 5)  # [block, group, q, half, row, e]
        packed = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).reshape(blocks, count, INT4_GROUP * INT4_ROW_BLOCK // 2)

        def by_block(per_group: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [blocks, groups, 16]
            return per_group.float().view(blocks, INT4_ROW_BLOCK, count).transpose(1, 2).contiguous()

        offsets = by_block(groups.minimum - INT4_CODE_BIAS * groups.scale)
        return cls(packed.contiguous(), by_block(groups.scale), offsets, _cast(bias, dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.tandem.int4_mm(x.contiguous(), self.codes, self.scales, self.offsets)
        return out if self.bias is None else out + self.bias


def int4_linear(groups: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """The int4 layer for these groups: the native kernel's packing where it runs (loaded, bfloat16
    activations), torch's otherwise."""
    layer = NativeInt4Linear if dtype == torch.bfloat16 and native.active(groups.codes.device) else Int4Linear
    return layer.pack(groups, bias, dtype)


@dataclass(frozen=True, slots=True)
class SplitLinear:
    """Quantized weights for batches under `dense_from_rows` rows, the dense copy from there on."""

    quantized: Linear
    dense: Linear
    dense_from_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dense if x.shape[0] >= self.dense_from_rows else self.quantized)(x)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str, dtype: torch.dtype,
                device: torch.device | str = "cpu", dense_from_rows: int | None = None,
                groups: Int4Groups | None = None) -> Linear:
    """The layer for `weight` [out, in] in the given format, split by batch size when `dense_from_rows`
    is set. int4 takes `groups` where given (read from a GGUF: services/runtime/gguf_weights.py), else
    quantizes `weight`. An int4 weight whose shape the packing cannot take (rows not a multiple of 16,
    or columns of 32) is kept in int8 instead."""
    if quantization == "none":
        return DenseLinear(weight.to(device=device, dtype=dtype), _cast(bias, dtype, device))
    check_quantization(quantization, dtype, torch.device(device))
    if quantization == "int4" and Int4Groups.fits(weight):
        quantized: Linear = int4_linear(Int4Groups.quantize(weight) if groups is None else groups, bias, dtype)
    else:
        quantized = int8_linear(weight, bias, dtype)
    if dense_from_rows is None:
        return quantized
    return SplitLinear(quantized, make_linear(weight, bias, "none", dtype, device), dense_from_rows)


def check_quantization(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raises ValueError, saying what to pass instead, for a combination the kernels cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} has CPU kernels only; on {device} pass --quantization none")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"--quantization {quantization} runs with 16-bit activations, not {dtype}; "
                         "pass --dtype bfloat16, float16 or auto")


def _cast(bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor | None:
    return None if bias is None else bias.to(device=device, dtype=dtype)
