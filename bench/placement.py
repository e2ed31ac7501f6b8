"""Placement benchmark: cost against latency placement on the same Zipf-skewed traffic over M models.

The scheduler's own placement rules (services/scheduler/model_placement.py: which workers serve a
model, holders first, the bin-packing choice of a loader, cost placement's copies and drops) pick the
worker of every request, and each simulated worker holds its models with the workers' own residency
code (services/worker/residency.py: LRU eviction of idle unpinned models under a memory budget, one
load per model at a time). Workers are simulated in one process: a load takes --load-ms (measure it
for your model and disk), a request takes a free slot (--max-seqs per worker), its first token comes
--prefill-ms after its model is resident and it has a slot, then one token every --step-ms.

Latency placement provisions before traffic, as ProvisionModel does: the most popular models first,
--replicas copies each, pinned, by the bin-packing rule, while they fit; a request for any other model
is refused (FAILED_PRECONDITION). Cost placement starts empty, loads on demand, and rebalances every
--rebalance-ms. Per skew and policy it reports the cold-start rate (requests that waited for a load),
refused requests (unprovisioned, or no worker could load the model within 30 s), p50/p99 time to first token, tokens/s delivered, and worker-memory-seconds (weight
GiB resident, integrated over the run: the cost).

Run: `.venv/bin/python bench/placement.py [--models 6 --workers 2] [--skews 0,0.6,1.2] [--json]
[--plot bench/results]`; `--models 1000 --workers 100 --rate 200` for the run at scale. `--real` runs
the same traffic through real processes instead (bench/placement_real.py): `--real --requests 60
--rate 1 --output-tokens 8 --per-worker 3`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.control_plane import cpu_model, loadavg  # noqa: E402
from services.common.errors import FailedPrecondition  # noqa: E402
from services.common.store import ModelResidency, ModelState, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole  # noqa: E402
from services.scheduler.model_placement import (  # noqa: E402
    ActionKind, ModelPlacement, ReplicaRule, holding, loader_order, prefer_holders, rebalance, serving,
)
from services.worker.residency import ModelMemoryExhausted, ResidentModels  # noqa: E402

GIB = 1 << 30
SAMPLE_S = 0.05  # how often resident memory is sampled for memory-seconds
QUEUE_S = 30.0  # how long a request may wait for a worker that can load its model


@dataclass(frozen=True, slots=True)
class Setup:
    models: int
    workers: int
    requests: int
    rate: float
    model_gib: float
    memory_gib: float
    max_seqs: int
    load_ms: float
    prefill_ms: float
    step_ms: float
    output_tokens: int
    replicas: int
    rebalance_ms: float
    replicate_active: int
    drop_idle_ms: int
    seed: int


@dataclass(slots=True)
class Result:
    policy: str
    skew: float
    models: int
    workers: int
    requests: int
    served: int
    refused: int
    cold_start_pct: float
    loads: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    memory_gib_s: float
    wall_s: float
    loadavg: str


class SimWorker:
    """A worker with a catalogue of every model, `max_seqs` slots and a weight budget."""

    def __init__(self, worker_id: str, setup: Setup, names: list[str]) -> None:
        self.worker_id = worker_id
        self.setup = setup
        self.names = tuple(names)
        self.slots = asyncio.Semaphore(setup.max_seqs)
        self.running = 0
        self.waiting = 0
        self.loads = 0
        size = round(setup.model_gib * GIB)
        self.models: ResidentModels[str] = ResidentModels({n: size for n in names}, round(setup.memory_gib * GIB),
                                                          self._load, self._unload, lambda name: 0)

    async def _load(self, name: str, evicted: tuple[str, ...]) -> str:
        self.loads += 1
        await asyncio.sleep(self.setup.load_ms / 1000)
        return name

    async def _unload(self, name: str, model: str) -> None:
        return None

    def record(self) -> WorkerRecord:
        info = WorkerInfo(worker_id=self.worker_id, role=WorkerRole.COLOCATED, address="sim:0", model=self.names[0],
                          num_blocks=1, block_size=16, catalogue=self.names,
                          model_memory_bytes=round(self.setup.memory_gib * GIB))
        models = tuple(ModelResidency(m.name, ModelState.LOADING if m.state == 1 else ModelState.RESIDENT, m.pinned,
                                      m.weight_bytes, m.active_requests, m.idle_ms) for m in self.models.records())
        return WorkerRecord(info, WorkerLoad(running=self.running, waiting=self.waiting, models=models,
                                             free_model_memory_bytes=self.models.free_bytes))

    @property
    def resident_bytes(self) -> int:
        return self.models.budget - self.models.free_bytes

    async def serve(self, model: str, arrival: float) -> tuple[float, bool]:
        """(time to first token in s since `arrival`, whether it waited for a load); ModelMemoryExhausted
        when it cannot load the model now (every model there busy or pinned)."""
        cold = self.models.resident(model) is None
        self.waiting += 1
        try:
            async with self.models.lease(model):
                async with self.slots:
                    self.waiting -= 1
                    self.running += 1
                    await asyncio.sleep(self.setup.prefill_ms / 1000)
                    ttft = time.monotonic() - arrival
                    await asyncio.sleep(self.setup.step_ms * (self.setup.output_tokens - 1) / 1000)
                    self.running -= 1
        except ModelMemoryExhausted:
            self.waiting -= 1
            raise
        return ttft, cold


class Cluster:
    def __init__(self, setup: Setup, policy: ModelPlacement) -> None:
        self.setup = setup
        self.policy = policy
        self.names = [f"m{i:04d}" for i in range(setup.models)]
        self.workers = {f"w{i:03d}": SimWorker(f"w{i:03d}", setup, self.names) for i in range(setup.workers)}
        self.ttfts: list[float] = []
        self.cold = 0
        self.refused = 0

    def records(self) -> dict[str, WorkerRecord]:
        return {w: worker.record() for w, worker in self.workers.items()}

    async def provision(self, popularity: list[float]) -> None:
        """Latency placement: the most popular models first, `replicas` pinned copies each, while they fit."""
        for index in sorted(range(len(self.names)), key=lambda i: -popularity[i]):
            model = self.names[index]
            placed = 0
            for record in loader_order(self.records().values()):
                if placed == self.setup.replicas:
                    break
                if record.load.free_model_memory_bytes < round(self.setup.model_gib * GIB):
                    continue
                await self.workers[record.info.worker_id].models.load(model, pin=True)
                placed += 1
            if placed == 0:
                return

    async def request(self, model: str) -> None:
        """Routed as the scheduler routes it; while no worker can load its model (every model busy or
        pinned), it waits a step and is routed again, as in the scheduler's queue, up to QUEUE_S."""
        arrival = time.monotonic()
        while time.monotonic() - arrival < QUEUE_S:
            records = self.records()
            try:
                able = serving(list(records.values()), model, self.policy)
            except FailedPrecondition:
                break
            ranked = [r.info.worker_id for r in sorted(able, key=lambda r: (r.load.running + r.load.waiting,
                                                                             r.info.worker_id))]
            room = [w for w in ranked if records[w].load.running + records[w].load.waiting < self.setup.max_seqs]
            for worker_id in prefer_holders(ranked, records, model, room, self.policy):
                try:
                    ttft, cold = await self.workers[worker_id].serve(model, arrival)
                except ModelMemoryExhausted:
                    continue
                self.ttfts.append(ttft)
                self.cold += cold
                return
            await asyncio.sleep(self.setup.step_ms / 1000)
        self.refused += 1

    async def keep_balanced(self) -> None:
        rule = ReplicaRule(hot_active=self.setup.replicate_active, cold_idle_ms=self.setup.drop_idle_ms)
        while True:
            await asyncio.sleep(self.setup.rebalance_ms / 1000)
            for action in rebalance(list(self.records().values()), rule):
                models = self.workers[action.worker_id].models
                if action.kind is ActionKind.UNLOAD:
                    await models.unload(action.model)
                else:
                    asyncio.ensure_future(_load_quietly(models, action.model))


