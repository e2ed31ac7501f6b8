"""Control-plane benchmark: a real scheduler and gateway on loopback with 10 to 100 simulated workers
(`tandem sim-worker`: the real worker protocol, no model), driven through the gateway with bounded load.

For each point (workers x prefix-index size x store) it starts a fresh cluster (tests/sim_cluster.py),
pre-fills the prefix index with synthetic blocks through the scheduler's ReportBlocks (the door a
worker's block events take into the store, Redis or embedded), then sends `--requests` requests at
`--concurrency` and reports:
  - routing decisions/s (requests routed per second of the run), and the scheduler's own capacity:
    requests per second of scheduler CPU;
  - the scheduler's fixed cost (CPU per second while the workers only heartbeat, measured for
    IDLE_S before the run) and its marginal cost per request (the run's CPU less that fixed cost);
    from them, the requests per second one saturated scheduler core would route (its
    capacity: the second's CPU left after the fixed cost, over the marginal cost per request);
  - scheduler and gateway CPU per 1,000 delivered tokens (from /proc/<pid>/stat);
  - tokens/s delivered to the clients;
  - p99 added latency of routing: from the start of the scheduler's `scheduler.submit` span to the
    start of the worker's request span (the placement reached the worker), from the span files;
  - the client's p99 time to first token, for scale;
  - routing's added latency with the cores left headroom: after the run, `--paced-requests` more arrive
    as a Poisson process of `--paced-rate` a second (each on its own, not `--concurrency` at a time),
    and from their spans: the scheduler's decision (its `scheduler.submit` span's start to its `routed`
    event), the placement reaching the worker (to the start of the worker's request span), and the
    hop before it (the gateway's span's start to the scheduler's), p50 and p99; with the CPU the
    cluster and the bench used meanwhile ("cores busy", of the machine's), to show the headroom. The
    run's "route p99" above is measured with the cores saturated: it is mostly queueing for them;
  - with `--stall-ms MS`, the scheduler's event-loop stalls in the paced phase (services/common/loop_stalls.py):
    how many, the longest, and the longest garbage collection among them (off by default: the probe's
    own wake-ups cost the scheduler CPU);
  - where the scheduler's CPU per request goes: its event loop's thread against gRPC's own threads
    (the poller and the event engine's), and the context switches of all its threads, per request;
  - the gRPC stream messages the scheduler read and wrote per request over the run, by stream and
    direction (its /metrics: services/scheduler/message_counts.py), heartbeats apart from the rest.
Bounded: requests x (output tokens), each with a deadline; every process is stopped at the end.
  - the prefix hit rate: the run's routes with a prefix hit, from every replica's spans.
`--schedulers 1,2,4` runs each point with that many replicas (Redis only: they share the registry,
the prefix index and the load view through it); the scheduler CPU is every replica's together.

Run: `.venv/bin/python bench/control_plane.py --workers 10,50,100 [--index-blocks 10000,1000000]
[--stores embedded,redis] [--plot bench/results] [--json]`; takes `pip install -e .[bench]` for --plot.
`--from-json FILE...` draws the table and the curves of runs saved with --json (points run apart).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from services.common.loop_stalls import STALL_LOG_ENV, Stall  # noqa: E402
from services.common.spans import Attr, Event, SpanName, load_span_files  # noqa: E402
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from tests.redis_fixture import RedisServer  # noqa: E402
from tests.sim_cluster import SimCluster, SimSpec  # noqa: E402

WORKER_SPANS = (SpanName.COLOCATED, SpanName.PREFILL)  # where a placement lands
INDEX_BATCH = 2_000  # synthetic block hashes per ReportBlocks (a Redis pipeline well inside its 1 s timeout, loaded)
SHARED_PREFIX = 32  # tokens of the prompt a family of requests shares
FAMILIES = 16
REQUEST_TIMEOUT_S = 60.0
IDLE_S = 3.0  # seconds the scheduler's fixed cost (heartbeats, its watcher) is measured for, before the run
PACED_SEED = 12  # the paced requests' arrival gaps: the same in every run


@dataclass(frozen=True, slots=True)
class Point:
    workers: int
    index_blocks: int
    store: str  # "embedded" | "redis"
    schedulers: int = 1

    @property
    def name(self) -> str:
        return f"{self.store}-{self.index_blocks}-blocks-{self.workers}-workers-{self.schedulers}-schedulers"


@dataclass(slots=True)
class Result:
    workers: int
    index_blocks: int
    store: str
    schedulers: int
    requests: int
    failed: int
    failures: dict[str, int]  # gRPC status name -> requests that ended with it
    wall_s: float
    tokens: int
    decisions_per_s: float
    tokens_per_s: float
    scheduler_cpu_ms_per_1k_tokens: float
    gateway_cpu_ms_per_1k_tokens: float
    scheduler_cpu_ms_per_request: float
    scheduler_capacity_rps: float  # requests per second of scheduler CPU
    scheduler_idle_ms_per_s: float  # scheduler CPU per second with no requests (heartbeats, watcher)
    scheduler_marginal_ms_per_request: float  # the run's scheduler CPU less the idle rate, per request
    scheduler_saturated_rps: float  # (1 s - idle CPU per s) / marginal CPU per request: one core's routing rate
    sim_cpu_ms_per_1k_tokens: float
    routing_p50_ms: float
    routing_p99_ms: float
    ttft_p99_ms: float
    prefix_hit_rate: float  # the run's routes with a prefix hit (every route, whatever the replicas)
    routes_sampled: int
    index_fill_s: float
    loadavg_before: str
    loadavg_after: str
    # the run's scheduler CPU by thread, per request (whole, not marginal), and its threads' context switches
    scheduler_loop_ms_per_request: float = float("nan")  # the event loop's thread (the main one)
    scheduler_grpc_threads_ms_per_request: float = float("nan")  # every other thread: gRPC's poller, event engine
    scheduler_switches_per_request: float = float("nan")
    # gRPC stream messages the scheduler replicas read (in) and wrote (out) over the run, per request: the
    # request path's (every stream but the heartbeats), and each stream's ("assign in", ...; heartbeats too)
    scheduler_messages_in_per_request: float = float("nan")
    scheduler_messages_out_per_request: float = float("nan")
    scheduler_messages_per_request: dict[str, float] = field(default_factory=dict)
    # the paced requests (Poisson arrivals at paced_rate a second; 0: none), routing's added latency from their spans
    paced_rate: float = 0.0
    paced_requests: int = 0
    paced_failed: int = 0
    paced_decide_p50_ms: float = float("nan")  # scheduler.submit start -> its routed event
    paced_decide_p99_ms: float = float("nan")
    paced_route_p50_ms: float = float("nan")  # scheduler.submit start -> the worker's request span start
    paced_route_p99_ms: float = float("nan")
    paced_hop_p50_ms: float = float("nan")  # the gateway's span start -> scheduler.submit start
    paced_hop_p99_ms: float = float("nan")
    paced_assign_p50_ms: float = float("nan")  # the routed event -> the worker's request span start
    paced_assign_p99_ms: float = float("nan")
    paced_ttft_p50_ms: float = float("nan")
    paced_ttft_p99_ms: float = float("nan")
    paced_cores_busy: float = float("nan")  # CPU-s a second of the cluster and the bench over the paced phase
    paced_nice: int = 0  # the niceness the cluster's and the bench's threads had for the paced phase
    paced_sched_stalls: int = 0  # the scheduler replicas' event-loop stalls over --stall-ms in the paced phase
    paced_sched_stall_max_ms: float = float("nan")
    paced_sched_gc_max_ms: float = float("nan")  # the longest garbage collection within those stalls


def main() -> int:
    args = parse_args()
    if args.from_json:
        results = [Result(**r) for path in args.from_json for r in json.loads(path.read_text())["results"]]
        print(table(results))
        if args.plot:
            plot(results, args.plot)
        return 0
    if args.stall_ms > 0:
        os.environ[STALL_LOG_ENV] = f"{args.stall_ms:g}"  # the schedulers log their stalls (they inherit it)
    points = [Point(w, b, s, n) for s, b, w, n in itertools.product(args.stores, args.index_blocks, args.workers,
                                                                     args.schedulers)]
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs (shared with other work: see the load averages)",
          file=sys.stderr)
    results = []
    for point in points:
        print(f"point {point} ...", file=sys.stderr, flush=True)
        try:
            results.append(run_point(point, args))
        except ValueError as exc:  # a setting the harness cannot run (several schedulers without Redis)
            print(f"control_plane: {exc}", file=sys.stderr)
            return 2
        print(row(results[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"machine": cpu_model(), "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(table(results))
    if args.plot:
        plot(results, args.plot)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=_ints, default=[10, 50, 100], help="simulated workers per point")
    parser.add_argument("--index-blocks", type=_ints, default=[10_000], help="prefix-index blocks pre-filled")
    parser.add_argument("--stores", type=lambda t: t.split(","), default=["embedded"], help="embedded,redis")
    parser.add_argument("--schedulers", type=_ints, default=[1],
                        help="scheduler replicas, e.g. 1,2,4 (several need --stores redis: they share it)")
    parser.add_argument("--sim-processes", type=int, default=8,
                        help="processes the simulated workers share (a real worker has a process of its own: 50 to a "
                             "process made their shared loop the paced routed->worker tail)")
    parser.add_argument("--requests", type=int, default=600, help="requests per point")
    parser.add_argument("--concurrency", type=int, default=48, help="requests in flight at once")
    parser.add_argument("--paced-requests", type=int, default=200,
                        help="requests sent after the run at --paced-rate, for routing's added latency (0: none)")
    parser.add_argument("--paced-rate", type=float, default=20.0,
                        help="the paced requests' mean arrival rate a second (Poisson), low enough to leave the "
                             "cores headroom")
    parser.add_argument("--paced-nice", type=int, default=0,
                        help="the niceness every thread of the cluster and the bench takes for the paced phase "
                             "(e.g. -10, as root: other work on a shared machine then queues behind them)")
    parser.add_argument("--stall-ms", type=float, default=0.0,
                        help="the schedulers log their event-loop stalls longer than this (e.g. 2); the paced "
                             "phase's are counted. 0 (default): off, since the probe wakes each scheduler 200 "
                             "times a second through the whole run, which adds to its idle and per-request CPU")
    parser.add_argument("--idle-s", type=float, default=IDLE_S,
                        help="seconds the scheduler's fixed cost is measured for before the run")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens (the first 32 shared by a family)")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--step-ms", type=float, default=10.0, help="a simulated iteration's time")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per simulated worker")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="write PNG curves into DIR")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep each point's logs and span files in DIR/POINT (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                        help="run nothing: the table (and --plot) of the results earlier --json runs saved")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="py-spy the scheduler replicas through each point's measured run: collapsed stacks "
                             "(one per line, then its sample count) into DIR/POINT-REPLICA.txt")
    parser.add_argument("--profile-rate", type=int, default=100,
                        help="py-spy's samples a second for --profile (py-spy's default 100 leaves a few hundred "
                             "samples a run; 400 resolves a 5%% share)")
    args = parser.parse_args()
    for store in args.stores:
        if store not in ("embedded", "redis"):
            parser.error(f"--stores: {store!r} is neither embedded nor redis")
    if args.input_len <= SHARED_PREFIX:
        parser.error(f"--input-len must exceed the {SHARED_PREFIX} shared prefix tokens")
    return args


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


# -- one point --------------------------------------------------------------------------------

def run_point(point: Point, args: argparse.Namespace) -> Result:
    with tempfile.TemporaryDirectory(prefix="tandem-cp-") as tmp:
        run_dir = args.keep / point.name if args.keep else Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)  # Redis writes its log there first
        redis = RedisServer(run_dir) if point.store == "redis" else None
        if redis is not None:
            redis.start()
        try:
            cluster = SimCluster.start(run_dir, sim_specs(point.workers, args), schedulers=point.schedulers,
                                       redis_url=redis.url if redis else None,
                                       scheduler_flags=("--max-queue", "4096", "--max-running", "256"),
                                       metrics=True)
            try:
                return measure(cluster, point, args)
            finally:
                cluster.stop()
        finally:
            if redis is not None:
                redis.stop()


def sim_specs(workers: int, args: argparse.Namespace) -> list[SimSpec]:
    processes = max(1, min(args.sim_processes, workers))
    counts = [workers // processes + (1 if i < workers % processes else 0) for i in range(processes)]
    return [SimSpec(count=n, step_ms=args.step_ms, kv_blocks=args.kv_blocks) for n in counts]


def measure(cluster: SimCluster, point: Point, args: argparse.Namespace) -> Result:
    started = time.monotonic()
    fill_index(cluster, point.index_blocks)
    index_fill_s = time.monotonic() - started
    asyncio.run(drive(cluster.gateway, "warmup", min(32, args.requests), args))
    pids = {"gateway": cluster.pid("gateway")}
    replicas = [name for name in cluster.children if name.startswith("scheduler")]
    pids.update({name: cluster.pid(name) for name in replicas})
    sims = [name for name in cluster.children if name.startswith("sim-")]
    pids.update({name: cluster.pid(name) for name in sims})
    idle_rate = idle_cpu_rate([pids[name] for name in replicas], args.idle_s)
    before, load_before = {name: cpu_seconds(pid) for name, pid in pids.items()}, loadavg()
    threads_before = [thread_use(pids[name]) for name in replicas]
    messages_before = stream_messages(cluster.scheduler_metrics)
    with profiling(args.profile, point, {name: pids[name] for name in replicas}, args.profile_rate):
        t0 = time.monotonic()
        outcome = asyncio.run(drive(cluster.gateway, "run", args.requests, args))
        wall = time.monotonic() - t0
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    threads = [after - start for name, start in zip(replicas, threads_before) for after in [thread_use(pids[name])]]
    messages = stream_messages(cluster.scheduler_metrics) - messages_before
    used["scheduler"] = sum(used[name] for name in replicas)  # every replica's
    paced = run_paced(cluster, pids, args)
    hits, routed = prefix_hits(cluster.run_dir, set(outcome.request_ids))
    routing = route_hops_ms(cluster.run_dir, set(outcome.request_ids)).route
    tokens = max(outcome.tokens, 1)
    ok = args.requests - sum(outcome.failures.values())
    marginal_s = max(used["scheduler"] - idle_rate * wall, 0.0) / max(ok, 1)
    return Result(
        workers=point.workers, index_blocks=point.index_blocks, store=point.store, schedulers=point.schedulers,
        requests=args.requests, failed=args.requests - ok, failures=dict(outcome.failures), wall_s=round(wall, 2),
        tokens=outcome.tokens,
        decisions_per_s=round(ok / wall, 1),
        tokens_per_s=round(outcome.tokens / wall, 1),
        scheduler_cpu_ms_per_1k_tokens=round(used["scheduler"] * 1e6 / tokens, 1),
        gateway_cpu_ms_per_1k_tokens=round(used["gateway"] * 1e6 / tokens, 1),
        scheduler_cpu_ms_per_request=round(used["scheduler"] * 1e3 / max(ok, 1), 2),
        scheduler_capacity_rps=round(ok / used["scheduler"], 1) if used["scheduler"] else 0.0,
        scheduler_idle_ms_per_s=round(idle_rate * 1e3, 1),
        scheduler_marginal_ms_per_request=round(marginal_s * 1e3, 3),
        scheduler_saturated_rps=round((1 - idle_rate) / marginal_s, 1) if marginal_s else 0.0,
        sim_cpu_ms_per_1k_tokens=round(sum(used[name] for name in sims) * 1e6 / tokens, 1),
        routing_p50_ms=round(percentile(routing, 0.50), 2),
        routing_p99_ms=round(percentile(routing, 0.99), 2),
        ttft_p99_ms=round(percentile(outcome.ttfts_ms, 0.99), 2),
        prefix_hit_rate=round(hits / routed, 3) if routed else float("nan"),
        routes_sampled=routed,
        index_fill_s=round(index_fill_s, 1),
        loadavg_before=load_before, loadavg_after=loadavg(),
        scheduler_loop_ms_per_request=round(sum(t.loop_s for t in threads) * 1e3 / max(ok, 1), 3),
        scheduler_grpc_threads_ms_per_request=round(sum(t.others_s for t in threads) * 1e3 / max(ok, 1), 3),
        scheduler_switches_per_request=round(sum(t.switches for t in threads) / max(ok, 1), 1),
        **messages_per_request(messages, max(ok, 1)),
        **paced,
    )


def stream_messages(addresses: list[str]) -> Counter[str]:
    """The gRPC stream messages the schedulers serving /metrics at `addresses` counted so far, all
    together: "STREAM DIRECTION" -> messages (services/scheduler/message_counts.py)."""
    counts: Counter[str] = Counter()
    for address in addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == _MESSAGES_FAMILY:
                for sample in family.samples:
                    counts[f"{sample.labels['stream']} {sample.labels['direction']}"] += round(sample.value)
    return counts


_MESSAGES_FAMILY = "tandem:scheduler_stream_messages"  # its samples: tandem:scheduler_stream_messages_total


def messages_per_request(messages: Counter[str], requests: int) -> dict[str, object]:
    """The Result's message figures: the request path's in and out (heartbeats apart), and each stream's."""
    path = {key: n for key, n in messages.items() if not key.startswith("heartbeats ")}
    return dict(
        scheduler_messages_in_per_request=round(sum(n for k, n in path.items() if k.endswith(" in")) / requests, 2),
        scheduler_messages_out_per_request=round(sum(n for k, n in path.items() if k.endswith(" out")) / requests, 2),
        scheduler_messages_per_request={key: round(n / requests, 3) for key, n in sorted(messages.items())})


