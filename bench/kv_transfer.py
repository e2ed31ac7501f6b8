"""KV hand-off throughput on one host: a prompt's KV pushed from a prefill-side cache to a
decode-side cache in another process over KvTransferService.Push on loopback, the way the workers
ship it (services/runtime/kv_transfer.py's chunks, exported in a copy thread, imported on the
receiver's event loop), by each of the workers' transports:

- grpc: the bytes in the KvChunk messages;
- shm: the same-host path, the bytes gathered into a pooled memfd segment of the sender's
  (services/runtime/kv_shm.py), the messages carrying offsets, the receiver mapping the segment;
- streamed: shm as a prefill worker ships it, layer-pipelined: each layer gathered on its own (as
  the forward pass does once the layer is computed, LAYER_GAP_S after the previous one) and
  announced in its own message; its tail, from the last layer's gather to the ack, is what the
  hand-off adds after the prefill's last layer;
- reuse: grpc for a second turn whose first --reused fraction of blocks the receiver already holds
  (decode-side prefix reuse): only the blocks after them cross.

Reports, per prompt length (default 100 and 1,000 tokens of the default model): ms per hand-off
(median of --repeats) and GB/s (10^9 bytes of the prompt's KV per second), plus the export and
import copies alone. Bounded: --repeats hand-offs per length and transport.

--mesh N instead starts `tandem up --prefill 1 --decode 1` once per transport (TANDEM_KV_TRANSPORT
grpc, then auto: the same-host path) and sends N greedy requests of a 1,000-word text prompt, one
at a time, each new from its first word: the median time to the first token (the prefill worker's:
before the KV moves), to the second (the decode worker's first: after it), the KV transfer ms the
stream reports, the decode step (the median gap between the request's later tokens) and the
transfer's share of that step. Print `cat /proc/loadavg` beside the figures; run under `flock
/tmp/tandem-bench.lock`.
Run: `.venv/bin/python bench/kv_transfer.py [--tokens 100,1000] [--repeats 20] [--reused 0.9] [--json]`
or `.venv/bin/python bench/kv_transfer.py --mesh 3 [--mesh-transport auto]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from services.common.model_config import ModelConfig  # noqa: E402
from services.common.model_store import default_model_dir  # noqa: E402
from services.runtime.kv_cache import PagedKVCache  # noqa: E402
from services.runtime.kv_shm import Segment, SegmentId, SegmentPool, open_segment, segment_view  # noqa: E402
from services.runtime.kv_transfer import (  # noqa: E402
    DTYPE_NAMES, KvChunk, chunk_bytes, export_kv, gather_layer, import_kv)
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 256  # room for the longest prompt measured, on both sides
CHUNK_BYTES = 1 << 20  # the workers' --kv-chunk-bytes default
MAX_MESSAGE = 64 << 20
# Between two layers of a prefill's last chunk (a sleep: the receiver keeps the CPU it would share).
# Far below the real forward pass: 1,000 tokens take ~70 ms a layer on one loaded Zen 4 core.
LAYER_GAP_S = 0.005
MESH_TRANSPORTS = ("grpc", "auto")  # --mesh's TANDEM_KV_TRANSPORT values: auto takes the same-host path
MESH_TOKENS = 16  # per mesh request: the gaps between its later tokens are its decode steps


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
    streamed_tail_ms_p50: float
    reused_blocks: int
    reuse_ms_p50: float


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
        first = await anext(aiter(request_iterator))
        header = first.header
        block_ids = list(range(len(header.prompt_token_ids) // BLOCK_SIZE + 1))
        with contextlib.ExitStack() as stack:
            segment = stack.enter_context(open_segment(SegmentId(
                header.shm_segment.pid, header.shm_segment.fd, header.shm_segment.inode,
                header.shm_segment.size))) if header.HasField("shm_segment") else None
            async for message in _chain(first, request_iterator):
                with contextlib.ExitStack() as views:
                    num_layers = message.num_layers or 1
                    data = message.data if segment is None else views.enter_context(segment_view(
                        segment, message.shm_offset, chunk_bytes(message.dtype, message.shape, num_layers)))
                    import_kv(self.cache, block_ids, KvChunk(message.layer, message.first_block, message.num_blocks,
                                                             message.dtype, tuple(message.shape), data, num_layers))
                    num_bytes += len(data)
                chunks += 1
        return kv_transfer_pb2.PushAck(chunks=chunks, bytes=num_bytes)


async def _chain(first, rest):
    yield first
    async for message in rest:
        yield message


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


async def _streamed(block_ids: list[int], cache: PagedKVCache, tokens: int, segment: Segment, marks: list[float]):
    """The prefill worker's layer-pipelined messages: one layer gathered into `segment` per message;
    the time the last layer was gathered goes on `marks`."""
    ident, layer_bytes = segment.id, len(block_ids) * cache.layer_block_bytes
    with memoryview(segment.buffer) as into:
        for layer in range(cache.num_layers):
            await asyncio.sleep(LAYER_GAP_S)
            await asyncio.to_thread(gather_layer, cache, block_ids, layer, into)
            message = kv_transfer_pb2.KvChunk(request_id="bench", layer=layer, num_layers=1, first_block=0,
                                              num_blocks=len(block_ids), dtype=DTYPE_NAMES[cache.dtype],
                                              shape=(2, len(block_ids), *cache.block_shape),
                                              shm_offset=layer * layer_bytes)
            if layer == 0:
                message.header.prompt_token_ids.extend([0] * tokens)
                message.header.shm_segment.CopyFrom(kv_transfer_pb2.ShmSegment(
                    pid=ident.pid, fd=ident.fd, inode=ident.inode, size=ident.size))
            if layer == cache.num_layers - 1:
                marks.append(time.perf_counter())
            yield message


async def _messages(block_ids: list[int], cache: PagedKVCache, tokens: int, start: int = 0,
                    segment: Segment | None = None):
    """The workers' messages (services/prefill/servicer.py): the bytes inline, or offsets into `segment`."""
    with contextlib.ExitStack() as stack:
        into = stack.enter_context(memoryview(segment.buffer)) if segment is not None else None
        chunks = export_kv(cache, block_ids, CHUNK_BYTES, start, into)
        offset = 0
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            message = kv_transfer_pb2.KvChunk(request_id="bench", layer=chunk.layer, first_block=chunk.first_block,
                                              num_blocks=chunk.num_blocks, dtype=chunk.dtype, shape=chunk.shape,
                                              num_layers=chunk.num_layers)
            if segment is None:
                message.data = chunk.data
            else:
                message.shm_offset = offset
            offset += len(chunk.data)
            if offset == len(chunk.data):
                message.header.prompt_token_ids.extend([0] * tokens)
                if segment is not None:
                    ident = segment.id
                    message.header.shm_segment.CopyFrom(kv_transfer_pb2.ShmSegment(
                        pid=ident.pid, fd=ident.fd, inode=ident.inode, size=ident.size))
            del chunk
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