async def _load_quietly(models: ResidentModels[str], model: str) -> None:
    try:
        await models.load(model)
    except ModelMemoryExhausted:
        pass  # every model there is busy: the next round tries again


def zipf(models: int, skew: float) -> list[float]:
    weights = [1 / (rank + 1) ** skew for rank in range(models)]
    total = sum(weights)
    return [w / total for w in weights]


async def run(setup: Setup, policy: ModelPlacement, skew: float) -> Result:
    rng = random.Random(setup.seed)
    popularity = zipf(setup.models, skew)
    cluster = Cluster(setup, policy)
    if policy is ModelPlacement.LATENCY:
        await cluster.provision(popularity)
    loads_before = sum(w.loads for w in cluster.workers.values())
    memory = [0.0]
    sampler = asyncio.ensure_future(_sample_memory(cluster, memory))
    balancer = asyncio.ensure_future(cluster.keep_balanced()) if policy is ModelPlacement.COST else None
    start = time.monotonic()
    requests = []
    for _ in range(setup.requests):
        model = cluster.names[rng.choices(range(setup.models), weights=popularity)[0]]
        requests.append(asyncio.ensure_future(cluster.request(model)))
        await asyncio.sleep(rng.expovariate(setup.rate))
    await asyncio.gather(*requests)
    wall = time.monotonic() - start
    for task in (sampler, balancer):
        if task is not None:
            task.cancel()
    served = len(cluster.ttfts)
    p50, p99 = ttft_ms(cluster.ttfts)
    return Result(policy=str(policy), skew=skew, models=setup.models, workers=setup.workers, requests=setup.requests,
                  served=served, refused=cluster.refused, cold_start_pct=round(100 * cluster.cold / setup.requests, 1),
                  loads=sum(w.loads for w in cluster.workers.values()) - loads_before, ttft_p50_ms=p50, ttft_p99_ms=p99,
                  tokens_per_s=round(served * setup.output_tokens / wall, 1),
                  memory_gib_s=round(memory[0] / GIB, 1), wall_s=round(wall, 1), loadavg=loadavg())


