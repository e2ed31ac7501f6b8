"""`tandem up`: the whole system on this machine. Starts Redis (when redis-server is installed, else
the scheduler's embedded store), the scheduler, the workers and the gateway as child processes,
waits until each answers, prints one line per endpoint and then `ready`, and stops them all on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.paths import run_dir
from tandem.supervisor import Child, Interrupted, StartFailed, stop_all, wait_ready
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
WORKER_ROLES = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated",)}
_WATCH_S = 0.5


@dataclass(frozen=True, slots=True)
class UpConfig:
    mode: str  # "disaggregated" | "colocated"
    prefill: int
    decode: int
    workers: int  # colocated workers
    model: Path | None  # None: the default model, converted on first use
    host: str
    grpc_port: int  # 0: any free port
    http_port: int
    redis_url: str | None
    threads_per_worker: int | None
    device: str  # "auto": one GPU per worker round-robin when there are GPUs, else cpu
    start_timeout: float
    stop_grace: float

    @property
    def connect_host(self) -> str:
        """Where the launcher and the services reach each other."""
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host

    def worker_counts(self) -> dict[str, int]:
        if self.mode == "colocated":
            return {"colocated": self.workers}
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    kind: str  # grpc | http | metrics | redis
    address: str
    pid: int | None = None

    def line(self) -> str:
        pid = f"  pid {self.pid}" if self.pid is not None else ""
        return f"{self.name:<12}{self.kind:<8}{self.address}{pid}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=tuple(WORKER_ROLES), default="disaggregated",
                        help="separate prefill and decode workers, or colocated ones (default disaggregated)")
    parser.add_argument("--prefill", type=_count, default=1, help="prefill workers (disaggregated; default 1)")
    parser.add_argument("--decode", type=_count, default=1, help="decode workers (disaggregated; default 1)")
    parser.add_argument("--workers", type=_count, default=1, help="colocated workers (colocated; default 1)")
    parser.add_argument("--model", type=Path, default=os.environ.get("TANDEM_MODEL") or None,
                        help="model directory (env TANDEM_MODEL; default: the default model)")
    parser.add_argument("--host", default="127.0.0.1", help="address every service listens on (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port; 0 picks a free one")
    parser.add_argument("--http-port", type=int, default=8000, help="gateway HTTP port; 0 picks a free one")
    parser.add_argument("--redis-url", default=os.environ.get("TANDEM_REDIS_URL") or None,
                        help="use this Redis (env TANDEM_REDIS_URL); default: start redis-server if installed, "
                             "else the scheduler's embedded store")
    parser.add_argument("--threads-per-worker", type=_count, default=None,
                        help="CPU threads of each worker (default: the cores shared evenly)")
    parser.add_argument("--device", default="auto",
                        help="worker device: cpu, cuda:N, or auto (a GPU each, round-robin, when there are GPUs)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for each stage")
    parser.add_argument("--stop-grace", type=float, default=10.0, help="seconds each stage gets to stop")


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(args: argparse.Namespace) -> int:
    config = UpConfig(**{name: getattr(args, name) for name in UpConfig.__dataclass_fields__})
    try:
        model_dir = config.model or _default_model()
    except RuntimeError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    system = LocalSystem(config, model_dir, run_dir())
    try:
        system.start(stop)
        for endpoint in system.endpoints:
            print(endpoint.line())
        print("ready", flush=True)
        return system.watch(stop)
    except Interrupted:
        return 0
    except StartFailed as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    finally:
        system.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _default_model() -> Path:
    from services.common.model_store import ensure_default_model

    return ensure_default_model()


class LocalSystem:
    """The children of one `tandem up`, started tier by tier: redis, scheduler, workers, gateway.

    A tier starts once the one before is ready; workers are ready when they report SERVING and
    the scheduler lists them, so `ready` means a request can be served.
    """

    def __init__(self, config: UpConfig, model_dir: Path, logs: Path) -> None:
        self.config = config
        self.model_dir = model_dir
        self.logs = logs
        self.tiers: list[list[Child]] = []
        self.endpoints: list[Endpoint] = []
        self._ports: set[int] = set()
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._reported: set[str] = set()

    def start(self, stop: threading.Event) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        print(f"tandem up: starting {self._summary()}; logs in {self.logs}", file=sys.stderr, flush=True)
        redis_url = self._start_redis(stop)
        scheduler = self._start_scheduler(redis_url, stop)
        self._start_workers(scheduler, stop)
        self._start_gateway(scheduler, stop)

    def watch(self, stop: threading.Event) -> int:
        """Until Ctrl-C/SIGTERM (0) or the death of the gateway or the scheduler (1). A worker or
        Redis may die (a test may kill one): it is reported and the rest keeps serving."""
        while not stop.wait(_WATCH_S):
            for child in (c for tier in self.tiers for c in tier if c.name not in self._reported):
                if child.exit_code() is None:
                    continue
                self._reported.add(child.name)
                print(f"tandem up: {child.died_message()}", file=sys.stderr, flush=True)
                if child.essential:
                    return 1
        return 0

    def stop(self) -> None:
        stop_all(list(reversed(self.tiers)), self.config.stop_grace)

    def _summary(self) -> str:
        workers = ", ".join(f"{n} {role}" for role, n in self.config.worker_counts().items())
        return f"the scheduler, workers ({workers}) and the gateway"

    def _start_redis(self, stop: threading.Event) -> str | None:
        if self.config.redis_url:
            self.endpoints.append(Endpoint("redis", "redis", self.config.redis_url))
            return self.config.redis_url
        executable = shutil.which("redis-server")
        if executable is None:
            print("tandem up: redis-server not found; the scheduler uses its embedded store", file=sys.stderr)
            return None
        port = self._free_port()
        argv = [executable, "--port", str(port), "--bind", self.config.connect_host, "--save", "",
                "--appendonly", "no", "--dir", str(self.logs)]
        child = Child("redis", argv, self.logs / "redis.log", lambda: _redis_ping(self.config.connect_host, port),
                      essential=False)
        self._start_tier([child], stop)
        url = f"redis://{self.config.connect_host}:{port}/0"
        self.endpoints.append(Endpoint("redis", "redis", url, child.pid))
        return url

    def _start_scheduler(self, redis_url: str | None, stop: threading.Event) -> str:
        port, metrics_port = self._free_port(), self._free_port()
        flags = ["--metrics-port", str(metrics_port)] + (["--redis-url", redis_url] if redis_url else [])
        child = self._service("scheduler", "scheduler", port, flags)
        self._start_tier([child], stop)
        self._add_grpc_endpoints(child, port, metrics_port)
        return self._address(port)

    def _start_workers(self, scheduler: str, stop: threading.Event) -> None:
        counts = self.config.worker_counts()
        total = sum(counts.values())
        threads = self.config.threads_per_worker or max(1, (os.cpu_count() or 1) // total)
        devices = _devices(self.config.device, total)
        children, ports = [], []
        for role, count in counts.items():
            for index in range(count):
                port, metrics_port = self._free_port(), self._free_port()
                flags = ["--advertise", self._address(port), "--scheduler", scheduler, "--model",
                         str(self.model_dir), "--threads", str(threads), "--device", devices[len(children)],
                         "--metrics-port", str(metrics_port)]
                ready = _registered_and_serving(self._address(port), scheduler)
                children.append(self._service(f"{role}-{index}", role, port, flags, ready, essential=False))
                ports.append((port, metrics_port))
        self._start_tier(children, stop)
        for child, (port, metrics_port) in zip(children, ports):
            self._add_grpc_endpoints(child, port, metrics_port)

    def _start_gateway(self, scheduler: str, stop: threading.Event) -> None:
        port = self.config.grpc_port or self._free_port()
        http_port = self.config.http_port or self._free_port()
        flags = ["--http-port", str(http_port), "--scheduler", scheduler, "--model", str(self.model_dir)]
        child = self._service("gateway", "gateway", port, flags)
        self._start_tier([child], stop)
        self.endpoints.append(Endpoint("gateway", "grpc", self._address(port), child.pid))
        self.endpoints.append(Endpoint("gateway", "http", f"http://{self._address(http_port)}", child.pid))
        self.endpoints.append(Endpoint("gateway", "metrics", f"http://{self._address(http_port)}/metrics"))

    def _service(self, name: str, command: str, port: int, flags: list[str],
                 ready: Callable[[], bool] | None = None, essential: bool = True) -> Child:
        """A `tandem <command>` child listening on port, ready (by default) when its health says SERVING."""
        argv = [sys.executable, "-m", "tandem.cli", command, "--host", self.config.host, "--port", str(port), *flags]
        address = self._address(port)
        return Child(name, argv, self.logs / f"{name}.log", ready or (lambda: _serving(address)), essential)

    def _start_tier(self, children: list[Child], stop: threading.Event) -> None:
        self.tiers.append(children)
        for child in children:
            child.start(self._env)
        wait_ready(children, self.config.start_timeout, stop)

    def _add_grpc_endpoints(self, child: Child, port: int, metrics_port: int) -> None:
        self.endpoints.append(Endpoint(child.name, "grpc", self._address(port), child.pid))
        self.endpoints.append(Endpoint(child.name, "metrics", f"http://{self._address(metrics_port)}/metrics"))

    def _address(self, port: int) -> str:
        return f"{self.config.connect_host}:{port}"

    def _free_port(self) -> int:
        """A port free on the listen host now, never one handed out before in this run."""
        while True:
            with socket.socket() as sock:
                sock.bind((self.config.connect_host, 0))
                port = sock.getsockname()[1]
            if port not in self._ports and port not in (self.config.grpc_port, self.config.http_port):
                self._ports.add(port)
                return port


def _serving(address: str) -> bool:
    from services.common.health_cli import SERVING, check

    return check(address, timeout=1.0) == SERVING


def _registered_and_serving(address: str, scheduler: str) -> Callable[[], bool]:
    """A worker is ready when it is SERVING and the scheduler's registry lists its address."""
    from services.common.grpc_server import INTERNAL_TOKEN_KEY

    token = os.environ.get("TANDEM_INTERNAL_TOKEN")
    metadata = ((INTERNAL_TOKEN_KEY, token),) if token else ()

    def ready() -> bool:
        if not _serving(address):
            return False
        with grpc.insecure_channel(scheduler) as channel:
            stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(
                scheduler_pb2.SchedulerStatsRequest(), timeout=1.0, metadata=metadata)
        return address in {worker.info.address for worker in stats.workers}

    return ready


def _redis_ping(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=0.5) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")


def _devices(device: str, count: int) -> list[str]:
    """One device per worker: `device` for all, or with "auto" the GPUs round-robin (cpu without any)."""
    if device != "auto":
        return [device] * count
    gpus = _gpu_count()
    return [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(count)]


def _gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else those nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
