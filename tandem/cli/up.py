"""`tandem up`: the whole system on this machine. Starts Redis (when redis-server is installed, else
the scheduler's embedded store), the scheduler, the workers and the gateway as child processes,
waits until each answers, prints one line per endpoint and then `ready`, restarts any that exits
(tandem/cli/supervisor.py says how), and stops them all on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

from services.common.config import parse_count
from services.common.gguf_source import weights_line
from services.common.paths import run_dir
from services.common.tls import MutualTLS, mutual_tls
from tandem.cli.ports import free_port
from tandem.cli.supervisor import (
    Child, Interrupted, RestartPolicy, StartFailed, StopRequest, Supervisor, stop_all, wait_ready,
)
from tandem.cli.topology import scheduler_name
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# `tandem up` settles these for its children: they get the token itself, never a file or "insecure".
_AUTH_VARIABLES = ("TANDEM_INTERNAL_TOKEN", "TANDEM_INTERNAL_TOKEN_FILE", "TANDEM_INSECURE_INTERNAL")
WORKER_ROLES = {"disaggregated": ("prefill", "decode"), "colocated": ("colocated",), "hybrid": ("prefill", "decode")}


@dataclass(frozen=True, slots=True)
class UpConfig:
    mode: str  # "disaggregated" | "colocated" | "hybrid" (decode workers that may prefill, see role_flags)
    prefill: int
    decode: int
    workers: int  # colocated workers
    model: Path | None  # None: the default model, converted on first use
    host: str
    grpc_port: int  # 0: any free port
    http_port: int
    redis_url: str | None
    threads_per_worker: int | None
    dtype: str  # services/runtime/precision.py; "auto" is probed here once, then by each worker from the cache
    quantization: str
    device: str  # "auto": one GPU per worker round-robin when there are GPUs, else cpu
    start_timeout: float
    stop_grace: float
    max_restarts: int  # restarts of one service in a row before giving up (see RestartPolicy)
    internal_token_file: Path | None  # None: TANDEM_INTERNAL_TOKEN, else a random token for this run
    slo_ttft_ms: float = 0.0  # with slo_itl_ms: the scheduler sets each worker's batching policy (0: off)
    slo_itl_ms: float = 0.0
    schedulers: int = 1  # replicas; several share Redis (the workers report to each, the gateway chooses by prefix)
    placement: str = "cost"  # the scheduler's --placement (services/scheduler/model_placement.py)

    @property
    def connect_host(self) -> str:
        """Where the launcher and the services reach each other."""
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host

    @property
    def worker_threads(self) -> int:
        return self.threads_per_worker or max(1, (os.cpu_count() or 1) // sum(self.worker_counts().values()))

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
                        help="separate prefill and decode workers, colocated ones, or hybrid: prefill workers and "
                             "decode workers that prefill a request themselves when the scheduler finds it short "
                             "enough (default disaggregated)")
    parser.add_argument("--prefill", type=parse_count, default=1,
                        help="prefill workers (disaggregated, hybrid; default 1)")
    parser.add_argument("--decode", type=parse_count, default=1,
                        help="decode workers (disaggregated, hybrid; default 1)")
    parser.add_argument("--workers", type=parse_count, default=1, help="colocated workers (colocated; default 1)")
    parser.add_argument("--schedulers", type=parse_count, default=1,
                        help="scheduler replicas (default 1); several need Redis (--redis-url or redis-server "
                             "installed): they share the registry, the prefix index and the load view through it")
    parser.add_argument("--model", type=Path, default=os.environ.get("TANDEM_MODEL") or None,
                        help="model directory, or a .gguf file (converted once under $TANDEM_HOME/models; int4 takes "
                             "its Q4_1 groups as they are) (env TANDEM_MODEL; default: the default model)")
    parser.add_argument("--host", default="127.0.0.1", help="address every service listens on (default 127.0.0.1)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port; 0 picks a free one")
    parser.add_argument("--http-port", type=int, default=8000, help="gateway HTTP port; 0 picks a free one")
    parser.add_argument("--redis-url", default=os.environ.get("TANDEM_REDIS_URL") or None,
                        help="use this Redis (env TANDEM_REDIS_URL); default: start redis-server if installed, "
                             "with the internal token as its password, else the scheduler's embedded store")
    parser.add_argument("--internal-token-file", type=Path,
                        default=os.environ.get("TANDEM_INTERNAL_TOKEN_FILE") or None, metavar="FILE",
                        help="file holding the internal token every service shares (env TANDEM_INTERNAL_TOKEN_FILE, "
                             "or the token itself in TANDEM_INTERNAL_TOKEN); default: a random token for this run")
    parser.add_argument("--threads-per-worker", type=parse_count, default=None,
                        help="CPU threads of each worker (default: the cores shared evenly)")
    parser.add_argument("--dtype", default=os.environ.get("TANDEM_DTYPE") or "auto",
                        choices=("auto", "float32", "bfloat16", "float16"),
                        help="workers' activations and KV cache (env TANDEM_DTYPE); auto (default): bfloat16 on "
                             "CUDA, on a CPU what a probe of this machine finds fastest")
    parser.add_argument("--quantization", default=os.environ.get("TANDEM_QUANTIZATION") or "auto",
                        choices=("auto", "none", "int8", "int4"),
                        help="workers' weight-only quantization (env TANDEM_QUANTIZATION); auto (default): as the probe finds")
    parser.add_argument("--device", default="auto",
                        help="worker device: cpu, cuda:N, or auto (a GPU each, round-robin, when there are GPUs)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for each stage")
    parser.add_argument("--stop-grace", type=float, default=10.0, help="seconds each stage gets to stop")
    parser.add_argument("--slo-ttft-ms", type=float, default=0.0,
                        help="time-to-first-token target, with --slo-itl-ms: the scheduler sets each worker's batching "
                             "policy from the step-cost model the worker measures (default 0: off)")
    parser.add_argument("--slo-itl-ms", type=float, default=0.0, help="inter-token latency target (default 0: off)")
    parser.add_argument("--placement", choices=("cost", "latency"), default="cost",
                        help="the scheduler's model placement: cost (models share workers, load on demand) or latency "
                             "(only models provisioned with `tandem models provision` are served; default cost)")
    policy = RestartPolicy()
    parser.add_argument("--max-restarts", type=_non_negative, default=policy.max_restarts,
                        help="a service that exits is restarted with backoff; after this many restarts in a row "
                             f"(each exiting within {policy.stable_s:.0f} s of its start) everything stops; "
                             f"0: never restart (default {policy.max_restarts})")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def main(args: argparse.Namespace) -> int:
    config = UpConfig(**{name: getattr(args, name) for name in UpConfig.__dataclass_fields__})
    if bool(config.slo_ttft_ms) != bool(config.slo_itl_ms):
        print("tandem up: give both --slo-ttft-ms and --slo-itl-ms, or neither", file=sys.stderr)
        return 2
    if config.schedulers > 1 and not config.redis_url and shutil.which("redis-server") is None:
        print(f"tandem up: --schedulers {config.schedulers} needs Redis, which the replicas share (the embedded "
              "store lives in one scheduler's process); give --redis-url or install redis-server", file=sys.stderr)
        return 2
    try:
        token = _internal_token(config.internal_token_file)
        internal_tls = _internal_tls()
    except ValueError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    try:
        model_dir = _model_dir(config.model)
    except RuntimeError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"tandem up: precision {_precision(config, model_dir)}", file=sys.stderr, flush=True)
        print(f"tandem up: weights {weights_line(model_dir)}", file=sys.stderr, flush=True)
        for device in _devices(config.device, sum(config.worker_counts().values())):
            _device_env(device)  # a GPU CUDA_VISIBLE_DEVICES hides fails here, before any service starts
    except ValueError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    stop = StopRequest()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    system = LocalSystem(config, model_dir, run_dir(), token, internal_tls)
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
        stop.close()


def _precision(config: UpConfig, model_dir: Path) -> str:
    """The workers' precision as they will resolve it: probed here first (the workers then read the
    probe's cache), so the machine is measured before any model loads."""
    if "auto" not in (config.dtype, config.quantization):
        given = config.dtype if config.quantization == "none" else f"{config.dtype}+{config.quantization}"
        return f"{given} (given)"
    import torch

    from services.common.model_config import ModelConfig
    from services.runtime.precision import resolve
    from services.worker.main_common import DEFAULT_CHUNK_SIZE, DEFAULT_MAX_BATCHED_TOKENS

    torch.set_num_threads(config.worker_threads)
    device = _devices(config.device, 1)[0]
    return resolve(config.dtype, config.quantization, device, ModelConfig.from_model_dir(model_dir),
                   min(DEFAULT_CHUNK_SIZE, DEFAULT_MAX_BATCHED_TOKENS)).line()