def ttft_ms(seconds: list[float]) -> tuple[float, float]:
    """(p50, p99) of the served requests' times to first token, in ms (0 when none was served)."""
    ttfts = sorted(seconds) or [0.0]
    return (round(1000 * statistics.median(ttfts), 1),
            round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1))


async def _sample_memory(cluster: Cluster, total: list[float]) -> None:
    """Weight bytes resident on every worker, integrated over time (memory[0], byte-seconds); a
    provisioned (latency) run counts its pinned models from the first request on."""
    while True:
        total[0] += sum(w.resident_bytes for w in cluster.workers.values()) * SAMPLE_S
        await asyncio.sleep(SAMPLE_S)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=30.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--skews", default="0,0.6,1.2", help="Zipf exponents of model popularity")
    parser.add_argument("--policies", default="cost,latency")
    parser.add_argument("--model-gib", type=float, default=0.54, help="weights of one model (SmolLM2-135M, fp32)")
    parser.add_argument("--memory-gib", type=float, default=1.1, help="--model-memory of each worker")
    parser.add_argument("--max-seqs", type=int, default=8, help="requests a worker runs at once")
    parser.add_argument("--load-ms", type=float, default=400.0, help="one model's load time (a cold start)")
    parser.add_argument("--prefill-ms", type=float, default=20.0)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=1, help="latency placement: copies provisioned per model")
    parser.add_argument("--rebalance-ms", type=float, default=500.0, help="cost placement: rebalancing period")
    parser.add_argument("--replicate-active", type=int, default=8)
    parser.add_argument("--drop-idle-ms", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--real", action="store_true",
                        help="real processes (tandem up, colocated workers, the default model under --models names) "
                             "instead of simulated workers: --models, --workers, --requests, --rate, --output-tokens, "
                             "--replicas, --per-worker and --seed apply")
    parser.add_argument("--per-worker", type=int, default=3, help="--real: models' weights of each worker's memory")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--plot", type=Path, default=None, help="write PNG bars of each measure into this folder")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    results = run_real_all(args) if args.real else run_simulated_all(args)
    if args.json:
        print(json.dumps({"machine": cpu_model(), "real": args.real, "args": vars(args) | {"plot": str(args.plot)},
                          "results": [asdict(r) for r in results]}, indent=2))
    else:
        print_table(results, "real colocated" if args.real else "simulated")
    if args.plot is not None:
        plot(results, args.plot, "real_" if args.real else "")
    return 0


