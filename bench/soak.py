"""Soak benchmark: Poisson load at a fraction of measured capacity through a real `tandem up` mesh,
killing one worker every few minutes, for a bounded time.

First it measures capacity (completed requests per second with a closed loop of concurrent streams),
then offers Poisson arrivals at `--load` of it for `--duration` seconds and SIGKILLs one worker every
`--kill-every` seconds (the launcher restarts it). It reports the success rate, TTFT p50/p99 per
window and the p99 drift between the first and last window, the RSS growth of every service that
was not killed (over the whole run, and per hour over the second half, once the KV pool is warm),
the scheduler's migrations, and the Redis keys left once the mesh is idle (those that are neither
worker registry nor prefix index are request state, and should be none).
Bounded: at most duration x rate requests, each with its own deadline.
Run: `.venv/bin/python bench/soak.py [--duration 600] [--kill-every 180] [--load 0.7] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from tests.mesh import Mesh, greedy_request  # noqa: E402

WORKER_ROLES = ("prefill", "decode", "colocated")
INDEX_KEY = re.compile(r"^tandem:(workers|worker:.+|blocks:.+|block:.+)$")  # registry and prefix index


@dataclass(slots=True)
class Outcome:
    started_s: float  # since the soak began
    ttft_s: float | None
    code: str  # "OK" or the gRPC status name


@dataclass(slots=True)
class Report:
    capacity_rps: float
    offered_rps: float
    duration_s: float
    requests: int
    success_rate: float
    failures: dict[str, int]
    ttft_p50_ms_by_window: list[float]
    ttft_p99_ms_by_window: list[float]
    ttft_p99_drift: float  # last window's p99 over the first window's
    kills: list[str]
    rss_growth_mib: dict[str, float]  # start to end, KV pool first touch included
    rss_growth_mib_per_hour_second_half: dict[str, float]  # the drift once the KV pool is warm
    migrations: int | None
    redis_keys_left: int | None
    redis_request_keys_left: int | None  # keys other than the worker registry and prefix index
    restarts_logged: int = 0


def prompt(i: int, length: int) -> list[int]:
    return [(i * 7919 + j * 131) % 40000 + 200 for j in range(length)]


def one_request(stub, i: int, args: argparse.Namespace, t0: float) -> Outcome:
    started = time.monotonic()
    ttft = None
    try:
        stream = stub.Generate(greedy_request(prompt(i, args.input_len), args.output_len), timeout=args.request_timeout)
        for message in stream:
            if ttft is None and message.token_ids:
                ttft = time.monotonic() - started
        return Outcome(started - t0, ttft, "OK")
    except grpc.RpcError as error:
        return Outcome(started - t0, ttft, error.code().name)


def measure_capacity(mesh: Mesh, args: argparse.Namespace) -> float:
    """Completed requests per second with `--concurrency` streams always open."""
    stub = mesh.gateway()
    count = args.concurrency * 3
    begin = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        outcomes = list(pool.map(lambda i: one_request(stub, i, args, begin), range(count)))
    elapsed = time.monotonic() - begin
    ok = sum(o.code == "OK" for o in outcomes)
    if ok == 0:
        raise SystemExit(f"capacity run failed: {Counter(o.code for o in outcomes)}")
    return ok / elapsed


def descendants(root: int) -> dict[int, str]:
    """pid -> role name ('prefill', 'decode', 'scheduler', 'gateway', 'redis', ...) of root's process tree."""
    parents: dict[int, int] = {}
    commands: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid:
                tree[child] = _role(commands.get(child, []))
                frontier.append(child)
    return {pid: role for pid, role in tree.items() if role}


def _role(argv: list[str]) -> str:
    if argv and "redis-server" in argv[0]:
        return "redis"
    if "tandem.cli" in argv:
        index = argv.index("tandem.cli")
        return argv[index + 1] if index + 1 < len(argv) else ""
    return ""


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def windows(outcomes: list[Outcome], duration: float, count: int) -> list[list[float]]:
    width = duration / count
    buckets: list[list[float]] = [[] for _ in range(count)]
    for outcome in outcomes:
        if outcome.ttft_s is not None:
            buckets[min(count - 1, int(outcome.started_s / width))].append(outcome.ttft_s * 1000)
    return buckets


def scheduler_migrations(mesh: Mesh) -> int | None:
    stats = mesh.scheduler_stats()
    return stats.migrated if hasattr(stats, "migrated") else None


def redis_keys(mesh: Mesh) -> tuple[int | None, int | None]:
    """All keys left in the mesh's Redis, and those that are neither worker registry nor prefix index."""
    try:
        endpoint = mesh.endpoint("redis", "redis")
    except KeyError:
        return None, None
    import redis

    url = endpoint.address if "://" in endpoint.address else f"redis://{endpoint.address}"
    client = redis.Redis.from_url(url, password=mesh.internal_token)  # tandem up makes the token its password
    keys = [key.decode() for key in client.keys("*")]
    return len(keys), sum(not INDEX_KEY.match(key) for key in keys)


