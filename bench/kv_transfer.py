"""KV hand-off throughput on one host: a prompt's KV pushed from a prefill-side cache to a
decode-side cache in another process, over KvTransferService.Push on loopback, the way the
workers ship it (services/runtime/kv_transfer.py's chunks as kv_transfer_pb2.KvChunk messages,
exported in a copy thread, imported on the receiver's event loop).

Reports, per prompt length (default 100 and 1,000 tokens of the default model): ms per hand-off
(median of --repeats) and GB/s (10^9 bytes of KV per second), plus the export and import copies
alone; and the same KV through a pooled shared-memory segment (one pre-faulted /dev/shm mapping the
sender gathers into and the receiver copies from: the copies a same-host path would cost, with no
gRPC). Bounded: --repeats hand-offs per length. Print `cat /proc/loadavg` beside the figures; run
under `flock /tmp/tandem-bench.lock`.
Run: `.venv/bin/python bench/kv_transfer.py [--tokens 100,1000] [--repeats 20] [--json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.common.model_config import ModelConfig  # noqa: E402
from services.common.model_store import default_model_dir  # noqa: E402
from services.runtime.kv_cache import PagedKVCache  # noqa: E402
from services.runtime.kv_transfer import KvChunk, export_kv, import_kv  # noqa: E402
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 256  # room for the longest prompt measured, on both sides
CHUNK_BYTES = 1 << 20  # the workers' --kv-chunk-bytes default
MAX_MESSAGE = 64 << 20


@dataclass(slots=True)
class Figure:
    tokens: int
    kv_bytes: int
    handoff_ms_p50: float
    handoff_gb_per_s: float
    export_ms_p50: float
    import_ms_p50: float
    shm_ms_p50: float
    shm_gb_per_s: float


def _cache(config: ModelConfig) -> PagedKVCache:
    cache = PagedKVCache(config, NUM_BLOCKS, BLOCK_SIZE)
    cache.k.normal_()
    cache.v.normal_()
    return cache


class _Receiver(kv_transfer_pb2_grpc.KvTransferServiceServicer):
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    async def Push(self, request_iterator, context) -> kv_transfer_pb2.PushAck:
        chunks = 0
        num_bytes = 0
        block_ids: list[int] = []
        async for message in request_iterator:
            if message.HasField("header"):
                block_ids = list(range(len(message.header.prompt_token_ids) // BLOCK_SIZE + 1))
            import_kv(self.cache, block_ids, KvChunk(message.layer, message.first_block, message.num_blocks,
                                                     message.dtype, tuple(message.shape), message.data))
            chunks += 1
            num_bytes += len(message.data)
        return kv_transfer_pb2.PushAck(chunks=chunks, bytes=num_bytes)


def _serve(model_dir: str, port: multiprocessing.Value) -> None:  # type: ignore[valid-type]
    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE)])
        kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server(
            _Receiver(_cache(ModelConfig.from_model_dir(model_dir))), server)
        port.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await server.wait_for_termination()

    torch.set_num_threads(1)
    asyncio.run(main())


async def _messages(block_ids: list[int], cache: PagedKVCache, tokens: int):
    chunks = export_kv(cache, block_ids, CHUNK_BYTES)
    first = True
    while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
        message = kv_transfer_pb2.KvChunk(request_id="bench", layer=chunk.layer, first_block=chunk.first_block,
                                          num_blocks=chunk.num_blocks, dtype=chunk.dtype, shape=chunk.shape,
                                          data=chunk.data)
        if first:
            message.header.prompt_token_ids.extend([0] * tokens)
            first = False
        yield message


def _copy_times(cache: PagedKVCache, block_ids: list[int], repeats: int) -> tuple[float, float]:
    exports, imports = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        chunks = list(export_kv(cache, block_ids, CHUNK_BYTES))
        exports.append(time.perf_counter() - start)
        start = time.perf_counter()
        for chunk in chunks:
            import_kv(cache, block_ids, chunk)
        imports.append(time.perf_counter() - start)
    return statistics.median(exports) * 1000, statistics.median(imports) * 1000


def _shm_time(cache: PagedKVCache, block_ids: list[int], repeats: int) -> float:
    """Median seconds to gather every layer's blocks into a pre-faulted shared mapping and copy
    them back out of a second mapping of it; the file is unlinked before use, so nothing is left."""
    shape = (cache.num_layers, 2, len(block_ids), *cache.block_shape)
    size = len(block_ids) * cache.block_bytes
    fd = os.open(f"/dev/shm/tandem-kv-bench-{os.getpid()}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(f"/dev/shm/tandem-kv-bench-{os.getpid()}")
        os.ftruncate(fd, size)
        writer, reader = mmap.mmap(fd, size), mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    sent = np.frombuffer(writer, dtype=np.float32).reshape(shape)
    received = np.frombuffer(reader, dtype=np.float32).reshape(shape)
    k, v = cache.k.numpy(), cache.v.numpy()
    times = []
    for _ in range(repeats + 1):  # the first pass faults the pages in
        start = time.perf_counter()
        for layer in range(cache.num_layers):
            np.take(k[layer], block_ids, axis=0, out=sent[layer, 0])
            np.take(v[layer], block_ids, axis=0, out=sent[layer, 1])
        for layer in range(cache.num_layers):
            k[layer][block_ids] = received[layer, 0]
            v[layer][block_ids] = received[layer, 1]
        times.append(time.perf_counter() - start)
    del sent, received
    writer.close()
    reader.close()
    return statistics.median(times[1:])


async def _measure(address: str, cache: PagedKVCache, tokens: int, repeats: int) -> Figure:
    block_ids = list(range(tokens // BLOCK_SIZE + 1))
    kv_bytes = len(block_ids) * cache.block_bytes
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", MAX_MESSAGE)]) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        await asyncio.wait_for(stub.Push(_messages(block_ids, cache, tokens)), 30)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            ack = await asyncio.wait_for(stub.Push(_messages(block_ids, cache, tokens)), 30)
            times.append(time.perf_counter() - start)
            if ack.bytes != kv_bytes:
                raise RuntimeError(f"the receiver got {ack.bytes} bytes of {kv_bytes}")
    export_ms, import_ms = _copy_times(cache, block_ids, repeats)
    median = statistics.median(times)
    shm = _shm_time(cache, block_ids, repeats)
    return Figure(tokens, kv_bytes, median * 1000, kv_bytes / median / 1e9, export_ms, import_ms,
                  shm * 1000, kv_bytes / shm / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="100,1000", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model_dir = str(default_model_dir())
    port = multiprocessing.get_context("spawn").Value("i", 0)
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(model_dir, port), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 60
        while port.value == 0:
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError("the receiving process did not start within 60 s")
            time.sleep(0.05)
        torch.set_num_threads(1)
        cache = _cache(ModelConfig.from_model_dir(model_dir))
        figures = [asyncio.run(_measure(f"127.0.0.1:{port.value}", cache, int(t), args.repeats))
                   for t in args.tokens.split(",")]
    finally:
        server.terminate()
        server.join(10)
    loadavg = Path("/proc/loadavg").read_text().strip()
    if args.json:
        print(json.dumps({"loadavg": loadavg, "figures": [asdict(f) for f in figures]}, indent=2))
        return
    print(f"loadavg: {loadavg}")
    print(f"{'tokens':>7} {'KV MB':>7} {'hand-off ms':>12} {'GB/s':>6} {'export ms':>10} {'import ms':>10} {'shm ms':>7} {'shm GB/s':>9}")
    for f in figures:
        print(f"{f.tokens:>7} {f.kv_bytes / 1e6:>7.2f} {f.handoff_ms_p50:>12.2f} {f.handoff_gb_per_s:>6.2f} "
              f"{f.export_ms_p50:>10.2f} {f.import_ms_p50:>10.2f} {f.shm_ms_p50:>7.2f} {f.shm_gb_per_s:>9.2f}")


if __name__ == "__main__":
    main()
