"""Shared-memory segments of the same-host KV path: another process reads what the sender wrote,
a closed or replaced segment is refused, the pool lends each segment once and keeps few idle, and
no segment outlives its last user."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from services.runtime.kv_transfer import KvChunk
from services.runtime.kv_shm import (
    MAX_IDLE_SEGMENTS, SEGMENT_NAME, SegmentPool, ShmUnavailable, open_segment, probe_segment, reads_back,
)

NONCE = b"0123456789abcdef"


def open_memfds() -> int:
    """KV segments this process holds open (mmap keeps a descriptor of its own: count inodes)."""
    fds = [fd for fd in Path("/proc/self/fd").iterdir() if _target(fd).startswith(f"/memfd:{SEGMENT_NAME}")]
    return len({os.stat(fd).st_ino for fd in fds})


def _target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_another_process_reads_the_segment_and_checks_the_nonce():
    segment = probe_segment(NONCE)
    try:
        ident = segment.id
        code = ("import sys; from services.runtime.kv_shm import SegmentId, reads_back; "
                f"print(repr(reads_back(SegmentId({ident.pid}, {ident.fd}, {ident.inode}, {ident.size}), {NONCE!r})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[2], check=True).stdout.strip()
        assert out == "''"
        assert reads_back(segment.id, b"another nonce...") == "the segment does not hold the probe's nonce"
    finally:
        segment.close()


def test_a_closed_or_replaced_segment_is_refused():
    segment = probe_segment(NONCE)
    ident = segment.id
    with pytest.raises(ShmUnavailable, match=r"is inode \d+ of \d+ bytes, not the segment named"):
        open_segment(replace(ident, inode=ident.inode + 1))
    with pytest.raises(ShmUnavailable, match=r"has -1 bytes; a segment has at least one"):
        open_segment(replace(ident, size=-1))
    segment.close()
    with pytest.raises(ShmUnavailable, match=rf"cannot open the sender's segment /proc/{ident.pid}/fd/{ident.fd}"):
        open_segment(ident)


def test_the_pool_lends_each_segment_once_and_keeps_few_idle():
    before = open_memfds()
    pool = SegmentPool()
    first, second = pool.acquire(1000), pool.acquire(1000)
    assert first is not second and first.size == second.size == 8 << 20
    pool.release(first)
    assert pool.acquire(5 << 20) is first  # idle and big enough
    bigger = pool.acquire(9 << 20)
    assert bigger.size == 16 << 20
    for segment in (first, second, bigger):
        pool.release(segment)
    more = [pool.acquire(1 << 20) for _ in range(MAX_IDLE_SEGMENTS + 2)]
    for segment in more:
        pool.release(segment)
    assert pool.num_segments == MAX_IDLE_SEGMENTS == open_memfds() - before
    failed = pool.acquire(1)
    pool.release(failed, reuse=False)  # the receiver may still read it: closed, never lent again
    assert pool.num_segments == MAX_IDLE_SEGMENTS - 1 == open_memfds() - before
    pool.close()
    assert pool.num_segments == 0 and open_memfds() == before


def test_kv_through_a_segment_lands_bit_exact_like_kv_in_the_messages():
    import torch

    from services.common.model_config import ModelConfig
    from services.runtime.kv_cache import PagedKVCache
    from services.runtime.kv_transfer import chunk_bytes, export_kv, import_kv
    from services.runtime.kv_shm import segment_view

    config = ModelConfig.from_dict(dict(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16,
                                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                                        head_dim=4, max_position_embeddings=64))
    source = PagedKVCache(config, num_blocks=10, block_size=4)
    source.k.copy_(torch.randn_like(source.k))
    source.v.copy_(torch.randn_like(source.v))
    sent, reserved = [3, 8, 1, 6, 2], [0, 4, 5, 7, 9]
    over_grpc, over_shm = (PagedKVCache(config, num_blocks=10, block_size=4) for _ in range(2))
    for cache in (over_grpc, over_shm):
        cache.initialize(reserved)
    for chunk in export_kv(source, sent, max_chunk_bytes=2 * source.layer_block_bytes, start=1):
        import_kv(over_grpc, reserved, chunk)
    pool = SegmentPool()
    segment = pool.acquire(4 * source.block_bytes)
    with memoryview(segment.buffer) as into:
        layout = [(c.layer, c.first_block, c.num_blocks, c.dtype, c.shape, c.num_layers) for c in
                  export_kv(source, sent, max_chunk_bytes=2 * source.layer_block_bytes, start=1, into=into)]
    offset = 0
    with open_segment(segment.id) as mapping:  # as the decode worker maps it: read-only, by /proc/PID/fd
        for layer, first, count, dtype, shape, num_layers in layout:
            size = chunk_bytes(dtype, shape, num_layers)
            with segment_view(mapping, offset, size) as data:
                import_kv(over_shm, reserved, KvChunk(layer, first, count, dtype, shape, data, num_layers))
            offset += size
        with pytest.raises(ValueError, match=rf"KV chunk of 16 bytes at shm_offset {len(mapping) - 8} runs past"):
            with segment_view(mapping, len(mapping) - 8, 16):
                pass
    pool.release(segment)
    pool.close()
    assert offset == 4 * source.block_bytes
    written = reserved[1:]  # the first block is the receiver's own (reused): never written
    for cache in (over_shm, over_grpc):
        assert torch.equal(cache.k[:, written], source.k[:, sent[1:]]) and torch.equal(cache.v[:, written],
                                                                                       source.v[:, sent[1:]])
