"""Attention over the paged KV cache, behind one backend interface.

A step's tokens arrive flattened: decode tokens first (one per sequence), then each prompt
chunk. `BatchMetadata` says where each segment's tokens sit and which blocks hold its context.
The model writes the step's keys and values into the cache first (`write_kv`, or the native fused
RoPE-and-write), then the backend attends. The torch backend (CPU and CUDA) uses SDPA for prompt
chunks, except that a fresh bfloat16 chunk runs the native causal kernel (`prefill_attention`) where
the native build is loaded on the CPU; its decode rows run the native kernel straight over the paged
blocks there, else two batched matrix products over a gathered copy. flash-attn is used on
CUDA when it imports and the block size suits its paged kernel. The SDPA fallback on CUDA is logged,
with the reason, once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.runtime import native

log = logging.getLogger(__name__)
FLASH_PAGE_MULTIPLE = 256  # flash-attn's paged kernel takes pages of a multiple of this many slots


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's chunk of prompt tokens: `q_len` new tokens ending at `context_len`."""

    q_start: int
    q_len: int
    context_len: int
    block_ids: torch.Tensor

    @property
    def is_fresh(self) -> bool:
        """No earlier context: the chunk attends only to itself."""
        return self.context_len == self.q_len


@dataclass(slots=True)
class BatchMetadata:
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_bias: torch.Tensor | None  # float32 [B, 1, 1, slots]: 0 on each row's context, -inf past it
    prefills: list[PrefillSegment]
    logits_indices: torch.Tensor


class AttentionBackend(Protocol):
    name: str

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention `[T, heads, head_dim]` of the step's queries; `k`/`v` are already in the cache at
        `meta.slot_mapping` (a fresh prompt chunk reads them from here rather than from the cache)."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The slots of `block_ids` (any shape) as `[*block_ids.shape, block_size, kv_heads, head_dim]`.

    index_select over whole blocks is several times faster than advanced indexing on CPU.
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape, *cache.shape[1:])