def rss_of(pids: dict[int, str]) -> dict[int, float | None]:
    return {pid: rss_mib(pid) for pid in pids}


def growth(pids: dict[int, str], before: dict[int, float | None], after: dict[int, float | None],
           per_seconds: float | None = None) -> dict[str, float]:
    """MiB each service grew from `before` to `after` (per hour when `per_seconds` is given)."""
    grown = {}
    for pid, role in pids.items():
        if before.get(pid) is not None and after.get(pid) is not None:
            mib = after[pid] - before[pid]
            grown[f"{role}[{pid}]"] = round(mib / per_seconds * 3600 if per_seconds else mib, 1)
    return grown


def soak(mesh: Mesh, args: argparse.Namespace) -> Report:
    capacity = measure_capacity(mesh, args)
    rate = capacity * args.load
    stub = mesh.gateway()
    rng = random.Random(args.seed)
    initial = descendants(mesh.process.pid)
    rss_start = rss_of(initial)
    rss_mid: dict[int, float | None] = {}
    mid_at = 0.0
    killed: set[int] = set()
    kills: list[str] = []
    results: list[Outcome] = []
    lock = threading.Lock()

    def record(i: int, t0: float) -> None:
        outcome = one_request(stub, i, args, t0)
        with lock:
            results.append(outcome)

    t0 = time.monotonic()
    next_kill = t0 + args.kill_every
    with ThreadPoolExecutor(max(8, int(rate * args.request_timeout) + 1)) as pool:
        i = 0
        arrival = t0
        while arrival < t0 + args.duration:
            arrival += rng.expovariate(rate)
            now = time.monotonic()
            if arrival > now:
                time.sleep(arrival - now)
            if not rss_mid and time.monotonic() >= t0 + args.duration / 2:
                rss_mid, mid_at = rss_of(initial), time.monotonic()
            if time.monotonic() >= next_kill:
                kills.append(kill_one_worker(mesh, rng, killed))
                next_kill += args.kill_every
            pool.submit(record, i, t0)
            i += 1
    duration = time.monotonic() - t0
    wait_all_answer(mesh, timeout=args.request_timeout * 3)  # a worker killed near the end is restarting
    mesh.wait_idle(timeout=args.request_timeout)
    survivors = {pid: role for pid, role in initial.items() if pid not in killed}
    rss_end, end_at = rss_of(survivors), time.monotonic()
    keys_left, request_keys_left = redis_keys(mesh)
    buckets = windows(results, duration, args.windows)
    p99 = [round(percentile(b, 0.99), 1) for b in buckets]
    ok = sum(o.code == "OK" for o in results)
    return Report(
        capacity_rps=round(capacity, 3), offered_rps=round(rate, 3), duration_s=round(duration, 1),
        requests=len(results), success_rate=round(ok / max(1, len(results)), 4),
        failures=dict(Counter(o.code for o in results if o.code != "OK")),
        ttft_p50_ms_by_window=[round(percentile(b, 0.5), 1) for b in buckets], ttft_p99_ms_by_window=p99,
        ttft_p99_drift=round(p99[-1] / p99[0], 3) if p99[0] and p99[0] == p99[0] else float("nan"),
        kills=kills, rss_growth_mib=growth(survivors, rss_start, rss_end),
        rss_growth_mib_per_hour_second_half=growth(survivors, rss_mid, rss_end, end_at - mid_at),
        migrations=scheduler_migrations(mesh), redis_keys_left=keys_left, redis_request_keys_left=request_keys_left,
        restarts_logged=sum("restart" in line for line in mesh.log),
    )


def wait_all_answer(mesh: Mesh, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for name in mesh.names("prefill") + mesh.names("decode") + mesh.names("colocated"):
        while True:
            try:
                mesh.worker_stats(name)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not come back within {timeout:.0f} s of the last kill")
                time.sleep(0.2)


def kill_one_worker(mesh: Mesh, rng: random.Random, killed: set[int]) -> str:
    workers = sorted((pid, role) for pid, role in descendants(mesh.process.pid).items() if role in WORKER_ROLES)
    if not workers:
        return "no worker to kill"
    pid, role = rng.choice(workers)
    os.kill(pid, 9)
    killed.add(pid)
    return f"{role}[{pid}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of Poisson load")
    parser.add_argument("--kill-every", type=float, default=180.0, help="seconds between worker kills")
    parser.add_argument("--load", type=float, default=0.7, help="offered load as a fraction of capacity")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8, help="streams of the capacity run")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--windows", type=int, default=5, help="TTFT windows over the soak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        mesh = Mesh.start("--prefill", str(args.prefill), "--decode", str(args.decode), run_dir=Path(run_dir))
        try:
            report = soak(mesh, args)
        finally:
            mesh.stop()
    if args.json:
        print(json.dumps(asdict(report), indent=2))
        return
    for name, value in asdict(report).items():
        print(f"{name:>36}: {value}")
    print(f"{'CPU':>36}: {cpu_model()} ({os.cpu_count()} cores)")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
