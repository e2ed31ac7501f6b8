"""Mesh overhead: N concurrent greedy streams through the gateway's gRPC door, against the same load
on the in-process engine with no services, in one run.

Compares disaggregated (1 prefill + 1 decode), colocated (1 worker) and the in-process engine:
TTFT, inter-token latency (mean, p50, p99), output tokens/s, and the mesh's overhead in output
throughput; reports KV transfer throughput on loopback. Bounded: N requests, fixed lengths.
Run: `.venv/bin/python bench/mesh_overhead.py [--concurrency 16] [--input-len 128] [--output-len 64] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import percentile  # noqa: E402
from tests.mesh import Mesh, greedy_request  # noqa: E402

KV_BYTES_PER_TOKEN = 46080
IDLE_TRANSFER_TOKENS = 1024  # a multiple of the block size, so the KV shipped is exactly this many tokens


@dataclass(slots=True)
class StreamTiming:
    ttft_s: float
    gaps_s: list[float]
    tokens: int
    kv_transfer_ms: float


@dataclass(slots=True)
class Summary:
    setup: str
    requests: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens_per_s: float
    kv_transfer_mb_per_s: float | None  # under the benchmark's load
    kv_transfer_mb_per_s_idle: float | None = None  # one request with a long prompt on an idle mesh


def prompts(count: int, length: int) -> list[list[int]]:
    return [[(i * 7919 + j * 131) % 40000 + 200 for j in range(length)] for i in range(count)]


def summarize(setup: str, timings: list[StreamTiming], wall_s: float, input_len: int) -> Summary:
    ttfts = [t.ttft_s * 1000 for t in timings]
    gaps = [g * 1000 for t in timings for g in t.gaps_s]
    transfer_ms = [t.kv_transfer_ms for t in timings if t.kv_transfer_ms > 0]
    kv_mb = -(-input_len // 16) * 16 * KV_BYTES_PER_TOKEN / 1e6
    return Summary(
        setup, len(timings),
        statistics.fmean(ttfts), percentile(ttfts, 0.5), percentile(ttfts, 0.99),
        statistics.fmean(gaps) if gaps else 0.0, percentile(gaps, 0.5), percentile(gaps, 0.99),
        sum(t.tokens for t in timings) / wall_s,
        kv_mb / (statistics.fmean(transfer_ms) / 1000) if transfer_ms else None,
    )


def stream_through(mesh: Mesh, prompt: list[int], output_len: int) -> StreamTiming:
    request = greedy_request(prompt, output_len)
    request.sampling.ignore_eos = True
    start = time.perf_counter()
    stamps, tokens, transfer_ms = [], 0, 0.0
    for message in mesh.gateway().Generate(request, timeout=600):
        if message.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(message.token_ids)
        transfer_ms = max(transfer_ms, message.timings.kv_transfer_ms)
    return StreamTiming(stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], tokens, transfer_ms)


def run_mesh(setup: str, args, *up_args: str) -> Summary:
    with tempfile.TemporaryDirectory() as run_dir:
        mesh = Mesh.start(*up_args, run_dir=Path(run_dir))
        try:
            work = prompts(args.concurrency, args.input_len)
            stream_through(mesh, work[0][:8], 2)  # warm-up
            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                timings = list(pool.map(lambda p: stream_through(mesh, p, args.output_len), work))
            summary = summarize(setup, timings, time.perf_counter() - start, args.input_len)
            idle = stream_through(mesh, prompts(1, IDLE_TRANSFER_TOKENS)[0], 2)
            if idle.kv_transfer_ms > 0:
                summary.kv_transfer_mb_per_s_idle = IDLE_TRANSFER_TOKENS * KV_BYTES_PER_TOKEN / 1e6 / (
                    idle.kv_transfer_ms / 1000)
            return summary
        finally:
            mesh.stop()


def run_in_process(args, threads: int) -> Summary:
    import torch

    from services.common.model_store import ensure_default_model
    from services.runtime.engine import Engine, EngineConfig
    from services.runtime.sampler import SamplingParams

    torch.set_num_threads(threads)
    engine = Engine.from_model_dir(ensure_default_model(), EngineConfig(kv_memory_bytes=1 << 30))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompts(1, 8)[0]], SamplingParams(max_tokens=2, temperature=0.0))
    work = prompts(args.concurrency, args.input_len)
    start = time.perf_counter()
    stamps: dict[str, list[float]] = {}
    for i, prompt in enumerate(work):
        engine.add_request(f"bench-{i}", prompt, params)
        stamps[f"bench-{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            stamps[out.request_id].append(time.perf_counter())
    timings = [StreamTiming(s[0] - start, [b - a for a, b in zip(s, s[1:])], len(s), 0.0) for s in stamps.values()]
    return summarize(f"in-process, {threads} thread(s)", timings, time.perf_counter() - start, args.input_len)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the in-process engine (default: every core, as the mesh's workers "
                             "share them: `tandem up` splits the cores evenly between its workers)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # The second in-process run has one core, as each disaggregated worker does on a 2-core machine.
    results = [
        run_in_process(args, args.threads),
        run_mesh("colocated (1 worker)", args, "--mode", "colocated"),
        run_mesh("disaggregated (1P+1D)", args, "--prefill", "1", "--decode", "1"),
        run_in_process(args, max(1, args.threads // 2)),
    ]
    baseline = results[0].output_tokens_per_s
    report = {"results": [asdict(r) for r in results],
              "throughput_vs_in_process": {r.setup: r.output_tokens_per_s / baseline for r in results},
              "target": "mesh output throughput >= 0.85x the in-process engine at 16 streams"}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'setup':24} {'ttft ms':>9} {'p99':>8} {'itl ms':>8} {'p50':>7} {'p99':>7} {'tok/s':>8} {'vs eng':>7} "
          f"{'KV MB/s':>8} {'idle':>6}")
    for r in results:
        kv = f"{r.kv_transfer_mb_per_s:8.0f}" if r.kv_transfer_mb_per_s else f"{'-':>8}"
        idle = f"{r.kv_transfer_mb_per_s_idle:6.0f}" if r.kv_transfer_mb_per_s_idle else f"{'-':>6}"
        print(f"{r.setup:24} {r.ttft_mean_ms:9.1f} {r.ttft_p99_ms:8.1f} {r.itl_mean_ms:8.1f} {r.itl_p50_ms:7.1f} "
              f"{r.itl_p99_ms:7.1f} {r.output_tokens_per_s:8.1f} {r.output_tokens_per_s / baseline:6.2f}x {kv} {idle}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
