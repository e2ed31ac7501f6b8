"""Gateway CPU per streamed token: SSE streams of /v1/completions (incremental detokenization, the
OpenAI chunk JSON) through a real gateway and scheduler, against simulated workers (`tandem
sim-worker`: the real worker protocol and token streams, no model), so the gateway's own cost is
what is measured.

Sends `--requests` streamed requests, `--concurrency` at a time, each generating `--output-len`
tokens (ignore_eos), and reports the gateway's CPU (from /proc/<pid>/stat) per delivered token
and per request, with the SSE events per request (fewer than tokens when a message carried
several), the gateway's context switches per token and the load average; with `--split`, that
CPU as a fixed part per request and a part per token, from as many 2-token requests run after.
Bounded: requests x tokens, each request with a timeout; every process is stopped at the end.
`--profile FILE` records the gateway with py-spy (speedscope JSON).

Run: `.venv/bin/python bench/gateway_stream.py [--requests 96] [--concurrency 16] [--output-len 128]
[--stream-interval 4] [--event-loop asyncio] [--split]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.control_plane import cpu_model, cpu_seconds, loadavg  # noqa: E402
from services.common.event_loop import EVENT_LOOPS  # noqa: E402
from tests.sim_cluster import SimCluster, SimSpec  # noqa: E402

REQUEST_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Result:
    requests: int
    failed: int
    tokens: int
    events: int  # SSE events that carried text or a finish reason
    wall_s: float
    tokens_per_s: float
    stream_interval: int
    event_loop: str  # the gateway's --event-loop
    gateway_cpu_ms_per_token: float
    gateway_cpu_ms_per_request: float
    event_loop_cpu_ms_per_token: float  # the gateway's main thread alone: its asyncio event loop
    event_loop_system_ms_per_token: float  # of which in the kernel (the socket writes and reads, the polls)
    gateway_threads_cpu_s: dict[str, float]  # the run's CPU per gateway thread name (event loop, gRPC poller, ...)
    # The gateway's threads' context switches per token (voluntary: a thread waited, as on each hand-off from gRPC's
    # threads to the event loop; involuntary: it was preempted), summed over the threads.
    voluntary_switches_per_token: float
    involuntary_switches_per_token: float
    loadavg_before: str
    loadavg_after: str
    cpu: str
    # With --split: the gateway's CPU as a fixed part per request and a part per token, from the run and as many
    # 2-token requests right after it (a request of n tokens costs fixed + n x per token).
    fixed_cpu_ms_per_request: float | None = None
    marginal_cpu_ms_per_token: float | None = None


@dataclass(slots=True)
class Outcome:
    tokens: int = 0
    events: int = 0
    failed: int = 0


SHORT_LEN = 2  # --split's short requests: the tokens each generates


async def one_request(client: httpx.AsyncClient, outcome: Outcome, i: int, args: argparse.Namespace) -> None:
    body = {"prompt": f"Request {i}: tell me a long story about the sea.", "max_tokens": args.output_len,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            outcome.failed += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                outcome.failed += 1
            elif payload.get("usage"):
                outcome.tokens += payload["usage"]["completion_tokens"]
            else:
                outcome.events += 1


async def drive(address: str, count: int, args: argparse.Namespace) -> Outcome:
    outcome = Outcome()
    pending = iter(range(count))
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=f"http://{address}", limits=limits) as client:
        async def worker() -> None:
            for i in pending:
                await one_request(client, outcome, i, args)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return outcome


def measure(cluster: SimCluster, args: argparse.Namespace) -> Result:
    asyncio.run(drive(cluster.http_gateway, min(16, args.requests), args))  # warm-up
    pid = cluster.pid("gateway")
    profiler = None
    if args.profile:
        native = ["--native"] if args.native else []
        profiler = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                                     "--format", "speedscope", "--output", str(args.profile), "--rate", "200", *native],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    load_before, cpu_before, threads_before, started = loadavg(), cpu_seconds(pid), thread_cpu(pid), time.monotonic()
    switches_before = context_switches(pid)
    loop_before, loop_system_before = loop_cpu(pid), loop_cpu(pid, system_only=True)
    outcome = asyncio.run(drive(cluster.http_gateway, args.requests, args))
    wall, used, loop_used = time.monotonic() - started, cpu_seconds(pid) - cpu_before, loop_cpu(pid) - loop_before
    loop_system = loop_cpu(pid, system_only=True) - loop_system_before
    threads = {name: round(cpu - threads_before.get(name, 0.0), 3) for name, cpu in thread_cpu(pid).items()}
    voluntary, involuntary = (after - before for after, before in zip(context_switches(pid), switches_before))
    if profiler is not None:
        profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT, not on SIGTERM
        profiler.wait(timeout=60)
    tokens = max(outcome.tokens, 1)
    split = split_cpu(cluster, args, used) if args.split else {}
    return Result(requests=args.requests, failed=outcome.failed, tokens=outcome.tokens, events=outcome.events,
                  wall_s=round(wall, 2), tokens_per_s=round(outcome.tokens / wall, 1),
                  stream_interval=args.stream_interval, event_loop=args.event_loop,
                  gateway_cpu_ms_per_token=round(used * 1e3 / tokens, 4),
                  gateway_cpu_ms_per_request=round(used * 1e3 / max(args.requests, 1), 2),
                  event_loop_cpu_ms_per_token=round(loop_used * 1e3 / tokens, 4),
                  event_loop_system_ms_per_token=round(loop_system * 1e3 / tokens, 4),
                  gateway_threads_cpu_s={name: cpu for name, cpu in sorted(threads.items()) if cpu},
                  voluntary_switches_per_token=round(voluntary / tokens, 3),
                  involuntary_switches_per_token=round(involuntary / tokens, 3),
                  loadavg_before=load_before, loadavg_after=loadavg(), cpu=cpu_model(), **split)


def split_cpu(cluster: SimCluster, args: argparse.Namespace, used: float) -> dict[str, float]:
    """The run's gateway CPU (`used` seconds over `args.requests` of `args.output_len` tokens) split
    by `per_request_and_token`, with as many requests of SHORT_LEN tokens run now."""
    if args.output_len <= SHORT_LEN:
        raise SystemExit(f"--split needs --output-len above {SHORT_LEN}")
    pid = cluster.pid("gateway")
    before = cpu_seconds(pid)
    short = asyncio.run(drive(cluster.http_gateway, args.requests, argparse.Namespace(**{**vars(args),
                                                                                           "output_len": SHORT_LEN})))
    if short.failed:
        raise SystemExit(f"--split: {short.failed} of the {SHORT_LEN}-token requests failed")
    fixed, per_token = per_request_and_token(used * 1e3 / args.requests, args.output_len,
                                             (cpu_seconds(pid) - before) * 1e3 / args.requests, SHORT_LEN)
    return {"fixed_cpu_ms_per_request": round(fixed, 3), "marginal_cpu_ms_per_token": round(per_token, 4)}


def per_request_and_token(long_ms: float, long_len: int, short_ms: float, short_len: int) -> tuple[float, float]:
    """(fixed ms per request, ms per token) from the CPU per request of requests of two lengths,
    a request of n tokens taken to cost fixed + n x per token."""
    per_token = (long_ms - short_ms) / (long_len - short_len)
    return short_ms - short_len * per_token, per_token


def loop_cpu(pid: int, system_only: bool = False) -> float:
    """CPU seconds so far of the process's main thread (the gateway's event loop): user and
    system time, or the system time alone."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    user, system = int(fields[11]), int(fields[12])
    return (system if system_only else user + system) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each of the process's threads, summed by thread name."""
    totals: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:
            continue  # the thread ended
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return totals


