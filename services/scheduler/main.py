"""`tandem scheduler`: the control plane. Serves SchedulerService over gRPC on the store given by
--redis-url (or an embedded one), and reports SERVING once the store answers."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import secrets
import sys
from dataclasses import dataclass

from services.common import event_loop, internal_auth, loop_stalls
from services.common.config import add_option, env_default, env_name, from_args, parse_bool
from services.common.grpc_server import GrpcServer, create_server
from services.common.metrics import MetricsServer, ServiceMetrics, start_metrics_server
from services.common.store import Store, StoreUnavailable, open_store
from services.common.tls import MutualTLS
from services.common.tracing import setup_tracing
from services.scheduler import message_counts
from services.scheduler.batch_policy import SloPolicy
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.model_loads import ModelLoads
from services.scheduler.model_placement import ModelPlacement, ReplicaRule
from services.scheduler.prefill_placement import PlacementPolicy, PrefillPlacement
from services.scheduler.registry import LISTING_REUSE_S, WorkerRegistry
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer
from services.scheduler.worker_clients import WorkerClients
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger("tandem.scheduler")

_STORE_RETRY_S = 0.5
_WATCHES_PER_TTL = 5
_MAX_WATCH_INTERVAL_S = 0.5
_MIGRATION_ENV = env_name("--migration")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """host/port: the gRPC listen address. redis_url: the shared store (None: embedded, in-process).
    max_queue: requests that may wait for a worker before RESOURCE_EXHAUSTED. max_running: requests
    dispatched at once per decode (or colocated) worker; more wait in the queue. metrics_port: the
    Prometheus endpoint on `host` (0: off). heartbeat_ttl: seconds a worker stays live after its last
    heartbeat. internal_token: the secret internal callers present and this scheduler sends to workers
    (`x-tandem-internal-token`); internal_tls: mutual TLS with callers and workers (both None: open,
    only under --insecure-internal). migration: a request whose
    generating worker is lost goes on on another one (services/scheduler/migration.py). batch_*: the
    batching policy every worker applies from its registration on (0: the worker keeps its own flag).
    placement: how models are placed on workers (services/scheduler/model_placement.py); under cost,
    replicate_active, replicate_ttft_ms and drop_idle_s say when a model is copied onto another worker
    or a copy dropped."""

    host: str = "127.0.0.1"
    port: int = 50052
    redis_url: str | None = None
    max_queue: int = 256
    max_running: int = 64
    metrics_port: int = 9102
    heartbeat_ttl: float = 5.0
    internal_token: str | None = None
    internal_tls: MutualTLS | None = None
    migration: bool = True
    batch_max_tokens: int = 0
    batch_max_seqs: int = 0
    batch_chunk_size: int = 0
    slo_ttft_ms: float = 0.0
    slo_itl_ms: float = 0.0
    slo_context_tokens: int = 1024
    placement: ModelPlacement = ModelPlacement.COST
    replicate_active: int = 8
    replicate_ttft_ms: float = 0.0
    drop_idle_s: float = 120.0
    local_prefill_tokens: int = 256

    def __post_init__(self) -> None:
        if (self.slo_ttft_ms > 0) != (self.slo_itl_ms > 0) or self.slo_ttft_ms < 0 or self.slo_itl_ms < 0:
            raise ValueError("--slo-ttft-ms and --slo-itl-ms go together, both > 0 (or both 0: no SLO policy), "
                             f"got {self.slo_ttft_ms} and {self.slo_itl_ms}")
        self.replica_rule()  # raises on a bad threshold
        if self.slo_context_tokens < 1:
            raise ValueError(f"--slo-context-tokens must be >= 1, got {self.slo_context_tokens}")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"--local-prefill-tokens must be >= 0, got {self.local_prefill_tokens}")
        for flag, value in (("--batch-max-tokens", self.batch_max_tokens), ("--batch-max-seqs", self.batch_max_seqs),
                            ("--batch-chunk-size", self.batch_chunk_size)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0 (0 keeps each worker's own setting), got {value}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_running < 1:
            raise ValueError(f"--max-running must be >= 1, got {self.max_running}")
        if self.heartbeat_ttl <= 0:
            raise ValueError(f"--heartbeat-ttl must be > 0 seconds, got {self.heartbeat_ttl}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be a port number (0 turns metrics off), got {self.metrics_port}")


    def replica_rule(self) -> ReplicaRule:
        return ReplicaRule(hot_active=self.replicate_active, cold_idle_ms=round(self.drop_idle_s * 1000),
                           hot_ttft_ms=self.replicate_ttft_ms)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add_option(parser, "--port", type=int, default=50052, help="gRPC port")
    add_option(parser, "--redis-url", default=None,
               help="Redis URL of the shared store, e.g. redis://127.0.0.1:6379/0 (unset: embedded store)")
    add_option(parser, "--max-queue", type=int, default=256,
               help="requests that may wait for a worker; beyond, RESOURCE_EXHAUSTED with a retry hint")
    add_option(parser, "--max-running", type=int, default=64,
               help="requests dispatched at once per decode or colocated worker; more wait in the queue")
    add_option(parser, "--metrics-port", type=int, default=9102, help="Prometheus /metrics port (0: off)")
    add_option(parser, "--heartbeat-ttl", type=float, default=5.0,
               help="seconds a worker stays in the registry after its last heartbeat")
    parser.add_argument(
        "--migration", action=argparse.BooleanOptionalAction, default=parse_bool(env_default(_MIGRATION_ENV, "true")),
        help="when the worker generating a request is lost, re-prefill its prompt and the tokens delivered so far "
             "on another worker and go on streaming (--no-migration: fail it with UNAVAILABLE). A request with a "
             "presence or frequency penalty fails once it has a token, since those count output tokens only "
             f"(env {_MIGRATION_ENV}; default true)")
    add_option(parser, "--batch-max-tokens", type=int, default=0,
               help="token budget of one worker iteration, for every worker (0: each keeps its --max-batched-tokens)")
    add_option(parser, "--batch-max-seqs", type=int, default=0,
               help="most sequences in one worker iteration, for every worker (0: each keeps its own)")
    add_option(parser, "--batch-chunk-size", type=int, default=0,
               help="largest prompt chunk in one worker iteration, for every worker (0: each keeps its --chunk-size)")
    add_option(parser, "--slo-ttft-ms", type=float, default=0.0,
               help="time-to-first-token target; with --slo-itl-ms, each worker's batching policy is set from "
                    "the step-cost model it reports so a step meets them, and a hybrid decode worker prefills a "
                    "prompt itself, in chunks, when that meets it sooner than a prefill worker (0: off)")
    add_option(parser, "--slo-itl-ms", type=float, default=0.0,
               help="inter-token latency target: the token budget of a step that must finish within it (0: off)")
    add_option(parser, "--slo-context-tokens", type=int, default=1024,
               help="KV entries a decode token is taken to read when sizing a step for --slo-itl-ms")
    add_option(parser, "--local-prefill-tokens", type=int, default=256,
               help="a hybrid decode worker (tandem decode --hybrid) prefills a prompt itself when its uncached "
                    "tokens, with those queued there, are at most this many; once the worker reports its "
                    "step-cost model and --slo-itl-ms is set, the ITL target decides instead")
    add_option(parser, "--placement", type=ModelPlacement, choices=tuple(ModelPlacement), default=ModelPlacement.COST,
               help="cost: models share workers and load on demand, hot ones copied onto more workers, cold copies "
                    "dropped; latency: only provisioned models are served (tandem models provision NAME), never a "
                    "cold start")
    add_option(parser, "--replicate-active", type=int, default=8,
               help="cost placement: copy a model onto another worker when each of its copies has this many "
                    "requests queued or running")
    add_option(parser, "--replicate-ttft-ms", type=float, default=0.0,
               help="cost placement: copy a model onto another worker when the p90 time to first token of its "
                    "last 32 requests (as this scheduler saw them, at least 8) is at least this (0: off)")
    add_option(parser, "--drop-idle-s", type=float, default=120.0,
               help="cost placement: drop an unpinned copy of a model idle this long while another copy stays")
    add_option(parser, "--event-loop", default="auto", choices=event_loop.EVENT_LOOPS,
               help="the event loop: uvloop's (auto: when installed; less CPU per message) or asyncio's")
    internal_auth.add_arguments(parser)


def slo_policy(config: SchedulerConfig) -> SloPolicy | None:
    """The SLO policy, when both targets are set."""
    if config.slo_itl_ms <= 0:
        return None
    return SloPolicy(ttft_ms=config.slo_ttft_ms, itl_ms=config.slo_itl_ms, context_tokens=config.slo_context_tokens,
                     max_seqs_cap=config.max_running)


def prefill_placement(config: SchedulerConfig) -> PrefillPlacement:
    """Where a request with a hybrid decode worker prefills (services/scheduler/prefill_placement.py)."""
    return PrefillPlacement(PlacementPolicy(itl_ms=config.slo_itl_ms, context_tokens=config.slo_context_tokens,
                                            local_tokens=config.local_prefill_tokens, ttft_ms=config.slo_ttft_ms))


def batch_policy(config: SchedulerConfig) -> scheduler_pb2.BatchPolicy:
    """The policy workers receive when they register (zero fields keep their own flags)."""
    return scheduler_pb2.BatchPolicy(max_num_batched_tokens=config.batch_max_tokens,
                                     max_num_seqs=config.batch_max_seqs, chunk_size=config.batch_chunk_size)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        auth = internal_auth.auth_from_args(args, "scheduler")
        config = from_args(SchedulerConfig, args, internal_token=auth.token, internal_tls=auth.tls)
    except ValueError as exc:
        print(f"tandem scheduler: {exc}", file=sys.stderr)
        return 2
    try:
        event_loop.run(serve(config), args.event_loop)
    except event_loop.EventLoopError as exc:
        print(f"tandem scheduler: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tandem scheduler: {exc}", file=sys.stderr)
        return 1
    return 0


async def serve(config: SchedulerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then stop gracefully."""
    tracing = setup_tracing("scheduler")
    metrics = ServiceMetrics("", "scheduler")
    message_counts.register(metrics.registry, metrics.model_name, metrics.worker)
    metrics_server = _start_metrics(config.host, config.metrics_port, metrics)
    store = open_store(config.redis_url)
    scheduler_id = secrets.token_hex(6)
    clients = WorkerClients(config.internal_token, config.internal_tls, scheduler_id=scheduler_id)
    registry = WorkerRegistry(store, config.heartbeat_ttl, listing_reuse_s=LISTING_REUSE_S,
                              placement=config.placement)
    dispatcher = Dispatcher(registry, clients, max_queue=config.max_queue,
                            max_running=config.max_running, migration=config.migration, metrics=metrics,
                            placement=prefill_placement(config))
    server = create_server(config.host, config.port, internal_token=config.internal_token,
                           credentials=config.internal_tls.server_credentials() if config.internal_tls else None)
    server.add_service(SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                       SchedulerServicer(dispatcher, scheduler_id=scheduler_id, policy=batch_policy(config),
                                        slo=slo_policy(config)))
    try:
        await server.start()
        gc.freeze()  # what start-up built (modules, descriptors, the servicer) stays out of every later collection
        dispatcher.start(min(_MAX_WATCH_INTERVAL_S, config.heartbeat_ttl / _WATCHES_PER_TTL))
        log.info("serving on %s:%d (store %s, queue %d, %d running per worker, heartbeat ttl %.1f s, migration %s, "
                 "%s placement, event loop %s)", config.host, server.port, store.name, config.max_queue,
                 config.max_running, config.heartbeat_ttl, "on" if config.migration else "off", config.placement,
                 event_loop.loop_name(asyncio.get_running_loop()))
        ready = asyncio.create_task(serve_once_store_answers(store, server))
        stalls = loop_stalls.watch_from_env()
        balancing = (asyncio.create_task(ModelLoads(registry, clients).keep_balanced(
                         config.replica_rule(), config.heartbeat_ttl, dispatcher.ttft))
                     if config.placement is ModelPlacement.COST else None)
        await server.run_until_signal()
        ready.cancel()
        for task in (balancing, stalls):
            if task is not None:
                task.cancel()
    finally:
        await dispatcher.close()
        await clients.close()
        await store.close()
        if metrics_server is not None:
            metrics_server.close()
        tracing.shutdown()


async def serve_once_store_answers(store: Store, server: GrpcServer) -> None:
    """Mark the server SERVING as soon as the store answers a ping (at once for the embedded store)."""
    waited = False
    while True:
        try:
            await store.ping()
            break
        except StoreUnavailable as exc:
            if not waited:
                log.warning("NOT_SERVING until the store answers: %s", exc)
            waited = True
            await asyncio.sleep(_STORE_RETRY_S)
    await server.mark_serving()
    log.info("the %s store answers: SERVING", store.name)


def _start_metrics(host: str, port: int, metrics: ServiceMetrics) -> MetricsServer | None:
    if port == 0:
        return None
    try:
        return start_metrics_server(host, port, metrics.registry)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on port {port}: {exc}; pass another --metrics-port, or 0 for none") \
            from exc