def run_real_all(args: argparse.Namespace) -> list[Result]:
    from bench.placement_real import RealSetup, run_real

    setup = RealSetup(args.models, args.workers, args.per_worker, args.requests, args.rate, args.output_tokens,
                      args.replicas, args.seed)
    return [run_real(setup, ModelPlacement(policy), float(skew))
            for skew in args.skews.split(",") for policy in args.policies.split(",")]


def run_simulated_all(args: argparse.Namespace) -> list[Result]:
    setup = Setup(args.models, args.workers, args.requests, args.rate, args.model_gib, args.memory_gib, args.max_seqs,
                  args.load_ms, args.prefill_ms, args.step_ms, args.output_tokens, args.replicas, args.rebalance_ms,
                  args.replicate_active, args.drop_idle_ms, args.seed)
    return [asyncio.run(run(setup, ModelPlacement(policy), float(skew)))
            for skew in args.skews.split(",") for policy in args.policies.split(",")]


def print_table(results: list[Result], kind: str) -> None:
    print(f"# {cpu_model()}; {results[0].models} models on {results[0].workers} {kind} workers")
    print("| policy | skew | cold starts | refused | loads | TTFT p50 ms | TTFT p99 ms | tokens/s | GiB-s | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.policy} | {r.skew:g} | {r.cold_start_pct:g}% | {r.refused} | {r.loads} | {r.ttft_p50_ms:g} | "
              f"{r.ttft_p99_ms:g} | {r.tokens_per_s:g} | {r.memory_gib_s:g} | {r.loadavg} |")


def plot(results: list[Result], directory: Path, prefix: str = "") -> None:
    """One PNG per measure (bench/results/placement_{prefix}MEASURE_{M}m_{W}w.png): a bar per policy at each skew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    skews = sorted({r.skew for r in results})
    policies = sorted({r.policy for r in results})
    tag = f"{results[0].models}m_{results[0].workers}w"
    for key, label in {"cold_start_pct": "cold starts (% of requests)", "ttft_p99_ms": "p99 TTFT (ms)",
                       "ttft_p50_ms": "p50 TTFT (ms)", "memory_gib_s": "worker memory (GiB-s)",
                       "refused": "refused requests"}.items():
        figure, axes = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            values = {r.skew: getattr(r, key) for r in results if r.policy == policy}
            axes.bar([s + (i - (len(policies) - 1) / 2) * width * 0.6 for s in range(len(skews))],
                     [values.get(s, 0) for s in skews], width * 0.6, label=policy)
        axes.set_xticks(range(len(skews)), [f"skew {s:g}" for s in skews])
        axes.set_ylabel(label)
        kind = "real" if prefix else "simulated"
        axes.set_title(f"{label}: {results[0].models} models, {results[0].workers} {kind} workers ({cpu_model()})",
                       fontsize=7)
        axes.legend()
        figure.tight_layout()
        figure.savefig(directory / f"placement_{prefix}{key}_{tag}.png", dpi=100)
        plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
