"""The command shared by `tandem prefill`, `tandem decode` and `tandem colocated`: flags (each with
a TANDEM_* variable), the engine configuration, and the process lifecycle.

Lifecycle: the gRPC server starts at once with health NOT_SERVING -> the primary model (and any
--preload or --pin one) loads and its engine thread starts -> the worker registers with the
scheduler and opens its token stream -> SERVING. Other catalogue models load on their first
request (services/worker/residency.py). On SIGTERM/SIGINT: deregister, let running requests finish
(--shutdown-grace, 10 s by default), abort the rest, close the stream, stop the server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from services.common import internal_auth
from services.common.config import (
    add_list_option, add_option, from_args, parse_address, parse_list, parse_seconds, parse_size,
)
from services.common.lora_catalogue import LoraCatalogueError, lora_sources
from services.common.grpc_server import CONTROL_MESSAGE_BYTES, GrpcServer, create_server
from services.common.metrics import ServiceMetrics, start_metrics_server
from services.common.model_config import ModelConfig
from services.common.model_catalogue import ModelCatalogue, ModelCatalogueError, parse_model_flag
from services.common.model_store import ModelStoreError, model_info
from services.common.tls import MutualTLS
from services.common.tracing import setup_tracing
from services.runtime.engine import Engine, EngineConfig
from services.runtime.precision import DTYPE_CHOICES, QUANTIZATION_CHOICES, Choice, Precision, resolve
from services.worker.runtime import ModelPlan, WorkerIdentity, WorkerRuntime
from services.worker.served_model import freeze_memory
from services.worker.servicer_base import WorkerServicerBase
from services.worker.transport import ChannelPool

T = TypeVar("T")
log = logging.getLogger(__name__)
# (served name, model directory, worker config) -> the engine the worker runs for that model
EngineFactory = Callable[[str, Path, "WorkerConfig"], Awaitable[Engine]]

DEFAULT_SCHEDULER = "127.0.0.1:50052"
DEFAULT_MAX_BATCHED_TOKENS = 2048
DEFAULT_CHUNK_SIZE = 512
SHUTDOWN_GRACE_S = 10.0
_UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "[::]", "")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """A worker's settings, from flags and TANDEM_* variables."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    scheduler: tuple[str, ...] = (DEFAULT_SCHEDULER,)  # every replica; (): standalone (no registration, no token stream)
    model: tuple[str, ...] = ()  # DIR or NAME=DIR, the first the primary; (): the default model
    model_memory: int | None = None  # weight bytes resident at once; None: the primary model's
    pin: tuple[str, ...] = ()  # catalogue models loaded at start and never evicted
    preload: tuple[str, ...] = ()  # catalogue models loaded at start
    device: str = "cpu"
    threads: int | None = None  # None: 1 on CPU (two workers share two cores), torch's default on GPU
    kv_memory: int | None = None  # None: 2 GiB on a CPU, kv_memory_fraction of free GPU memory on CUDA
    kv_memory_fraction: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    chunk_size: int = DEFAULT_CHUNK_SIZE
    kv_chunk_bytes: int = 1 << 20
    metrics_port: int = 0  # 0: no metrics endpoint; else served on `host`, like the gRPC port
    attention: str = "auto"
    dtype: str | None = None  # None: float32 on a CPU, bfloat16 on CUDA; auto: services/runtime/precision.py
    quantization: str = "none"
    lora: tuple[str, ...] = ()  # NAME=DIR adapters, beside those under $TANDEM_HOME/loras
    max_loras: int = 4
    worker_id: str | None = None
    shutdown_grace: float = SHUTDOWN_GRACE_S  # seconds a stopping worker lets its running requests finish
    internal_token: str | None = None  # None and no internal_tls: open, only under --insecure-internal
    internal_tls: MutualTLS | None = None

    @property
    def num_threads(self) -> int | None:
        return self.threads if self.threads is not None else (1 if self.device == "cpu" else None)

    def engine_config(self, precision: Precision, served_name: str = "") -> EngineConfig:
        return EngineConfig(
            kv_memory_bytes=self.kv_memory,
            kv_memory_fraction=self.kv_memory_fraction,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_batched_tokens,
            chunk_size=self.chunk_size,
            device=self.device,
            precision=precision,
            attention_backend=self.attention,
            num_threads=self.num_threads,
            max_loras=self.max_loras,
            served_name=served_name,
        )

    def precision(self, model_dir: Path) -> Choice:
        """The flags' precision; `auto` probes (or reads the probe cached for this machine) with the
        worker's threads, so call it from the thread that will run the engine."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        dtype = self.dtype or ("float32" if torch.device(self.device).type == "cpu" else "bfloat16")
        choice = resolve(dtype, self.quantization, self.device, ModelConfig.from_model_dir(model_dir),
                         prefill_rows=min(self.chunk_size, self.max_batched_tokens))
        return choice if self.dtype else replace(choice, reason=f"the default on {self.device}")

    def advertised(self, bound_port: int) -> str:
        """The address other services reach this worker at (loopback when bound to every interface)."""
        if self.advertise:
            return self.advertise
        host = "127.0.0.1" if self.host in _UNSPECIFIED_HOSTS else self.host
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{host}:{bound_port}"


@dataclass(frozen=True, slots=True)
class RoleSpec:
    """What differs between the three worker commands."""

    name: str  # "prefill", "decode", "colocated"
    role: int  # common_pb2.WorkerRole
    port: int
    metrics_port: int
    # (config, channels, the runtime once loaded) -> the servicer
    make_servicer: Callable[[WorkerConfig, ChannelPool, asyncio.Future[WorkerRuntime]], WorkerServicerBase]
    services: tuple[tuple[str, Callable[[Any, Any], None]], ...]  # (service name, add_..._to_server)
    report_blocks: bool = True  # publish prefix-cache changes (workers that prefill)
    local_prefill: bool = False  # a decode worker that also serves Assign (WorkerInfo.local_prefill)
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS  # --max-batched-tokens's default
    max_receive_bytes: int = CONTROL_MESSAGE_BYTES  # MAX_MESSAGE_BYTES where KV chunks arrive


def add_arguments(parser: argparse.ArgumentParser, spec: RoleSpec) -> None:
    add_option(parser, "--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    add_option(parser, "--port", type=int, default=spec.port, help="gRPC port (0: any free port)")
    add_option(parser, "--advertise", type=parse_address, metavar="HOST:PORT",
               help="address the scheduler and other workers reach this worker at; none: host:port, "
                    "with 127.0.0.1 for an unspecified host")
    add_option(parser, "--scheduler", type=_scheduler_addresses, default=(DEFAULT_SCHEDULER,), metavar="HOST:PORT,...",
               help="the schedulers to register with (every replica; each request is reported to the one that "
                    "placed it); 'none' runs standalone")
    add_list_option(parser, "--model", metavar="[NAME=]DIR",
                    help="HF model directory to serve (as NAME; none: its directory's name), beside every model "
                         "directory under $TANDEM_HOME/models; the first is loaded at start and serves requests "
                         "naming no model (none: the default model)")
    add_option(parser, "--model-memory", type=parse_size,
               help="weights of the catalogue's models resident at once (e.g. 8GiB); a request for a model not "
                    "resident loads it, evicting the least recently used idle ones; none: the first model's")
    add_list_option(parser, "--pin", metavar="NAME", help="catalogue model loaded at start and never evicted")
    add_list_option(parser, "--preload", metavar="NAME", help="catalogue model loaded at start")
    add_option(parser, "--device", default="cpu", help="cpu or cuda:N")
    add_option(parser, "--threads", type=int, help="torch threads; none: 1 on CPU, torch's choice on GPU")
    add_option(parser, "--kv-memory", type=parse_size,
               help="memory for the KV cache; none: 2GiB on a CPU, --kv-memory-fraction of the GPU memory free "
                    "after the weights load on CUDA")
    add_option(parser, "--kv-memory-fraction", type=float, default=0.9,
               help="share of the GPU memory free after the weights load that the KV cache takes (without "
                    "--kv-memory); the rest is left for activations")
    add_option(parser, "--block-size", type=int, default=16,
               help="tokens per KV block; the flash attention backend needs a multiple of 256")
    add_option(parser, "--max-num-seqs", type=int, default=64, help="most sequences in one iteration")
    add_option(parser, "--max-batched-tokens", type=int, default=spec.max_batched_tokens,
               help="token budget of one iteration")
    add_option(parser, "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="largest prompt chunk in one iteration")
    add_option(parser, "--kv-chunk-bytes", type=parse_size, default=1 << 20, help="largest KV chunk shipped")
    add_option(parser, "--metrics-port", type=int, default=spec.metrics_port,
               help="Prometheus /metrics port (0: off)")
    add_option(parser, "--attention", default="auto", choices=("auto", "torch", "flash"),
               help="attention backend")
    add_option(parser, "--dtype", choices=DTYPE_CHOICES,
               help="activations and KV cache; none: float32 on a CPU, bfloat16 on CUDA; auto: bfloat16 on "
                    "CUDA, on a CPU what a start-up probe finds fastest (cached under $TANDEM_HOME/probes)")
    add_option(parser, "--quantization", default="none", choices=QUANTIZATION_CHOICES,
               help="weight-only int8/int4 weights (CPU kernels); auto: as the probe finds fastest")
    add_option(parser, "--lora", type=parse_list, default=(), metavar="NAME=DIR,...",
               help="LoRA adapters (PEFT layout) requests may name as model BASE:NAME, beside every "
                    "adapter directory under $TANDEM_HOME/loras")
    add_option(parser, "--max-loras", type=int, default=4, help="LoRA adapters loaded at once (least recently "
               "used idle one leaves first)")
    add_option(parser, "--worker-id", help="id in the scheduler's registry; none: ROLE-HOST:PORT (advertised)")
    add_option(parser, "--shutdown-grace", type=parse_seconds, default=SHUTDOWN_GRACE_S,
               help="seconds a worker stopping on SIGTERM lets its running requests finish before it aborts them")
    internal_auth.add_arguments(parser)


def _scheduler_addresses(text: str) -> tuple[str, ...]:
    return () if text.strip().lower() in ("", "none") else tuple(parse_address(item) for item in parse_list(text))


def main(args: argparse.Namespace, spec: RoleSpec) -> int:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s {spec.name} %(name)s: %(message)s")
    try:
        config = worker_config(args, spec)
    except (internal_auth.InternalAuthError, LoraCatalogueError, ModelCatalogueError) as exc:
        print(f"tandem {spec.name}: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run_worker(config, spec))


def worker_config(args: argparse.Namespace, spec: RoleSpec) -> WorkerConfig:
    """The worker's settings from its flags; InternalAuthError when the internal-auth flags are wrong."""
    auth = internal_auth.auth_from_args(args, spec.name)
    lora_sources(args.lora)  # a malformed --lora fails here, before the model loads
    for item in args.model:  # and so does a --model naming no model directory
        parse_model_flag(item)
    return from_args(WorkerConfig, args, internal_token=auth.token, internal_tls=auth.tls)