def _model_dir(model: Path | None) -> Path:
    """The model directory to serve: the one given, a .gguf file's conversion (made once, under
    $TANDEM_HOME/models), or the default model's."""
    from services.common.model_store import ensure_default_model, ensure_gguf_model

    if model is None:
        return ensure_default_model()
    return ensure_gguf_model(model) if model.suffix == ".gguf" else model


def _internal_token(token_file: Path | None) -> str:
    """The token given (TANDEM_INTERNAL_TOKEN or the file), else a new random one for this run."""
    from services.common.internal_auth import TOKEN_ENV, read_token

    given = read_token(os.environ.get(TOKEN_ENV), token_file)
    if given is not None:
        return given
    print("tandem up: generated a random internal token for this run (set TANDEM_INTERNAL_TOKEN to choose one)",
          file=sys.stderr)
    return secrets.token_urlsafe(32)


def _internal_tls() -> MutualTLS | None:
    """The internal plane's mutual TLS that the children read from the environment this launcher
    hands them (TANDEM_INTERNAL_TLS_*), for asking them whether they are up; TLSConfigError when incomplete."""
    files = [os.environ.get(f"TANDEM_INTERNAL_TLS_{name}") for name in ("CA", "CERT", "KEY")]
    return mutual_tls(*(Path(f) if f else None for f in files), os.environ.get("TANDEM_INTERNAL_TLS_SERVER_NAME"))


