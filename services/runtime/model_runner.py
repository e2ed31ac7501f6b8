"""Turns a step's scheduled chunks into one flattened model call and returns the sampled rows' logits.

Decode chunks (one new token) come first so the attention backend can run them as one padded
batch; prompt chunks follow in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from services.common.blocks import ceil_div
from services.runtime.attention import BatchMetadata, PrefillSegment
from services.runtime.batch_scheduler import ScheduledChunk
from services.runtime.kv_cache import PagedKVCache
from services.runtime.lora import LoraBatch, LoraManager
from services.runtime.model import CausalLM


def order_for_batch(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    return [c for c in chunks if c.num_new_tokens == 1] + [c for c in chunks if c.num_new_tokens > 1]


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache, loras: LoraManager | None = None) -> None:
        self.model = model
        self.cache = cache
        self.loras = loras
        # Called with a step's chunks and each layer index once that layer's KV is in the cache (the
        # KV hand-off ships layer l while later layers compute: services/runtime/kv_handoff.py).
        self.after_layer: Callable[[list[ScheduledChunk], int], None] | None = None

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """`chunks` must already be in `order_for_batch` order; returns logits of the completing chunks."""
        input_ids, meta = self._prepare(chunks)
        after_layer = functools.partial(self.after_layer, chunks) if self.after_layer is not None else None
        return self.model.forward(input_ids, meta, self.cache, self._lora_batch(chunks), after_layer)

    def _lora_batch(self, chunks: list[ScheduledChunk]) -> LoraBatch | None:
        """Each chunk's rows under its sequence's adapter (the rows' order is the chunks')."""
        if self.loras is None:
            return None
        return self.loras.batch([(c.seq.lora, c.num_new_tokens) for c in chunks])

    def prompt_logits(self, token_ids: list[int], block_ids: list[int], lora: str = "") -> torch.Tensor:
        """Logits `[len(token_ids), vocab]` at every position of one prompt computed from scratch into
        `block_ids` (initialized already; under adapter `lora` if set): teacher forcing, for prompt
        logprobs and as the precision quality test scores a reference continuation."""
        size, device, n = self.cache.block_size, self.model.device, len(token_ids)
        table = block_ids[: ceil_div(n, size)]
        meta = BatchMetadata(
            positions=torch.arange(n, device=device),
            slot_mapping=torch.tensor([table[p // size] * size + p % size for p in range(n)], device=device),
            num_decode_tokens=0, decode_block_tables=None, decode_context_lens=None, decode_bias=None,
            prefills=[PrefillSegment(0, n, n, torch.tensor(table, device=device))],
            logits_indices=torch.arange(n, device=device),
        )
        loras = self.loras.batch([(lora, n)]) if self.loras is not None else None
        return self.model.forward(torch.tensor(token_ids, device=device), meta, self.cache, loras)

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, BatchMetadata]:
        size = self.cache.block_size
        device = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        prefills: list[PrefillSegment] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_new_tokens
            q_start = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // size] * size + p % size for p in range(start, end))
            if chunk.completes:
                logits_rows.append(len(ids) - 1)
            table = seq.block_table[: ceil_div(end, size)]
            if chunk.num_new_tokens == 1:
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                block_ids = torch.tensor(table, device=device)
                prefills.append(PrefillSegment(q_start, chunk.num_new_tokens, end, block_ids))
        tables, lens, bias = self._decode_tensors(decode_tables, decode_lens, size, device)
        meta = BatchMetadata(
            positions=torch.tensor(positions, device=device),
            slot_mapping=torch.tensor(slots, device=device),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=tables,
            decode_context_lens=lens,
            decode_bias=bias,
            prefills=prefills,
            logits_indices=torch.tensor(logits_rows, device=device, dtype=torch.long),
        )
        return torch.tensor(ids, device=device), meta

    @staticmethod
    def _decode_tensors(tables: list[list[int]], lens: list[int], block_size: int, device: torch.device):
        if not tables:
            return None, None, None
        width = max(len(t) for t in tables)
        # Padding repeats a row's own first block: initialized memory, whose slots the bias hides.
        padded = torch.tensor([t + t[:1] * (width - len(t)) for t in tables], device=device)
        context_lens = torch.tensor(lens, device=device)
        key_pos = torch.arange(width * block_size, device=device)
        past = (key_pos[None, :] >= context_lens[:, None]).view(len(lens), 1, 1, -1)
        bias = torch.zeros(past.shape, device=device).masked_fill_(past, float("-inf"))
        return padded, context_lens, bias