async def run_worker(config: WorkerConfig, spec: RoleSpec) -> int:
    """Serves until SIGTERM/SIGINT or an engine failure; returns the exit status."""
    stopping = stop_on_signals()
    channels = ChannelPool(config.internal_token, config.internal_tls)
    loaded: asyncio.Future[WorkerRuntime] = asyncio.get_running_loop().create_future()
    server = await open_server(config, spec, spec.make_servicer(config, channels, loaded))
    address = config.advertised(server.port)
    log.info("%s worker listening on %s:%d (advertised %s); loading the model", spec.name, config.host,
             server.port, address)
    tracing = setup_tracing(spec.name, instance=address)
    try:
        starting = asyncio.create_task(start_runtime(config, spec, loaded, address, channels))
        if not await first_done(starting, stopping.wait()):
            return 0
        try:
            runtime = starting.result()
        except Exception as exc:  # noqa: BLE001 - reported in one line, the process exits 1
            log.error("%s worker could not start: %s: %s", spec.name, type(exc).__name__, exc)
            return 1
        freeze_memory()
        await server.mark_serving()
        log.info("%s worker %s SERVING", spec.name, runtime.worker_id)
        return await _serve_until_stopped(runtime, server, config, stopping)
    finally:
        await server.stop(grace=1.0)
        await channels.close()
        tracing.shutdown()


