"""The placement benchmark's real run (bench/placement.py --real): cost against latency placement
through real processes on loopback, `tandem up --mode colocated` with a scheduler, a gateway and
--workers colocated workers, the default model served under --models names (symlinks m0, m1, ...
under a throwaway $TANDEM_HOME/models; m0 is every worker's primary, loaded at start) and a
--model-memory of --per-worker models' weights on each worker.

Each (skew, policy) gets a fresh mesh. Latency placement provisions first, as `tandem models
provision` does: the most popular models, --replicas each, until the workers are full (a request
for any other model is refused with FAILED_PRECONDITION). Then --requests requests arrive as a
Poisson process at --rate per second, each naming a model drawn from the Zipf popularity (the same
seeded draws as the simulated run) and asking for --output-tokens greedy tokens, each bounded by
REQUEST_TIMEOUT_S. Measured at the client: TTFT (to the first token), tokens delivered and the
status of each refused request (on stderr); from the workers' metrics: model loads during the
traffic (each one a request that waited for it: the cold-start column counts loads per 100
requests, a lower bound of the requests that waited); from the scheduler's routing map, sampled
every SAMPLE_S: the weight bytes resident or loading on every worker, integrated over the traffic
(worker-memory-seconds).
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.control_plane import loadavg
from bench.placement import GIB, Result, ttft_ms, zipf
from services.common.model_store import default_model_dir, model_info
from services.common.paths import tandem_home
from services.scheduler.model_placement import ModelPlacement
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.mesh import Mesh

SAMPLE_S = 0.25
REQUEST_TIMEOUT_S = 120.0
PROVISION_TIMEOUT_S = 300.0
LOADS_METRIC = "tandem:model_loads_total"


@dataclass(frozen=True, slots=True)
class RealSetup:
    models: int
    workers: int
    per_worker: int  # models' weights of --model-memory on each worker
    requests: int
    rate: float
    output_tokens: int
    replicas: int
    seed: int


@dataclass(slots=True)
class Tally:
    """What the requests of one run saw at the client."""

    ttfts: list[float]
    tokens: int = 0
    refused: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # the refused requests' status codes


def run_real(setup: RealSetup, policy: ModelPlacement, skew: float) -> Result:
    """One (policy, skew) run on a fresh mesh; see the module docstring."""
    model_dir = default_model_dir()
    with tempfile.TemporaryDirectory(prefix="tandem-placement-") as scratch:
        home = make_home(Path(scratch), model_dir, setup.models)
        env = {"TANDEM_HOME": str(home),
               "TANDEM_MODEL_MEMORY": str(setup.per_worker * model_info(model_dir).weight_bytes)}
        mesh = Mesh.start("--mode", "colocated", "--workers", str(setup.workers), "--placement", str(policy),
                          "--model", str(home / "models" / "m0"), env=env, run_dir=Path(scratch) / "run")
        try:
            return asyncio.run(_traffic(mesh, setup, policy, skew))
        finally:
            mesh.stop()


def make_home(scratch: Path, model_dir: Path, models: int) -> Path:
    """A $TANDEM_HOME whose models/ holds the default model under m0..m{models-1}, sharing this
    machine's precision probes (a worker probes once, not once per run)."""
    home = scratch / "home"
    (home / "models").mkdir(parents=True)
    for index in range(models):
        (home / "models" / f"m{index}").symlink_to(model_dir, target_is_directory=True)
    probes = tandem_home() / "probes"
    probes.mkdir(parents=True, exist_ok=True)
    (home / "probes").symlink_to(probes, target_is_directory=True)
    return home


