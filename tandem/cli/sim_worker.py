"""`tandem sim-worker`: K simulated workers of one role in one process, for measuring the control
plane without a model or a GPU.

Each is a real worker (its role's servicer and services/worker/: registration, heartbeats with
load, block events, token stream, KV hand-off) around a model-free engine
(services/worker/sim_engine.py): an iteration sleeps --step-ms and gives every running request
one token, a fixed function of its history. Each holds the models of its catalogue (the real
worker's --model, --model-memory, --pin, --preload) as a real worker does, loading one in --load-ms.
It prints `ID grpc ADDRESS` per worker, then `ready`
once every one is registered and SERVING; SIGTERM/SIGINT stops them all (deregister, drain, stop).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from services.common import internal_auth, loop_stalls
from services.common.config import add_option, parse_count
from services.common.grpc_server import GrpcServer
from services.common.tracing import setup_tracing
from services.worker import main_common
from services.worker.main_common import EngineFactory, RoleSpec, WorkerConfig
from services.worker.runtime import WorkerRuntime
from services.worker.served_model import freeze_memory
from services.worker.sim_engine import SimEngine, SimTiming
from services.worker.transport import ChannelPool

log = logging.getLogger("tandem.sim_worker")

ROLE_MODULES = {"colocated": "services.colocated.main", "prefill": "services.prefill.main",
                "decode": "services.decode.main"}
DRAIN_S = 5.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What the simulation adds to a worker's flags: how many, the engine's size and pace, and how
    long loading a model takes (a simulated cold start)."""

    count: int
    kv_blocks: int
    max_seqs: int
    timing: SimTiming
    load_ms: float = 0.0