def stop_on_signals() -> asyncio.Event:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    return stopping


async def first_done(task: asyncio.Task, other: Awaitable[Any]) -> bool:
    """Waits for `task` or `other`; True when `task` finished first (else it is cancelled)."""
    waiter = asyncio.ensure_future(other)
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def _serve_until_stopped(runtime: WorkerRuntime, server: GrpcServer, config: WorkerConfig,
                               stopping: asyncio.Event) -> int:
    registry = runtime.metrics.registry if runtime.metrics is not None else None
    metrics = (start_metrics_server(config.host, config.metrics_port, registry)
               if config.metrics_port and registry else None)
    try:
        await first_done(asyncio.create_task(stopping.wait()), runtime.failed.wait())
        log.info("stopping: leaving the registry, draining running requests (up to %.0f s)", config.shutdown_grace)
        await server.mark_not_serving()
        await runtime.stop(drain_s=config.shutdown_grace)
    finally:
        if metrics is not None:
            metrics.close()
    return 1 if runtime.failed.is_set() else 0


async def open_server(config: WorkerConfig, spec: RoleSpec, servicer: WorkerServicerBase) -> GrpcServer:
    """The role's gRPC server, started (health NOT_SERVING until `mark_serving`)."""
    server = create_server(config.host, config.port, internal_token=config.internal_token,
                           max_receive_bytes=spec.max_receive_bytes,
                           credentials=config.internal_tls.server_credentials() if config.internal_tls else None)
    for name, register in spec.services:
        server.add_service(name, register, servicer)
    await server.start()
    return server