def idle_cpu_rate(pids: list[int], seconds: float) -> float:
    """CPU seconds per second that these processes (the scheduler replicas) spend over `seconds` with no
    requests in flight: the heartbeats and the watcher, their fixed cost."""
    before, started = sum(cpu_seconds(pid) for pid in pids), time.monotonic()
    time.sleep(seconds)
    return (sum(cpu_seconds(pid) for pid in pids) - before) / (time.monotonic() - started)


@contextmanager
def profiling(directory: Path | None, point: Point, pids: dict[str, int], rate: int = 100) -> Iterator[None]:
    """py-spy each process in `pids` at `rate` samples a second while the block runs (nothing without a directory)."""
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    spies = [subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--format",
                               "raw", "--nonblocking", "--rate", str(rate),
                               "--output", str(directory / f"{point.name}-{child}.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for child, pid in pids.items()]
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for spy in spies:
            spy.wait(timeout=60)


def run_paced(cluster: SimCluster, pids: dict[str, int], args: argparse.Namespace) -> dict[str, float]:
    """The paced phase: its requests, then routing's added latency from their spans (Result's paced_* fields)."""
    if args.paced_requests <= 0 or args.paced_rate <= 0:
        return {}
    before, own_before, started = {n: cpu_seconds(p) for n, p in pids.items()}, _own_cpu_seconds(), time.monotonic()
    started_at = time.time()
    with niceness([*pids.values(), os.getpid()], args.paced_nice):
        outcome = asyncio.run(drive_paced(cluster.gateway, args.paced_requests, args.paced_rate, args))
    wall = time.monotonic() - started
    stalls = scheduler_stalls(cluster.run_dir, started_at, time.time())
    collections = [c.ms for stall in stalls for c in stall.collections]
    used = sum(cpu_seconds(p) - before[n] for n, p in pids.items()) + _own_cpu_seconds() - own_before
    hops = route_hops_ms(cluster.run_dir, set(outcome.request_ids))
    ms = lambda values, q: round(percentile(values, q), 2)  # noqa: E731
    return {"paced_rate": args.paced_rate, "paced_requests": args.paced_requests,
            "paced_failed": sum(outcome.failures.values()),
            "paced_decide_p50_ms": ms(hops.decide, 0.5), "paced_decide_p99_ms": ms(hops.decide, 0.99),
            "paced_route_p50_ms": ms(hops.route, 0.5), "paced_route_p99_ms": ms(hops.route, 0.99),
            "paced_hop_p50_ms": ms(hops.hop, 0.5), "paced_hop_p99_ms": ms(hops.hop, 0.99),
            "paced_assign_p50_ms": ms(hops.assign, 0.5), "paced_assign_p99_ms": ms(hops.assign, 0.99),
            "paced_ttft_p50_ms": ms(outcome.ttfts_ms, 0.5), "paced_ttft_p99_ms": ms(outcome.ttfts_ms, 0.99),
            "paced_cores_busy": round(used / wall, 2), "paced_nice": args.paced_nice,
            "paced_sched_stalls": len(stalls),
            "paced_sched_stall_max_ms": max((s.late_ms for s in stalls), default=float("nan")),
            "paced_sched_gc_max_ms": max(collections, default=float("nan"))}


def scheduler_stalls(run_dir: Path, start: float, end: float) -> list[Stall]:
    """The stalls the scheduler replicas logged (each line's time, local, to the ms) between two time.time()s."""
    stalls = []
    for log in run_dir.glob("scheduler*.log"):
        for line in log.read_text().splitlines():
            stall = Stall.parse(line)
            if stall is None:
                continue
            at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if start <= at <= end:
                stalls.append(stall)
    return stalls


@contextmanager
def niceness(pids: list[int], nice: int) -> Iterator[None]:
    """Every thread of these processes, and their autogroups, at `nice` while the block runs, then back
    (Linux). With autogroup scheduling on, each session's processes share the cores as one group (every
    child of the cluster is a session of its own), so a thread's nice weighs it only against its own
    process's threads: the group's nice (/proc/PID/autogroup) is what puts the cluster ahead of others' work."""
    if nice == 0:
        yield
        return
    tids = [int(task.name) for pid in pids for task in Path(f"/proc/{pid}/task").iterdir()]
    kept = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}
    groups = {pid: group_nice for pid in pids if (group_nice := _autogroup_nice(pid)) is not None}
    for tid in tids:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    for pid in groups:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    try:
        yield
    finally:
        for pid, value in groups.items():
            with suppress(OSError):  # the process ended meanwhile
                Path(f"/proc/{pid}/autogroup").write_text(str(value))
        for tid, value in kept.items():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, value)
            except ProcessLookupError:  # the thread ended meanwhile
                pass