async def _handoffs(stub, cache: PagedKVCache, tokens: int, repeats: int, start: int = 0,
                    pool: SegmentPool | None = None, streamed: bool = False) -> tuple[float, float]:
    """Median seconds of a hand-off (after one warm-up), as a prefill worker runs it: a segment
    from the pool when one is given, back to it after the ack; and of its tail when `streamed`."""
    block_ids = list(range(tokens // BLOCK_SIZE + 1))
    shipped = (len(block_ids) - start) * cache.block_bytes
    times, tails = [], []
    for _ in range(repeats + 1):
        began, marks = time.perf_counter(), []
        segment = pool.acquire(shipped) if pool is not None else None
        messages = (_streamed(block_ids, cache, tokens, segment, marks) if streamed and segment is not None
                    else _messages(block_ids, cache, tokens, start, segment))
        ack = await asyncio.wait_for(stub.Push(messages), 30)
        ended = time.perf_counter()
        if segment is not None:
            pool.release(segment)
        times.append(ended - began)
        tails.append(ended - marks[0] if marks else 0.0)
        if ack.bytes != shipped:
            raise RuntimeError(f"the receiver got {ack.bytes} bytes of {shipped}")
    return statistics.median(times[1:]), statistics.median(tails[1:])


async def _measure(address: str, cache: PagedKVCache, tokens: int, repeats: int, reused: float) -> Figure:
    block_ids = list(range(tokens // BLOCK_SIZE + 1))
    kv_bytes = len(block_ids) * cache.block_bytes
    reused_blocks = min(int(len(block_ids) * reused), len(block_ids) - 1)
    pool = SegmentPool()
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", MAX_MESSAGE)]) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        grpc_s, _ = await _handoffs(stub, cache, tokens, repeats)
        shm_s, _ = await _handoffs(stub, cache, tokens, repeats, pool=pool)
        _, tail_s = await _handoffs(stub, cache, tokens, repeats, pool=pool, streamed=True)
        reuse_s, _ = await _handoffs(stub, cache, tokens, repeats, start=reused_blocks)
    pool.close()
    export_ms, import_ms = _copy_times(cache, block_ids, repeats)
    return Figure(tokens, kv_bytes, grpc_s * 1000, kv_bytes / grpc_s / 1e9, export_ms, import_ms,
                  shm_s * 1000, kv_bytes / shm_s / 1e9, tail_s * 1000, reused_blocks,
                  reuse_s * 1000)


@dataclass(slots=True)
class MeshFigure:
    transport: str
    prompt_tokens: int
    ttft_ms_p50: float
    second_token_ms_p50: float
    kv_transfer_ms_p50: float
    decode_step_ms_p50: float

    @property
    def share_of_step(self) -> float:
        return self.kv_transfer_ms_p50 / self.decode_step_ms_p50


def _words(request: int) -> str:
    """1,000 words, the first naming the request, so no two requests share a cached block."""
    vocabulary = ["river", "stone", "valley", "morning", "garden", "letter", "window", "quiet", "market", "bridge",
                  "winter", "harbour", "lantern", "orchard", "meadow", "silver", "candle", "journey", "forest", "tower"]
    return f"Request{request} " + " ".join(vocabulary[(request * 7 + i * 13) % len(vocabulary)] for i in range(999))


def _mesh_run(transport: str, requests: int) -> MeshFigure:
    import tempfile

    from tandem.v1 import common_pb2, gateway_pb2
    from tests.mesh import Mesh

    with tempfile.TemporaryDirectory() as run_dir:
        mesh = Mesh.start("--prefill", "1", "--decode", "1", env={"TANDEM_KV_TRANSPORT": transport},
                          run_dir=Path(run_dir))
        try:
            samples = []
            for i in range(requests + 1):  # the first warms up
                request = gateway_pb2.GenerateRequest(prompt=_words(i + (1000 if transport == "grpc" else 0)),
                                                      sampling=common_pb2.SamplingParams(
                                                          max_tokens=MESH_TOKENS, temperature=0.0,
                                                          ignore_eos=True))
                start, stamps, transfer_ms, prompt_tokens = time.perf_counter(), [], 0.0, 0
                for message in mesh.gateway().Generate(request, timeout=600):
                    stamps.extend([time.perf_counter()] * len(message.token_ids))
                    transfer_ms = max(transfer_ms, message.timings.kv_transfer_ms)
                    prompt_tokens = max(prompt_tokens, message.usage.prompt_tokens)
                step = statistics.median(later - earlier for earlier, later in zip(stamps[1:], stamps[2:]))
                samples.append((stamps[0] - start, stamps[1] - start, transfer_ms, prompt_tokens, step))
        finally:
            mesh.stop()
    samples = samples[1:]
    return MeshFigure(transport, samples[0][3], statistics.median(s[0] for s in samples) * 1000,
                      statistics.median(s[1] for s in samples) * 1000, statistics.median(s[2] for s in samples),
                      statistics.median(s[4] for s in samples) * 1000)


def main_mesh(requests: int, as_json: bool, transports: list[str]) -> None:
    figures = [_mesh_run(transport, requests) for transport in transports]
    loadavg = Path("/proc/loadavg").read_text().strip()
    if as_json:
        mesh = [{**asdict(f), "share_of_step": f.share_of_step} for f in figures]
        print(json.dumps({"loadavg": loadavg, "mesh": mesh}, indent=2))
        return
    print(f"loadavg: {loadavg}")
    print(f"{'transport':>9} {'prompt':>7} {'TTFT ms':>8} {'2nd token ms':>13} {'KV transfer ms':>15} "
          f"{'decode step ms':>15} {'share':>6}")
    for f in figures:
        print(f"{f.transport:>9} {f.prompt_tokens:>7} {f.ttft_ms_p50:>8.0f} {f.second_token_ms_p50:>13.0f} "
              f"{f.kv_transfer_ms_p50:>15.1f} {f.decode_step_ms_p50:>15.1f} {f.share_of_step:>6.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="100,1000", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--reused", type=float, default=0.9,
                        help="fraction of the prompt's blocks the receiver holds in the reuse case")
    parser.add_argument("--mesh", type=int, metavar="N", default=0,
                        help="time N requests of a 1,000-word prompt through a disaggregated mesh per transport")
    parser.add_argument("--mesh-transport", choices=MESH_TRANSPORTS, action="append", default=[],
                        help="with --mesh: the transports to time, in order; repeatable (default: grpc, then auto)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.mesh:
        main_mesh(args.mesh, args.json, args.mesh_transport or list(MESH_TRANSPORTS))
        return
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
        figures = [asyncio.run(_measure(f"127.0.0.1:{port.value}", cache, int(t), args.repeats, args.reused))
                   for t in args.tokens.split(",")]
    finally:
        server.terminate()
        server.join(10)
    loadavg = Path("/proc/loadavg").read_text().strip()
    if args.json:
        print(json.dumps({"loadavg": loadavg, "figures": [asdict(f) for f in figures]}, indent=2))
        return
    print(f"loadavg: {loadavg}")
    print(f"{'tokens':>7} {'KV MB':>7} {'grpc ms':>8} {'GB/s':>6} {'shm ms':>7} {'GB/s':>6} "
          f"{'streamed tail ms':>17} {'reused':>7} {'reuse ms':>9} {'export ms':>10} {'import ms':>10}")
    for f in figures:
        print(f"{f.tokens:>7} {f.kv_bytes / 1e6:>7.2f} {f.handoff_ms_p50:>8.2f} {f.handoff_gb_per_s:>6.2f} "
              f"{f.shm_ms_p50:>7.2f} {f.shm_gb_per_s:>6.2f} {f.streamed_tail_ms_p50:>17.2f} "
              f"{f.reused_blocks:>7} {f.reuse_ms_p50:>9.2f} {f.export_ms_p50:>10.2f} {f.import_ms_p50:>10.2f}")


if __name__ == "__main__":
    main()