class LocalSystem:
    """The children of one `tandem up`, started tier by tier: redis, scheduler, workers, gateway.

    A tier starts once the one before is ready; workers are ready when they report SERVING and
    the scheduler lists them, so `ready` means a request can be served.
    """

    def __init__(self, config: UpConfig, model_dir: Path, logs: Path, token: str,
                 internal_tls: MutualTLS | None = None) -> None:
        self.config = config
        self.model_dir = model_dir
        self.logs = logs
        self.token = token
        self.internal_tls = internal_tls  # the scheduler and workers then answer only over it
        self.tiers: list[list[Child]] = []
        self.endpoints: list[Endpoint] = []
        # Secrets go to the children by environment, which `ps` does not show (argv it does).
        inherited = {k: v for k, v in os.environ.items() if k not in _AUTH_VARIABLES}
        # OpenMP's wait policy is left to the user (OMP_WAIT_POLICY passes through): threads that spin
        # briefly at their barriers, libgomp's default, run a batch-1 bf16+int4 step in 6.8 ms on 2 idle
        # cores against 16.5 ms with PASSIVE; PASSIVE pays only on a CPU other processes keep busy
        # (README "Batching under SLOs").
        self._env = {**inherited, "PYTHONUNBUFFERED": "1", "TANDEM_INTERNAL_TOKEN": token}

    def start(self, stop: StopRequest) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        print(f"tandem up: starting {self._summary()}; logs in {self.logs}", file=sys.stderr, flush=True)
        redis_url = self._start_redis(stop)
        scheduler = self._start_scheduler(redis_url, stop)
        self._start_workers(scheduler, stop)
        self._start_gateway(scheduler, stop)

    def watch(self, stop: StopRequest) -> int:
        """Until Ctrl-C/SIGTERM (0), restarting any child that exits on its own, or until one fails
        more often in a row than --max-restarts allows (1)."""
        children = [child for tier in self.tiers for child in tier]
        return Supervisor(children, RestartPolicy(max_restarts=self.config.max_restarts)).run(stop)

    def stop(self) -> None:
        stop_all(list(reversed(self.tiers)), self.config.stop_grace)

    def _summary(self) -> str:
        workers = ", ".join(f"{n} {role}" for role, n in self.config.worker_counts().items())
        return f"the scheduler, workers ({workers}) and the gateway"

    def _start_redis(self, stop: StopRequest) -> str | None:
        if self.config.redis_url:
            self.endpoints.append(Endpoint("redis", "redis", _without_password(self.config.redis_url)))
            return self.config.redis_url
        executable = shutil.which("redis-server")
        if executable is None:
            print("tandem up: redis-server not found; the scheduler uses its embedded store", file=sys.stderr)
            return None
        port = self._free_port()
        argv = [executable, str(self._redis_config()), "--port", str(port), "--bind", self.config.connect_host,
                "--save", "", "--appendonly", "no", "--dir", str(self.logs)]
        host = self.config.connect_host
        child = Child("redis", argv, self.logs / "redis.log", lambda: _redis_ping(host, port, self.token))
        self._start_tier([child], stop)
        url = f"redis://{host}:{port}/0"
        self.endpoints.append(Endpoint("redis", "redis", url, child.pid))
        return f"redis://:{quote(self.token, safe='')}@{host}:{port}/0"

    def _redis_config(self) -> Path:
        """A config file, readable by this user only, that gives Redis the internal token as its password."""
        path = self.logs / "redis.conf"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(descriptor, 0o600)  # an older file may have had wider permissions
        with os.fdopen(descriptor, "w") as config:
            config.write(f"requirepass {self.token}\n")
        return path

    def _start_scheduler(self, redis_url: str | None, stop: StopRequest) -> str:
        """The replicas ("scheduler", then "scheduler-1", ...); their addresses, comma-separated."""
        if redis_url:  # by environment: the URL carries the password
            self._env["TANDEM_REDIS_URL"] = redis_url
        slo = (["--slo-ttft-ms", str(self.config.slo_ttft_ms), "--slo-itl-ms", str(self.config.slo_itl_ms)]
               if self.config.slo_ttft_ms or self.config.slo_itl_ms else [])
        placement = ["--placement", self.config.placement] if self.config.placement != "cost" else []
        ports = [(self._free_port(), self._free_port()) for _ in range(self.config.schedulers)]
        children = [self._service(scheduler_name(i), "scheduler", port,
                                  ["--metrics-port", str(metrics_port), *slo, *placement])
                    for i, (port, metrics_port) in enumerate(ports)]
        self._start_tier(children, stop)
        for child, (port, metrics_port) in zip(children, ports, strict=True):
            self._add_grpc_endpoints(child, port, metrics_port)
        return ",".join(self._address(port) for port, _ in ports)

    def _start_workers(self, scheduler: str, stop: StopRequest) -> None:
        counts = self.config.worker_counts()
        total = sum(counts.values())
        threads = self.config.worker_threads
        devices = _devices(self.config.device, total)
        children, ports = [], []
        for role, count in counts.items():
            for index in range(count):
                port, metrics_port = self._free_port(), self._free_port()
                device, env = _device_env(devices[len(children)])
                flags = ["--advertise", self._address(port), "--scheduler", scheduler, "--model",
                         str(self.model_dir), "--threads", str(threads), "--device", device,
                         "--dtype", self.config.dtype, "--quantization", self.config.quantization,
                         "--metrics-port", str(metrics_port), *role_flags(self.config.mode, role)]
                ready = _registered_and_serving(self._address(port), scheduler.split(",")[0], self.token,
                                                self.internal_tls)
                children.append(self._service(f"{role}-{index}", role, port, flags, ready, env))
                ports.append((port, metrics_port))
        self._start_tier(children, stop)
        for child, (port, metrics_port) in zip(children, ports):
            self._add_grpc_endpoints(child, port, metrics_port)

    def _start_gateway(self, scheduler: str, stop: StopRequest) -> None:
        port = self.config.grpc_port or self._free_port()
        http_port = self.config.http_port or self._free_port()
        flags = ["--http-port", str(http_port), "--scheduler", scheduler, "--model", str(self.model_dir)]
        address = self._address(port)  # the public door: plaintext, whatever the internal plane runs on
        child = self._service("gateway", "gateway", port, flags, lambda: _serving(address))
        self._start_tier([child], stop)
        self.endpoints.append(Endpoint("gateway", "grpc", self._address(port), child.pid))
        self.endpoints.append(Endpoint("gateway", "http", f"http://{self._address(http_port)}", child.pid))
        self.endpoints.append(Endpoint("gateway", "metrics", f"http://{self._address(http_port)}/metrics"))

    def _service(self, name: str, command: str, port: int, flags: list[str],
                 ready: Callable[[], bool] | None = None, env: dict[str, str] | None = None) -> Child:
        """A `tandem <command>` child listening on port, ready (by default) when its health says SERVING;
        `env` is laid over the launcher's environment."""
        argv = [sys.executable, "-m", "tandem.cli", command, "--host", self.config.host, "--port", str(port), *flags]
        address = self._address(port)
        ready = ready or (lambda: _serving(address, self.internal_tls))
        return Child(name, argv, self.logs / f"{name}.log", ready, env=env or {})

    def _start_tier(self, children: list[Child], stop: StopRequest) -> None:
        self.tiers.append(children)
        started = time.monotonic()
        for child in children:
            child.start(self._env)

        def progress(child: Child) -> None:  # a line per service as it comes up: model loads take minutes
            print(f"tandem up: started {child.name} in {time.monotonic() - started:.1f} s (pid {child.pid})",
                  file=sys.stderr, flush=True)

        wait_ready(children, self.config.start_timeout, stop, progress)

    def _add_grpc_endpoints(self, child: Child, port: int, metrics_port: int) -> None:
        self.endpoints.append(Endpoint(child.name, "grpc", self._address(port), child.pid))
        self.endpoints.append(Endpoint(child.name, "metrics", f"http://{self._address(metrics_port)}/metrics"))

    def _address(self, port: int) -> str:
        return f"{self.config.connect_host}:{port}"

    def _free_port(self) -> int:
        """A port free on the listen host now, outside the ephemeral range (tandem/cli/ports.py says
        why), never one handed out before in this run nor the gateway's own."""
        while True:
            port = free_port(self.config.connect_host)
            if port not in (self.config.grpc_port, self.config.http_port):
                return port