async def _traffic(mesh: Mesh, setup: RealSetup, policy: ModelPlacement, skew: float) -> Result:
    rng = random.Random(setup.seed)
    popularity = zipf(setup.models, skew)
    names = [f"m{i}" for i in range(setup.models)]
    async with grpc.aio.insecure_channel(mesh.endpoint("scheduler").address) as scheduler_channel, \
            grpc.aio.insecure_channel(mesh.endpoint("gateway").address) as gateway_channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(scheduler_channel)
        if policy is ModelPlacement.LATENCY:
            await _provision(scheduler, mesh, [names[i] for i in sorted(range(setup.models),
                                                                          key=lambda i: -popularity[i])], setup)
        loads_before = _loads(mesh)
        memory = [0.0]
        sampler = asyncio.ensure_future(_sample_memory(scheduler, mesh, memory))
        gateway = gateway_pb2_grpc.GenerateServiceStub(gateway_channel)
        tally = Tally(ttfts=[])
        start = time.monotonic()
        requests = []
        for index in range(setup.requests):
            model = names[rng.choices(range(setup.models), weights=popularity)[0]]
            requests.append(asyncio.ensure_future(_request(gateway, model, index, setup.output_tokens, tally)))
            await asyncio.sleep(rng.expovariate(setup.rate))
        await asyncio.gather(*requests)
        wall = time.monotonic() - start
        sampler.cancel()
    loads = _loads(mesh) - loads_before
    if tally.refused:
        print(f"{policy} placement, skew {skew:g}: refused {dict(tally.statuses)}", file=sys.stderr)
    p50, p99 = ttft_ms(tally.ttfts)
    return Result(policy=str(policy), skew=skew, models=setup.models, workers=setup.workers, requests=setup.requests,
                  served=len(tally.ttfts), refused=tally.refused,
                  cold_start_pct=round(100 * loads / setup.requests, 1), loads=loads, ttft_p50_ms=p50, ttft_p99_ms=p99,
                  tokens_per_s=round(tally.tokens / wall, 1), memory_gib_s=round(memory[0] / GIB, 1),
                  wall_s=round(wall, 1), loadavg=loadavg())


async def _provision(scheduler: scheduler_pb2_grpc.SchedulerServiceStub, mesh: Mesh, by_popularity: list[str],
                     setup: RealSetup) -> None:
    """Provision the most popular models first, `replicas` each, until one no longer fits."""
    for model in by_popularity:
        try:
            await scheduler.ProvisionModel(scheduler_pb2.ProvisionModelRequest(model=model, replicas=setup.replicas),
                                           timeout=PROVISION_TIMEOUT_S, metadata=mesh.internal_metadata)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return


async def _request(gateway: gateway_pb2_grpc.GenerateServiceStub, model: str, index: int, output_tokens: int,
                   tally: Tally) -> None:
    """One greedy request; its TTFT and tokens into `tally`, or a refusal (any status but OK)."""
    request = gateway_pb2.GenerateRequest(
        prompt=f"Request {index}: name three rivers and say where each one flows.", model=model,
        sampling=common_pb2.SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True))
    sent, first, tokens = time.monotonic(), None, 0
    try:
        async for message in gateway.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if message.token_ids and first is None:
                first = time.monotonic() - sent
            tokens += len(message.token_ids)
    except grpc.aio.AioRpcError as error:
        tally.refused += 1
        tally.statuses[error.code().name] += 1
        return
    tally.tokens += tokens
    if first is not None:
        tally.ttfts.append(first)


async def _sample_memory(scheduler: scheduler_pb2_grpc.SchedulerServiceStub, mesh: Mesh, total: list[float]) -> None:
    """Weight bytes the routing map shows on every worker (resident or loading), integrated over time
    (total[0], byte-seconds): each sample counts until the next."""
    held, since = 0, time.monotonic()
    while True:
        stats = await scheduler.Stats(scheduler_pb2.SchedulerStatsRequest(), timeout=5,
                                      metadata=mesh.internal_metadata)
        now = time.monotonic()
        total[0] += held * (now - since)
        held, since = sum(m.weight_bytes for w in stats.workers for m in w.load.models), now
        await asyncio.sleep(SAMPLE_S)


def _loads(mesh: Mesh) -> int:
    """Model loads the workers counted since they started (their /metrics)."""
    total = 0
    for name in mesh.names("colocated"):
        with urllib.request.urlopen(mesh.endpoint(name, "metrics").address, timeout=5) as response:
            total += loads_in(response.read().decode())
    return total


def loads_in(metrics: str) -> int:
    """The model loads one worker's /metrics text counts, over every model."""
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith(LOADS_METRIC + "{") or line.startswith(LOADS_METRIC + " ")))