@dataclass(slots=True)
class SimWorker:
    runtime: WorkerRuntime
    server: GrpcServer

    async def stop(self) -> None:
        await self.server.mark_not_serving()
        await self.runtime.stop(drain_s=DRAIN_S)
        await self.server.stop(grace=1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", choices=tuple(ROLE_MODULES), default="colocated", help="what every worker does")
    add_option(parser, "--count", type=parse_count, default=1, env="TANDEM_SIM_COUNT", help="simulated workers")
    add_option(parser, "--step-ms", type=float, default=20.0, env="TANDEM_SIM_STEP_MS",
               help="time of one iteration; each running request gets a token per iteration, so a stream "
                    "runs at 1000/step-ms tokens/s")
    add_option(parser, "--prefill-tokens-per-s", type=float, default=0.0, env="TANDEM_SIM_PREFILL_TOKENS_PER_S",
               help="prompt tokens an iteration computes per second, on top of --step-ms (0: free)")
    add_option(parser, "--kv-blocks", type=parse_count, default=4096, env="TANDEM_SIM_KV_BLOCKS",
               help="KV blocks of each worker")
    add_option(parser, "--max-seqs", type=parse_count, default=64, env="TANDEM_SIM_MAX_SEQS",
               help="requests one iteration runs at most")
    add_option(parser, "--load-ms", type=float, default=0.0, env="TANDEM_SIM_LOAD_MS",
               help="time to load a model (its cold start), for the primary at start and any other on demand")
    # A real worker's flags, so a simulated one is configured (and authenticates) as a real one is.
    main_common.add_arguments(parser, _spec("colocated"))
    parser.set_defaults(port=0, metrics_port=0)
    parser.epilog = ("Of a real worker's flags, --port is the first worker's (worker i listens on port+i; 0: a free "
                     "port each) and --worker-id a prefix (ID-0, ID-1, ...); the model directory gives only the "
                     "vocabulary, end-of-sequence ids and context length; --device, --threads, --kv-memory, "
                     "--attention and --metrics-port are not used.")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s sim-worker %(name)s: %(message)s")
    spec = _spec(args.role)
    try:
        base = main_common.worker_config(args, spec)
        sim = SimConfig(args.count, args.kv_blocks, args.max_seqs,
                        SimTiming(args.step_ms, args.prefill_tokens_per_s), args.load_ms)
        if sim.load_ms < 0:
            raise ValueError(f"--load-ms must be >= 0, got {sim.load_ms:g}")
        if base.advertise and sim.count > 1:
            raise ValueError(f"--advertise names one address; {sim.count} workers need one each: "
                             "leave it out (each advertises its own port) or run one worker per process")
    except (internal_auth.InternalAuthError, ValueError) as exc:
        print(f"tandem sim-worker: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run(sim, base, spec))


def _spec(role: str) -> RoleSpec:
    return importlib.import_module(ROLE_MODULES[role]).SPEC


def worker_configs(sim: SimConfig, base: WorkerConfig) -> list[WorkerConfig]:
    """One config per worker: its own port and id, no metrics endpoint."""
    return [replace(base, port=base.port + i if base.port else 0, metrics_port=0,
                    worker_id=f"{base.worker_id}-{i}" if base.worker_id else None)
            for i in range(sim.count)]


def engine_factory(sim: SimConfig) -> EngineFactory:
    async def make(name: str, model_dir: Path, config: WorkerConfig) -> SimEngine:
        await asyncio.sleep(sim.load_ms / 1000)
        return SimEngine.for_model_dir(model_dir, sim.kv_blocks, sim.timing, config.max_batched_tokens,
                                       sim.max_seqs, config.chunk_size, served_name=name)

    return make


async def run(sim: SimConfig, base: WorkerConfig, spec: RoleSpec) -> int:
    """Serves until SIGTERM/SIGINT or an engine failure; returns the exit status."""
    stopping = main_common.stop_on_signals()
    channels = ChannelPool(base.internal_token, base.internal_tls)
    tracing = setup_tracing(f"sim-{spec.name}")
    workers: list[SimWorker] = []
    try:
        make_engine = engine_factory(sim)
        starting = asyncio.ensure_future(asyncio.gather(
            *(start_worker(config, spec, channels, make_engine) for config in worker_configs(sim, base)),
            return_exceptions=True))
        if not await main_common.first_done(starting, stopping.wait()):
            return 0
        results = starting.result()
        workers = [r for r in results if isinstance(r, SimWorker)]
        errors = [r for r in results if not isinstance(r, SimWorker)]
        if errors:
            log.error("%d of %d simulated workers could not start: %s", len(errors), sim.count, errors[0])
            return 1
        for worker in workers:
            print(f"{worker.runtime.worker_id} grpc {worker.runtime.identity.address}")
        # As a real worker does once loaded: without it, each full collection walked the 50 engines'
        # blocks and stopped the process's loop for about 100 ms (the bench's paced routed->worker tail).
        freeze_memory()
        print("ready", flush=True)
        stalls = loop_stalls.watch_from_env()
        failed = asyncio.wait([asyncio.ensure_future(w.runtime.failed.wait()) for w in workers],
                              return_when=asyncio.FIRST_COMPLETED)
        await main_common.first_done(asyncio.ensure_future(stopping.wait()), failed)
        if stalls is not None:
            stalls.cancel()
        return 1 if any(w.runtime.failed.is_set() for w in workers) else 0
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        await channels.close()
        tracing.shutdown()


async def start_worker(config: WorkerConfig, spec: RoleSpec, channels: ChannelPool,
                       make_engine: EngineFactory) -> SimWorker:
    """A worker SERVING and registered; its server is stopped again if it cannot start."""
    loaded: asyncio.Future[WorkerRuntime] = asyncio.get_running_loop().create_future()
    server = await main_common.open_server(config, spec, spec.make_servicer(config, channels, loaded))
    try:
        runtime = await main_common.start_runtime(config, spec, loaded, config.advertised(server.port), channels,
                                                  make_engine)
        await server.mark_serving()
    except BaseException:
        await server.stop(grace=0)
        raise
    return SimWorker(runtime, server)