def _autogroup_nice(pid: int) -> int | None:
    """The nice of the process's autogroup ("/autogroup-N nice X"); None without autogroup scheduling."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _own_cpu_seconds() -> float:
    """This bench process's CPU so far (it drives the load, on the same cores)."""
    times = os.times()
    return times.user + times.system


@dataclass(slots=True)
class RouteHops:
    """Per request, in ms: hop (the gateway's span start to scheduler.submit start), decide (to the
    scheduler's routed event), route (to the start of the worker's request span), assign (from the
    routed event to the worker's span: the placement's way to the worker)."""

    hop: list[float] = field(default_factory=list)
    decide: list[float] = field(default_factory=list)
    route: list[float] = field(default_factory=list)
    assign: list[float] = field(default_factory=list)


def route_hops_ms(run_dir: Path, request_ids: set[str]) -> RouteHops:
    """From the span files: every process's span starts, and the scheduler's finished spans' routed events
    (the run's "route p99" reads `route`, the paced phase all four). A request routed more than once
    (moved after a worker was lost) counts its first decision."""
    loaded = load_span_files(run_dir)
    gateway: dict[str, int] = {}
    submitted: dict[str, int] = {}
    placed: dict[str, int] = {}
    for span in loaded.started:
        request_id = span.request_id
        if request_id not in request_ids:
            continue
        if span.name == SpanName.SCHEDULER_SUBMIT:
            submitted[request_id] = min(span.start_ns, submitted.get(request_id, span.start_ns))
        elif span.name in WORKER_SPANS:
            placed[request_id] = min(span.start_ns, placed.get(request_id, span.start_ns))
        elif span.service == "gateway":
            gateway[request_id] = min(span.start_ns, gateway.get(request_id, span.start_ns))
    hops = RouteHops()
    for span in loaded.spans:
        if span.name != SpanName.SCHEDULER_SUBMIT or span.request_id not in request_ids:
            continue
        routed = [event.time_ns for event in span.events if event.name == Event.ROUTED]
        if routed:
            hops.decide.append((min(routed) - span.start_ns) / 1e6)
            if span.request_id in placed:
                hops.assign.append((placed[span.request_id] - min(routed)) / 1e6)
    hops.route = [(placed[r] - submitted[r]) / 1e6 for r in submitted if r in placed]
    hops.hop = [(submitted[r] - gateway[r]) / 1e6 for r in submitted if r in gateway]
    return hops