async def load_engine(name: str, model_dir: Path, config: WorkerConfig) -> Engine:
    """The engine of the model served as `name`, in the chosen precision, loaded in a thread of its own."""
    return await _in_own_thread(_build_engine, name, model_dir, config)


def _build_engine(name: str, model_dir: Path, config: WorkerConfig) -> Engine:
    choice = config.precision(model_dir)
    log.info("precision %s", choice.line())
    return Engine.from_model_dir(model_dir, config.engine_config(choice.precision, name), lora_sources(config.lora))


async def start_runtime(config: WorkerConfig, spec: RoleSpec, loaded: asyncio.Future[WorkerRuntime],
                        address: str, channels: ChannelPool,
                        make_engine: EngineFactory = load_engine) -> WorkerRuntime:
    """Reads the model catalogue, resolves `loaded`, loads the primary model (and the preloaded and
    pinned ones: their engines are `make_engine`'s, a model-free one for `tandem sim-worker`) and
    registers with the scheduler."""
    catalogue = await asyncio.to_thread(ModelCatalogue.from_flags, config.model)
    plan = await asyncio.to_thread(model_plan, catalogue, config)
    identity = WorkerIdentity(
        worker_id=config.worker_id or f"{spec.name}-{address}",
        role=spec.role,
        address=address,
        model=catalogue.primary,
        device=config.device,
        local_prefill=spec.local_prefill,
    )
    schedulers = [channels.get(address) for address in config.scheduler]
    runtime = WorkerRuntime(identity, plan, lambda name: make_engine(name, catalogue.path(name), config), schedulers,
                            channels.metadata, ServiceMetrics(identity.model, address),
                            report_blocks=spec.report_blocks)
    loaded.set_result(runtime)
    log.info("catalogue %s (%d bytes of model memory); loading %s; registering with %s", ", ".join(catalogue.names()),
             plan.budget, identity.model, ",".join(config.scheduler) or "no scheduler (standalone)")
    await runtime.start()
    return runtime


def model_plan(catalogue: ModelCatalogue, config: WorkerConfig) -> ModelPlan:
    """The catalogue's weight sizes (read from the safetensors headers) and the budget; ValueError
    for a --pin or --preload outside the catalogue."""
    for flag, names in (("--pin", config.pin), ("--preload", config.preload)):
        unknown = [name for name in names if name not in catalogue]
        if unknown:
            raise ValueError(f"{flag} {', '.join(unknown)}: not in the catalogue ({', '.join(catalogue.names())})")
    sizes = {name: _weight_bytes(catalogue.path(name)) for name in catalogue.names()}
    return ModelPlan(sizes, config.model_memory or sizes[catalogue.primary], config.pin, config.preload)


def _weight_bytes(model_dir: Path) -> int:
    """0 when the directory's weights cannot be read: loading it then fails that request, not the worker."""
    try:
        return model_info(model_dir).weight_bytes
    except (ModelStoreError, OSError, ValueError) as exc:
        log.warning("model %s: cannot read its weights' size (%s); requests for it will fail", model_dir, exc)
        return 0


async def _in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """Runs fn in a thread that ends with it. Loading the model there leaves no OpenMP team alive
    outside the engine thread (a pooled thread keeps its team, which then competes for the cores)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, result)

    threading.Thread(target=target, name="model-loader", daemon=True).start()
    return await future