def role_flags(mode: str, role: str) -> list[str]:
    """What a mode adds to one role's flags: in hybrid mode a decode worker also serves Assign, so the
    scheduler may prefill a request there (services/scheduler/prefill_placement.py)."""
    return ["--hybrid"] if mode == "hybrid" and role == "decode" else []


def _serving(address: str, tls: MutualTLS | None = None) -> bool:
    from services.common.health_cli import SERVING, check

    return check(address, timeout=1.0, tls=tls) == SERVING


def _registered_and_serving(address: str, scheduler: str, token: str,
                            tls: MutualTLS | None) -> Callable[[], bool]:
    """A worker is ready when it is SERVING and the scheduler's registry lists its address."""
    from services.common.grpc_server import INTERNAL_TOKEN_KEY
    from services.common.health_cli import channel as health_channel

    metadata = ((INTERNAL_TOKEN_KEY, token),)

    def ready() -> bool:
        if not _serving(address, tls):
            return False
        with health_channel(scheduler, tls) as channel:
            stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(
                scheduler_pb2.SchedulerStatsRequest(), timeout=1.0, metadata=metadata)
        return address in {worker.info.address for worker in stats.workers}

    return ready


def _redis_ping(host: str, port: int, password: str) -> bool:
    with socket.create_connection((host, port), timeout=0.5) as sock:
        sock.sendall(f"AUTH {password}\r\nPING\r\n".encode())
        answer = b""
        while answer.count(b"\r\n") < 2 and (data := sock.recv(64)):
            answer += data
        return answer == b"+OK\r\n+PONG\r\n"


def _without_password(url: str) -> str:
    """'redis://:secret@host:6379/0' -> 'redis://host:6379/0', for printing."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _devices(device: str, count: int) -> list[str]:
    """One device per worker: `device` for all, or with "auto" the GPUs round-robin (cpu without any)."""
    if device != "auto":
        return [device] * count
    gpus = _gpu_count()
    return [f"cuda:{i % gpus}" if gpus else "cpu" for i in range(count)]


def _device_env(device: str) -> tuple[str, dict[str, str]]:
    """A worker's --device and its own environment: a worker on cuda:N sees only that GPU, as cuda:0,
    through CUDA_VISIBLE_DEVICES (N indexes the launcher's own CUDA_VISIBLE_DEVICES when that is set)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device, {}
    if index and not index.isdigit():
        raise ValueError(f"--device {device}: use cpu, cuda, cuda:N (N a GPU number) or auto")
    number = int(index or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return "cuda:0", {"CUDA_VISIBLE_DEVICES": str(number)}
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    if number >= len(ids):
        raise ValueError(f"--device {device}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(ids)} GPU(s); "
                         f"pick one of cuda:0..cuda:{len(ids) - 1} or unset CUDA_VISIBLE_DEVICES")
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": ids[number]}


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
