"""The block-hash chain of the prefix cache: one definition for the scheduler and the runtime.

A block's hash covers its parent's hash, its token ids and its extra keys (the served model, the
tenant salt and the LoRA adapter, on the first block), so equal hashes mean equal prefixes of one
model's KV. Torch-free on purpose.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", str)
"""32 hex characters: a blake2b digest of 16 bytes."""

_DIGEST_SIZE = 16
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """Hash one block chained on its parent's hash.

    Every field is length-prefixed, so no two different (parent, tokens, extra_keys) encode to
    the same bytes: ("ab",) and ("a", "b") differ, and so do tokens split differently.
    """
    digest = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    digest.update(_encode_parent(parent))
    digest.update(_encode_tokens(tokens))
    digest.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        raw = key.encode("utf-8")
        digest.update(struct.pack("<I", len(raw)))
        digest.update(raw)
    return BlockHash(digest.hexdigest())


def hash_chain(token_ids: Sequence[int], block_size: int, salt: str = "", adapter: str = "",
               model: str = "") -> list[BlockHash]:
    """The hashes of every full block of `token_ids`; a trailing partial block has none.

    Block i is chained on block i-1. A non-empty `model` (the served model's name), `salt` (the
    tenant's) and `adapter` (a LoRA adapter's name) are extra keys of the first block only: through
    the chain they separate every later block as well, so no block is shared across models,
    tenants or adapters. Workers pass the name they serve the model under, and the scheduler the
    name the request resolves to on the worker, so both compute the same chain.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_next_block(parent, token_ids[start : start + block_size], salt, adapter, model)
        hashes.append(parent)
    return hashes


def hash_next_block(parent: BlockHash | None, tokens: Sequence[int], salt: str = "", adapter: str = "",
                    model: str = "") -> BlockHash:
    """One link of `hash_chain`: model, salt and adapter are extra keys of the first block (no parent) only.

    Each non-empty one enters as a (tag, value) pair in a fixed order, so no two different
    (model, salt, adapter) give the same keys, and a chain with none keeps the hashes it always had.
    """
    if parent is not None:
        return hash_block(parent, tokens)
    tagged = (("model", model), ("salt", salt), ("lora", adapter))
    return hash_block(None, tokens, tuple(part for tag, value in tagged if value for part in (tag, value)))


def _encode_parent(parent: BlockHash | None) -> bytes:
    if parent is None:
        return _NO_PARENT
    try:
        raw = bytes.fromhex(parent)
    except ValueError:
        raw = b""
    if len(raw) != _DIGEST_SIZE:
        raise ValueError(f"parent must be a block hash of {2 * _DIGEST_SIZE} hex characters, got {parent!r}")
    return _HAS_PARENT + raw


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<I{len(tokens)}Q", len(tokens), *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**64): {exc}") from None
