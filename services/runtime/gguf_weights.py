"""int4 groups read straight from the Q4_1 blocks of the GGUF a model directory was converted from.

A Q4_1 block (llama.cpp's layout) holds 32 consecutive input weights of one row: an fp16 scale d,
an fp16 minimum m and 16 bytes of 4-bit codes (byte j: weight j in the low nibble, weight j + 16 in
the high one), w = d * code + m. That is `Int4Groups`' layout, so the shipped file is served as
shipped: no second rounding of weights the file already rounded. HF's conversion permutes llama's
q/k rows (RoPE layout); rows move whole, so the groups along the input dimension stay intact and
the same permutation applies to codes, scales and minima. The tensors' byte ranges come from the
directory's record (services/common/gguf_source.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from services.common.gguf_source import GgufSource, GgufTensor, read_source
from services.runtime.quantization import INT4_GROUP, Int4Groups

log = logging.getLogger(__name__)

Q4_1 = "Q4_1"
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes


class GgufGroups:
    """The Q4_1 tensors of a model directory's source GGUF, handed out as `Int4Groups` by HF name."""

    def __init__(self, source: GgufSource) -> None:
        self.source = source
        self._file = np.memmap(source.path, dtype=np.uint8, mode="r")
        self._refused: set[str] = set()  # tensor types already logged as not served as groups

    @classmethod
    def open(cls, model_dir: Path) -> GgufGroups | None:
        """The directory's source file, or None (the reason logged) where there is none, or it is
        missing or no longer the file the record was written from."""
        source = read_source(model_dir)
        if source is None:
            return None
        if not source.path.is_file() or source.path.stat().st_size != source.size:
            log.warning("weights: %s records GGUF source %s (%d bytes), which is missing or changed; int4 "
                        "weights are quantized from the safetensors instead", model_dir, source.path, source.size)
            return None
        return cls(source)

    def int4_groups(self, name: str, shape: tuple[int, ...]) -> Int4Groups | None:
        """Tensor `name`'s groups in HF's row order, or None where the file stores it in another
        type (logged once per type) or in another shape."""
        tensor = self.source.tensors.get(name)
        if tensor is None or tensor.shape != shape:
            return None
        if tensor.type != Q4_1:
            if tensor.type not in self._refused:
                self._refused.add(tensor.type)
                log.info("weights: %s stores %s as %s, which is not int4 groups; quantizing those from the "
                         "safetensors instead", self.source.path.name, name, tensor.type)
            return None
        groups = q4_1_groups(torch.from_numpy(self._blocks(tensor)), shape)
        return groups if tensor.rope_heads is None else permuted_rows(groups, rope_row_order(shape[0], tensor.rope_heads))

    def _blocks(self, tensor: GgufTensor) -> np.ndarray:
        out_features, in_features = tensor.shape
        expected = out_features * in_features // INT4_GROUP * Q4_1_BLOCK_BYTES
        if tensor.nbytes != expected or tensor.offset + expected > self._file.size:
            raise ValueError(f"{self.source.path}: tensor {tensor.gguf_name} holds {tensor.nbytes} bytes at "
                             f"{tensor.offset}, not the {expected} of Q4_1 {tensor.shape} inside the file; "
                             f"delete {self.source.path.name}'s record (gguf_source.json) to load without it")
        data = np.array(self._file[tensor.offset:tensor.offset + expected])  # one copy, off the map
        return data.reshape(out_features, in_features // INT4_GROUP, Q4_1_BLOCK_BYTES)


def q4_1_groups(blocks: torch.Tensor, shape: tuple[int, ...]) -> Int4Groups:
    """The groups of Q4_1 `blocks` (uint8 [out, in / 32, 20]) of a weight of `shape` [out, in]."""
    out_features, in_features = shape
    scale = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    minimum = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., 4:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
    return Int4Groups(codes.view(out_features, in_features), scale, minimum)


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """HF's reverse permutation of llama.cpp's q/k rows: within each head, the rows llama.cpp
    interleaved as pairs (2i, 2i + 1) go back to halves (i, i + half)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def permuted_rows(groups: Int4Groups, order: torch.Tensor) -> Int4Groups:
    return Int4Groups(groups.codes[order], groups.scale[order], groups.minimum[order])


def joined_rows(parts: list[Int4Groups]) -> Int4Groups:
    """The groups of the row-wise concatenation of these weights (a fused projection)."""
    if len(parts) == 1:
        return parts[0]
    return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                      torch.cat([p.minimum for p in parts]))


def dequantized(groups: Int4Groups) -> torch.Tensor:
    """The float32 weight the groups stand for, computed as gguf's Q4_1 dequantization does
    (d * code, then + m, each rounded to float32), so it equals HF's converted weight bit for bit."""
    out_features, in_features = groups.codes.shape
    codes = groups.codes.view(out_features, -1, INT4_GROUP).float()
    return (codes * groups.scale[..., None] + groups.minimum[..., None]).view(out_features, in_features)
