"""KV export and import as self-describing chunks: a small header and raw tensor bytes, no pickle.

A chunk holds K and V of `num_blocks` consecutive blocks of `num_layers` consecutive layers from
`layer`, each layer shaped `[2, num_blocks, block_size, kv_heads, head_dim]` (`shape`), the layers
back to back; `first_block` indexes the sequence's block list, so the receiver writes it into its
own block ids. Chunks whose bytes travel in messages cover one layer each, at most
`max_chunk_bytes`, layers in order; chunks gathered into a shared buffer carry no bytes in a
message, so one chunk covers every layer (one message, one import: per-message costs dominated).

Export and import run outside the engine thread. On the CPU they copy through numpy views
(bf16 as int16), which never start an OpenMP team: a team left alive in another thread makes the
engine thread's parallel regions contend for the cores (measured: 17% slower decode).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from services.runtime.kv_cache import PagedKVCache

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(slots=True)
class KvChunk:
    layer: int
    first_block: int
    num_blocks: int
    dtype: str
    shape: tuple[int, ...]
    data: bytes
    num_layers: int = 1


def blocks_per_chunk(cache: PagedKVCache, max_chunk_bytes: int) -> int:
    block_bytes = cache.layer_block_bytes
    if block_bytes > max_chunk_bytes:
        raise ValueError(f"one block of one layer is {block_bytes} bytes; max_chunk_bytes {max_chunk_bytes} is too small")
    return max_chunk_bytes // block_bytes


def chunk_bytes(dtype: str, shape: Iterable[int], num_layers: int = 1) -> int:
    """The bytes of a chunk of this dtype, per-layer shape and layer count; ValueError for a dtype
    that is not one of DTYPES or fewer than one layer."""
    if dtype not in DTYPES:
        raise ValueError(f"KV chunk dtype {dtype!r} is none of {', '.join(DTYPES)}")
    if num_layers < 1:
        raise ValueError(f"KV chunk covers {num_layers} layers; a chunk covers at least one")
    return int(np.prod(list(shape))) * DTYPES[dtype].itemsize * num_layers


def num_export_chunks(cache: PagedKVCache, num_blocks: int, max_chunk_bytes: int, gathered: bool) -> int:
    """How many chunks `export_kv` makes of `num_blocks` blocks: one when `gathered` into a buffer."""
    if gathered:
        return 1
    per_chunk = blocks_per_chunk(cache, max_chunk_bytes)
    return cache.num_layers * -(-num_blocks // per_chunk)


def export_kv(cache: PagedKVCache, block_ids: list[int], max_chunk_bytes: int = 1 << 20,
              start: int = 0, into: memoryview | None = None) -> Iterator[KvChunk]:
    """The KV of `block_ids[start:]` (the blocks before `start` are not shipped: the receiver holds
    them), `first_block` still indexing the whole `block_ids`: one chunk per layer and at most
    `max_chunk_bytes`. With `into` (room for the shipped blocks' `cache.block_bytes` each) one chunk
    of every layer, gathered straight into `into` from offset 0, its `data` that slice of `into`:
    no other copy."""
    per_chunk = blocks_per_chunk(cache, max_chunk_bytes)
    dtype = DTYPE_NAMES[cache.dtype]
    if into is not None:
        ids = block_ids[start:]
        for layer in range(cache.num_layers):
            gather_layer(cache, ids, layer, into)
        size = len(ids) * cache.block_bytes
        yield KvChunk(0, start, len(ids), dtype, (2, len(ids), *cache.block_shape), into[:size], cache.num_layers)
        return
    for layer in range(cache.num_layers):
        k_cache, v_cache = cache.layer(layer)
        for first in range(start, len(block_ids), per_chunk):
            ids = block_ids[first : first + per_chunk]
            shape = (2, len(ids), *cache.block_shape)
            yield KvChunk(layer, first, len(ids), dtype, shape, _tensor_bytes(_stack_blocks(k_cache, v_cache, ids)))


def import_kv(cache: PagedKVCache, block_ids: list[int], chunk: KvChunk) -> None:
    """Writes `chunk` into `block_ids[chunk.first_block : ...]`; checks the header against this cache."""
    expected = (2, chunk.num_blocks, *cache.block_shape)
    if chunk.dtype != DTYPE_NAMES[cache.dtype]:
        raise ValueError(f"KV chunk dtype {chunk.dtype} does not match this cache's {DTYPE_NAMES[cache.dtype]}")
    if tuple(chunk.shape) != expected:
        raise ValueError(f"KV chunk shape {tuple(chunk.shape)} does not match the expected {expected}")
    if not 0 <= chunk.layer < cache.num_layers:
        raise ValueError(f"KV chunk layer {chunk.layer} is outside [0, {cache.num_layers})")
    if not 1 <= chunk.num_layers <= cache.num_layers - chunk.layer:
        raise ValueError(f"KV chunk covers {chunk.num_layers} layers from layer {chunk.layer}; this cache has "
                         f"{cache.num_layers}")
    if chunk.first_block < 0 or chunk.first_block + chunk.num_blocks > len(block_ids):
        raise ValueError(
            f"KV chunk covers blocks {chunk.first_block}..{chunk.first_block + chunk.num_blocks - 1} "
            f"but only {len(block_ids)} blocks are reserved"
        )
    expected_bytes = chunk_bytes(chunk.dtype, expected, chunk.num_layers)
    if len(chunk.data) != expected_bytes:
        raise ValueError(f"KV chunk carries {len(chunk.data)} bytes; its header says {expected_bytes}")
    ids = block_ids[chunk.first_block : chunk.first_block + chunk.num_blocks]
    layers = range(chunk.layer, chunk.layer + chunk.num_layers)
    if cache.k.device.type == "cpu":  # read straight from the received bytes: no copy of the chunk
        k_all, v_all = _numpy(cache.k), _numpy(cache.v)
        both = np.frombuffer(chunk.data, dtype=k_all.dtype).reshape(chunk.num_layers, *expected)
        index = np.asarray(ids)
        for i, layer in enumerate(layers):
            k_all[layer][index] = both[i, 0]
            v_all[layer][index] = both[i, 1]
        return
    both_tensor = torch.frombuffer(bytearray(chunk.data), dtype=DTYPES[chunk.dtype]).view(chunk.num_layers, *expected)
    index_tensor = torch.tensor(ids, device=cache.k.device)
    for i, layer in enumerate(layers):
        k_cache, v_cache = cache.layer(layer)
        k_cache[index_tensor] = both_tensor[i, 0].to(k_cache.device)
        v_cache[index_tensor] = both_tensor[i, 1].to(k_cache.device)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy view of its memory; bf16, which numpy lacks, as int16 (copies keep the bits)."""
    return tensor.view(torch.int16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _stack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """K and V of `ids` as one contiguous CPU tensor `[2, len(ids), block_size, kv_heads, head_dim]`."""
    if k_cache.device.type == "cpu":
        return torch.from_numpy(np.stack((_numpy(k_cache)[ids], _numpy(v_cache)[ids])))
    index = torch.tensor(ids, device=k_cache.device)
    return torch.stack((k_cache[index], v_cache[index])).cpu().contiguous()


def gather_layer(cache: PagedKVCache, ids: list[int], layer: int, into: memoryview) -> None:
    """K and V of blocks `ids` of `layer`, written where export_kv's one chunk of every layer holds
    that layer in `into` (room for `len(ids)` blocks of every layer): a sender may gather layer `l`
    as soon as it is computed, while later layers still compute."""
    size = len(ids) * cache.layer_block_bytes
    out = into[layer * size : (layer + 1) * size]
    shape = (2, len(ids), *cache.block_shape)
    if cache.k.device.type == "cpu":
        k_layer, v_layer = _numpy(cache.k[layer]), _numpy(cache.v[layer])
        target = np.frombuffer(out, dtype=k_layer.dtype).reshape(shape)
        index = np.asarray(ids)  # mode="clip": written straight into `out`, not through a buffer
        np.take(k_layer, index, axis=0, out=target[0], mode="clip")
        np.take(v_layer, index, axis=0, out=target[1], mode="clip")
        return
    target_tensor = torch.frombuffer(out, dtype=torch.uint8).view(cache.dtype).view(shape)
    target_tensor.copy_(_stack_blocks(*cache.layer(layer), ids))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.view(torch.uint8).numpy().tobytes()