def context_switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches so far, summed over the process's live threads (a
    thread that ended takes its count with it: the gateway's threads live as long as it does)."""
    voluntary = involuntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            counts = switch_counts((task / "status").read_text())
        except FileNotFoundError:
            continue  # the thread ended
        voluntary, involuntary = voluntary + counts[0], involuntary + counts[1]
    return voluntary, involuntary


def switch_counts(status: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches from the text of a /proc/.../status file."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16, help="streams in flight at once")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--workers", type=int, default=2, help="simulated colocated workers")
    parser.add_argument("--step-ms", type=float, default=10.0, help="a simulated iteration's time")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the gateway's --stream-interval (tokens per chunk after the first)")
    parser.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                        help="the gateway's --event-loop")
    parser.add_argument("--profile", type=Path, metavar="FILE", help="py-spy speedscope profile of the gateway")
    parser.add_argument("--native", action="store_true", help="with --profile: C frames too (gRPC's core, ...)")
    parser.add_argument("--split", action="store_true",
                        help=f"also run as many {SHORT_LEN}-token requests, and split the gateway's CPU into a "
                             "fixed part per request and a part per token")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ["TANDEM_STREAM_INTERVAL"] = str(args.stream_interval)  # the gateway child reads them
    os.environ["TANDEM_EVENT_LOOP"] = args.event_loop
    with tempfile.TemporaryDirectory(prefix="tandem-gw-") as tmp:
        cluster = SimCluster.start(Path(tmp), [SimSpec(count=args.workers, step_ms=args.step_ms, kv_blocks=4096)])
        try:
            result = measure(cluster, args)
        finally:
            cluster.stop()
    print(json.dumps(asdict(result), indent=None if args.json else 2))
    return 1 if result.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
