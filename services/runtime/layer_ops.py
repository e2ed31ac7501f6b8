"""The small operations of a decoder layer between its matrix products, in two interchangeable
implementations: `TorchOps` (ATen operations; the reference) and `NativeOps` (one C++ call each from
services/runtime/native, where the torch path runs 2-10 ATen operations).

Each is built per forward from the step's `BatchMetadata` and offers three calls:
`norm(hidden, delta, weight)` (the residual add `hidden += delta`, in place, then RMSNorm),
`rope_write_kv(qkv, ...)` (RoPE on the queries and keys, and the keys and values written into the
paged cache; returns q, k, v) and `silu_mul(gate_up)`. The model takes the native one where
`native.active(device)`: the build is loaded and the model is on the CPU.
"""

from __future__ import annotations

import torch

from services.runtime.attention import BatchMetadata, write_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operations as HF's LlamaRMSNorm (float32 inside), so fp32 results agree bit for bit; the
    # intermediates are updated in place (same values, fewer allocations).
    x32 = x.float()
    scale = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return weight * (x32 * scale).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `x` [tokens, heads, head_dim], queries and keys at once: HF's x * cos + rotate_half(x) * sin
    in four operations, as `sin` comes with its first half negated (`CausalLM.sin`), so the halves
    swap by a flip: rotate_half(x) * sin = flip(x) * sin_signed, to the bit."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (x * cos).add_(swapped.mul_(sin))


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class TorchOps:
    """The reference implementation, in ATen operations."""

    __slots__ = ("cos", "sin", "slots")

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, meta: BatchMetadata) -> None:
        self.cos = cos_table[meta.positions].unsqueeze(1)
        self.sin = sin_table[meta.positions].unsqueeze(1)
        self.slots = meta.slot_mapping

    @staticmethod
    def norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if delta is not None:
            hidden += delta
        return rms_norm(hidden, weight, eps)

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> QKV:
        kv_heads = k_cache.shape[-2]
        qk, v = qkv.split_with_sizes((num_heads + kv_heads, kv_heads), 1)
        q, k = rotate(qk, self.cos, self.sin).split_with_sizes((num_heads, kv_heads), 1)
        write_kv(k, v, k_cache, v_cache, self.slots)
        return q, k, v

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # views of a new tensor: updated in place
        return torch.nn.functional.silu(gate, inplace=True).mul_(up)


class NativeOps:
    """The same operations as `TorchOps`, one C++ kernel call each (`torch.ops.tandem`)."""

    __slots__ = ("cos_table", "sin_table", "positions", "slots")

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, meta: BatchMetadata) -> None:
        self.cos_table, self.sin_table = cos_table, sin_table
        self.positions, self.slots = meta.positions, meta.slot_mapping

    @staticmethod
    def norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if delta is None:
            return torch.ops.tandem.rms_norm(hidden, weight, eps)
        return torch.ops.tandem.add_rms_norm(hidden, delta, weight, eps)

    def rope_write_kv(self, qkv: torch.Tensor, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> QKV:
        torch.ops.tandem.rope_write_kv(qkv, self.cos_table, self.sin_table, self.positions, k_cache, v_cache,
                                       self.slots, num_heads)
        kv_heads = k_cache.shape[-2]
        return qkv.split_with_sizes((num_heads, kv_heads, kv_heads), 1)  # the C++ method: half Tensor.split's cost

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.ops.tandem.silu_mul(gate_up)


LayerOps = TorchOps | NativeOps