def gather_head_major(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Each row's blocks as one float32 `[rows, kv_heads, slots, head_dim]` tensor, in one copy after the
    gather: every KV head's keys contiguous, so the batched products over them need no further copy."""
    rows = gather_blocks(cache, block_tables).flatten(1, 2)
    out = torch.empty(rows.shape[0], rows.shape[2], rows.shape[1], rows.shape[3], dtype=torch.float32,
                      device=rows.device)
    return out.copy_(rows.transpose(1, 2))


def gather_context(cache: torch.Tensor, block_ids: torch.Tensor, context_len: int) -> torch.Tensor:
    """A sequence's first `context_len` cached tokens as `[context_len, kv_heads, head_dim]`."""
    return gather_blocks(cache, block_ids).flatten(0, 1)[:context_len]


class TorchAttention:
    """SDPA on any device for prompt chunks; decode tokens attend in one batch, padded and masked. With
    `native` (`select_backend` sets it where `native.active`) the decode rows run the native kernel, and
    so do fresh bfloat16 prompt chunks: `tandem.prefill_attention` ran a 512-token chunk of the default
    model 2.6x faster than SDPA's CPU kernel in bfloat16 (3.5 against 9.3 ms a layer, one AMD EPYC Zen 4
    core); float32 stays on SDPA, as HF's reference runs it (the parity tests)."""

    name = "torch"

    def __init__(self, native: bool = False) -> None:
        self.native = native

    def attend(self, q, k, v, k_cache, v_cache, meta, scale):
        num_decode = meta.num_decode_tokens
        if not meta.prefills:  # a decode-only step: no copy into a joint output
            return self._decode_rows(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if num_decode:
            out[:num_decode] = self._decode_rows(q[:num_decode], k_cache, v_cache, meta, scale)
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg, scale)
        return out

    def _decode_rows(self, q, k_cache, v_cache, meta, scale):
        if self.native:
            return torch.ops.tandem.decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                                     meta.decode_context_lens, scale)
        return self._decode(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale):
        """Two batched matrix products per KV head, each over the query heads that share it, in float32
        with the softmax between them. SDPA's CPU kernel spends 4x as long on a single query row
        (measured: 8 sequences of 112 tokens, 873 us against 229 us), and 16-bit matrix products this
        small run slower than float32 ones on a CPU without AMX (one sequence of 106 tokens, bf16, 1
        AMD EPYC thread: 107 us a layer against 67 us)."""
        batch, heads, head_dim = q.shape
        kv_heads = k_cache.shape[-2]
        keys = gather_head_major(k_cache, meta.decode_block_tables)  # [B, kv_heads, slots, head_dim]
        values = gather_head_major(v_cache, meta.decode_block_tables)
        queries = q.view(batch, kv_heads, heads // kv_heads, head_dim).float()
        scores = torch.matmul(queries, keys.transpose(-1, -2))
        probs = torch.softmax(torch.add(meta.decode_bias, scores, alpha=scale), dim=-1)
        return torch.matmul(probs, values).view(batch, heads, head_dim).to(q.dtype)

    def _prefill(self, q, k, v, k_cache, v_cache, seg, scale):
        if seg.is_fresh and self.native and q.dtype == torch.bfloat16:
            return torch.ops.tandem.prefill_attention(q, k, v, scale)
        if seg.is_fresh:
            keys, values, mask, causal = k, v, None, True
        else:
            keys = gather_context(k_cache, seg.block_ids, seg.context_len)
            values = gather_context(v_cache, seg.block_ids, seg.context_len)
            mask = _offset_causal_mask(seg.q_len, seg.context_len, q.device)
            causal = False
        # A leading batch dimension: SDPA's fused CPU kernel takes 4-D inputs only (3-D falls to the math path).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )[0]
        return out.transpose(0, 1)


def _offset_causal_mask(q_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (absolute position context_len - q_len + i) sees keys at positions up to its own."""
    query_pos = torch.arange(context_len - q_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]


class FlashAttention:
    """flash-attn's paged kernel for decode-only steps on CUDA (blocks of a multiple of
    FLASH_PAGE_MULTIPLE slots, checked by `select_backend`); steps with prompt chunks use SDPA."""

    name = "flash"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401

        self._with_kvcache = flash_attn_with_kvcache
        self._torch = TorchAttention()
        self._prefill_fallback_logged = False

    def attend(self, q, k, v, k_cache, v_cache, meta, scale):
        if meta.prefills or not meta.num_decode_tokens:
            if not self._prefill_fallback_logged:
                log.warning("attention: steps with prompt chunks use torch SDPA on CUDA (no paged varlen "
                            "flash-attn path yet); decode-only steps use flash-attn")
                self._prefill_fallback_logged = True
            return self._torch.attend(q, k, v, k_cache, v_cache, meta, scale)
        out = self._with_kvcache(
            q.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=meta.decode_context_lens.to(torch.int32),
            block_table=meta.decode_block_tables.to(torch.int32),
            softmax_scale=scale, causal=True,
        )
        return out.squeeze(1)


def select_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """`auto` takes flash-attn on CUDA when it imports and `block_size` suits its paged kernel, else
    torch SDPA (logged once, with the reason, when on CUDA). ValueError names the flag to fix."""
    if name not in ("auto", "torch", "flash"):
        raise ValueError(f"attention backend {name!r} is unknown; use auto, torch or flash")
    if block_size < 1:
        raise ValueError(f"--block-size {block_size} must be at least 1")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttention(native=native.active(device))
    if device.type != "cuda":
        raise ValueError("the flash attention backend needs a CUDA device; use --attention torch on CPU")
    if block_size % FLASH_PAGE_MULTIPLE:
        if name == "flash":
            raise ValueError(f"the flash attention backend needs --block-size a multiple of {FLASH_PAGE_MULTIPLE} "
                             f"(flash-attn's paged kernel), not {block_size}; use --block-size "
                             f"{FLASH_PAGE_MULTIPLE} or --attention torch")
        return _sdpa_on_cuda(f"--block-size {block_size} is not a multiple of {FLASH_PAGE_MULTIPLE}, which "
                             "flash-attn's paged kernel needs")
    try:
        return FlashAttention()
    except ImportError:
        if name == "flash":
            raise ValueError("flash-attn is not importable; install flash-attn or use --attention torch") from None
        return _sdpa_on_cuda("flash-attn is not importable")


def _sdpa_on_cuda(reason: str) -> TorchAttention:
    log.warning("attention: torch SDPA on CUDA, not flash-attn: %s", reason)
    return TorchAttention()