def prefix_hits(run_dir: Path, request_ids: set[str]) -> tuple[int, int]:
    """(routes with a prefix hit, routes) of the run's requests, from every replica's scheduler.submit
    spans (the chosen prefill worker's cached blocks among the route's scores): every route of the
    run, whatever the number of replicas. (A replica's Stats keep only its last RECENT_ROUTES routes:
    one replica's held the run's last 256, four replicas' all of it.)"""
    hits = routed = 0
    for span in load_span_files(run_dir).spans:
        chosen = span.attributes.get(Attr.ROUTE_PREFILL_WORKER)
        if span.name != SpanName.SCHEDULER_SUBMIT or chosen is None or span.request_id not in request_ids:
            continue
        scores = json.loads(span.attributes.get(Attr.ROUTE_SCORES, "{}"))
        routed += 1
        hits += scores.get(chosen, {}).get("cached_blocks", 0) > 0
    return hits, routed


def fill_index(cluster: SimCluster, blocks: int) -> None:
    """`blocks` synthetic hashes (never a prompt's) spread over the workers, as their block events would."""
    worker_ids = sorted(cluster.workers)
    with grpc.insecure_channel(cluster.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        for n, start in enumerate(range(0, blocks, INDEX_BATCH)):
            stored = [f"{i:032x}" for i in range(start, min(blocks, start + INDEX_BATCH))]
            request = scheduler_pb2.ReportBlocksRequest(worker_id=worker_ids[n % len(worker_ids)], stored=stored)
            stub.ReportBlocks(request, timeout=120, metadata=cluster.metadata)
    if cluster.scheduler_stats().degraded:
        raise RuntimeError("the scheduler lost its store while the index filled (see scheduler.log in the run "
                           "directory); the figures would be without prefix routing")


# -- the load ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Outcome:
    request_ids: list[str]
    tokens: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    ttfts_ms: list[float] = field(default_factory=list)


async def drive(gateway: str, tag: str, count: int, args: argparse.Namespace) -> Outcome:
    """`count` requests, `--concurrency` at a time, each with its own deadline."""
    outcome = Outcome([f"cp-{tag}-{os.getpid()}-{i}" for i in range(count)])
    pending: Iterator[int] = iter(range(count))
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GenerateServiceStub(channel)

        async def client() -> None:
            for i in pending:
                await one_request(stub, outcome, i, args)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return outcome


async def drive_paced(gateway: str, count: int, rate: float, args: argparse.Namespace) -> Outcome:
    """`count` requests arriving as a Poisson process of `rate` a second (the same gaps every run),
    each sent at its arrival whatever is in flight."""
    outcome = Outcome([f"cp-paced-{os.getpid()}-{i}" for i in range(count)])
    gaps = random.Random(PACED_SEED)
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GenerateServiceStub(channel)
        sent: list[asyncio.Task] = []
        arrival = time.monotonic()
        for i in range(count):
            arrival += gaps.expovariate(rate)
            await asyncio.sleep(max(0.0, arrival - time.monotonic()))
            sent.append(asyncio.create_task(one_request(stub, outcome, i, args)))
        await asyncio.gather(*sent)
    return outcome


async def one_request(stub: gateway_pb2_grpc.GenerateServiceStub, outcome: Outcome, i: int,
                      args: argparse.Namespace) -> None:
    request = gateway_pb2.GenerateRequest(
        token_ids=prompt(i, args.input_len), request_id=outcome.request_ids[i],
        sampling=common_pb2.SamplingParams(max_tokens=args.output_len, temperature=0.0))
    started = time.monotonic()
    first = None
    try:
        async for message in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if first is None and message.token_ids:
                first = time.monotonic() - started
            outcome.tokens += len(message.token_ids)
    except grpc.aio.AioRpcError as error:
        outcome.failures[error.code().name] += 1
        return
    if first is not None:
        outcome.ttfts_ms.append(first * 1000)


def prompt(i: int, length: int) -> list[int]:
    """A family's shared prefix (so routing finds prefix hits), then tokens of this request alone."""
    family = i % FAMILIES
    shared = [1000 + family * 97 + j for j in range(SHARED_PREFIX)]
    return shared + [(i * 7919 + j * 131) % 40000 + 200 for j in range(length - SHARED_PREFIX)]


# -- what is measured -------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ThreadUse:
    """A process's CPU seconds in its main thread (an asyncio service's event loop) and in its other
    threads, and its threads' context switches (voluntary and not), so far. A thread that ended is
    no longer counted: take both readings while the process runs steadily."""

    loop_s: float
    others_s: float
    switches: int

    def __sub__(self, other: ThreadUse) -> ThreadUse:
        return ThreadUse(self.loop_s - other.loop_s, self.others_s - other.others_s, self.switches - other.switches)


def thread_use(pid: int) -> ThreadUse:
    """From /proc/<pid>/task/<tid>/stat (utime, stime) and status (ctxt_switches)."""
    loop_s = others_s = 0.0
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rpartition(")")[2].split()
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if task.name == str(pid):
            loop_s += seconds
        else:
            others_s += seconds
        switches += sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    return ThreadUse(loop_s, others_s, switches)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


# -- output -----------------------------------------------------------------------------------

COLUMNS = (("workers", "workers"), ("store", "store"), ("index_blocks", "index blocks"), ("schedulers", "schedulers"),
           ("decisions_per_s", "routed/s"), ("scheduler_capacity_rps", "sched cap/s"),
           ("scheduler_idle_ms_per_s", "sched idle ms/s"), ("scheduler_marginal_ms_per_request", "sched ms/req marginal"),
           ("scheduler_saturated_rps", "sched saturated req/s"),
           ("scheduler_loop_ms_per_request", "sched loop ms/req"),
           ("scheduler_grpc_threads_ms_per_request", "sched gRPC threads ms/req"),
           ("scheduler_switches_per_request", "sched switches/req"),
           ("scheduler_messages_in_per_request", "sched msgs in/req"),
           ("scheduler_messages_out_per_request", "sched msgs out/req"),
           ("tokens_per_s", "tokens/s"), ("scheduler_cpu_ms_per_1k_tokens", "sched ms/1k tok"),
           ("gateway_cpu_ms_per_1k_tokens", "gw ms/1k tok"), ("routing_p99_ms", "route p99 ms"),
           ("ttft_p99_ms", "TTFT p99 ms"), ("prefix_hit_rate", "prefix hits"), ("failed", "failed"),
           ("paced_rate", "paced req/s"), ("paced_nice", "paced nice"), ("paced_cores_busy", "paced cores busy"),
           ("paced_hop_p50_ms", "paced gw->sched p50 ms"), ("paced_hop_p99_ms", "paced gw->sched p99 ms"),
           ("paced_decide_p50_ms", "paced decide p50 ms"), ("paced_decide_p99_ms", "paced decide p99 ms"),
           ("paced_assign_p50_ms", "paced routed->worker p50 ms"),
           ("paced_assign_p99_ms", "paced routed->worker p99 ms"),
           ("paced_route_p50_ms", "paced route p50 ms"), ("paced_route_p99_ms", "paced route p99 ms"),
           ("paced_ttft_p99_ms", "paced TTFT p99 ms"), ("paced_failed", "paced failed"),
           ("paced_sched_stalls", "paced sched stalls"), ("paced_sched_stall_max_ms", "paced sched stall max ms"),
           ("paced_sched_gc_max_ms", "paced sched gc max ms"),
           ("loadavg_after", "loadavg"))


def row(result: Result) -> str:
    values = asdict(result)
    return " | ".join(str(values[key]) for key, _ in COLUMNS)


def table(results: list[Result]) -> str:
    header = " | ".join(title for _, title in COLUMNS)
    rule = "|".join("---" for _ in COLUMNS)
    return "\n".join([f"| {header} |", f"|{rule}|", *(f"| {row(r)} |" for r in results)])


def plot(results: list[Result], directory: Path) -> None:
    """PNG curves of each measure against workers (a line per store and index size) and, when the
    index size varies, against it (a line per store and worker count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    measures = {"decisions_per_s": "routing decisions/s", "scheduler_capacity_rps": "requests per scheduler CPU-s",
                "scheduler_saturated_rps": "requests/s one saturated scheduler core routes",
                "scheduler_cpu_ms_per_1k_tokens": "scheduler CPU ms per 1k tokens",
                "gateway_cpu_ms_per_1k_tokens": "gateway CPU ms per 1k tokens",
                "tokens_per_s": "tokens/s to clients", "routing_p99_ms": "p99 routing latency (ms)"}
    axes_of = {"workers": ("index_blocks", "simulated workers", "{:,} blocks"),
               "index_blocks": ("workers", "prefix-index blocks", "{} workers")}
    for x, (other, x_label, line_label) in axes_of.items():
        if len({getattr(r, x) for r in results}) < 2:
            continue
        for key, label in measures.items():
            figure, axes = plt.subplots(figsize=(6, 4))
            ordered = sorted(results, key=lambda r: (r.store, getattr(r, other), getattr(r, x)))
            for (store, value), group in itertools.groupby(ordered, key=lambda r: (r.store, getattr(r, other))):
                group = list(group)
                axes.plot([getattr(r, x) for r in group], [getattr(r, key) for r in group], marker="o",
                          label=f"{store}, {line_label.format(value)}")
            if x == "index_blocks":
                axes.set_xscale("log")
            axes.set_xlabel(x_label)
            axes.set_ylabel(label)
            axes.set_title(f"{label} ({cpu_model()})", fontsize=8)
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize=7)
            figure.tight_layout()
            figure.savefig(directory / f"control_plane_{key}_by_{x}.png", dpi=100)
            plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
