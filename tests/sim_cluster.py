"""Harness for tests and bench/control_plane.py: a real scheduler and gateway on loopback with
simulated workers (`tandem sim-worker`, no model), each a child process with its log in the run
directory, started tier by tier and stopped together even when a start fails.

Several scheduler replicas (`schedulers`, with Redis: they share the registry, the prefix index and
the load view through it) each take every worker's registration and reports; the gateway sends a
request to the one its leading prefix ranks first. The first is the child "scheduler", the others "scheduler-1", ...
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.worker.sim_engine import sim_token
from tandem.cli.ports import free_port
from tandem.cli.supervisor import Child, stop_all, wait_ready
from tandem.v1 import common_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.mesh import collect, greedy_request

SIM_VOCAB = 49152  # the default model's, whose config.json the simulated workers read


def sim_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """What a simulated worker generates after `prompt`: sim_token chained from its last token."""
    tokens, previous = [], prompt[-1]
    for position in range(len(prompt), len(prompt) + max_tokens):
        previous = sim_token(previous, position, SIM_VOCAB)
        tokens.append(previous)
    return tokens


def generate(gateway: str, prompt: list[int], max_tokens: int, timeout: float) -> list[int]:
    """One greedy request through the gateway, which must run to max_tokens; its token ids."""
    with grpc.insecure_channel(gateway) as channel:
        stream = gateway_pb2_grpc.GenerateServiceStub(channel).Generate(greedy_request(prompt, max_tokens),
                                                                         timeout=timeout)
        token_ids, messages = collect(stream)
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == max_tokens
    return token_ids

START_TIMEOUT_S = 120.0
_WORKER_LINE = re.compile(r"^(?P<id>\S+) grpc (?P<address>\S+)$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class SimSpec:
    """The simulated workers of one `tandem sim-worker` process."""

    role: str = "colocated"
    count: int = 1
    step_ms: float = 5.0
    kv_blocks: int = 1024
    max_seqs: int = 64
    prefill_tokens_per_s: float = 0.0

    def flags(self) -> list[str]:
        return ["--role", self.role, "--count", str(self.count), "--step-ms", str(self.step_ms),
                "--kv-blocks", str(self.kv_blocks), "--max-seqs", str(self.max_seqs),
                "--prefill-tokens-per-s", str(self.prefill_tokens_per_s)]


@dataclass
class SimCluster:
    """Call order: `start(...)` -> use `scheduler`, `gateway`, `workers` -> `stop()`."""

    run_dir: Path
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    tiers: list[list[Child]] = field(default_factory=list)
    schedulers: list[str] = field(default_factory=list)  # every replica's address
    scheduler_metrics: list[str] = field(default_factory=list)  # every replica's /metrics address, if served
    gateway: str = ""
    http_gateway: str = ""  # the gateway's OpenAI-compatible HTTP door
    workers: dict[str, str] = field(default_factory=dict)  # worker id -> address
    children: dict[str, Child] = field(default_factory=dict)  # "scheduler", "gateway", "sim-0", ...

    @classmethod
    def start(cls, run_dir: Path, sims: list[SimSpec], *, redis_url: str | None = None, schedulers: int = 1,
              scheduler_flags: tuple[str, ...] = (), model: Path | None = None,
              dial: Callable[[str], str] = lambda address: address, metrics: bool = False) -> SimCluster:
        """`dial(scheduler_address)`: the address the workers dial for it (a test may put a relay between);
        `metrics`: each replica serves /metrics (at `scheduler_metrics`)."""
        if schedulers < 1 or (schedulers > 1 and not redis_url):
            raise ValueError(f"schedulers={schedulers}: give 1, or several with a redis_url (replicas share "
                             "their state through Redis; the embedded store is one process's)")
        cluster = cls(run_dir)
        try:
            cluster._start(sims, redis_url, scheduler_flags, model, schedulers, dial, metrics)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, sims: list[SimSpec], redis_url: str | None, scheduler_flags: tuple[str, ...],
               model: Path | None, schedulers: int, dial: Callable[[str], str], metrics: bool) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(schedulers)]
        self.schedulers = [f"127.0.0.1:{port}" for port in ports]
        metrics_ports = [free_port() if metrics else 0 for _ in ports]
        self.scheduler_metrics = [f"127.0.0.1:{port}" for port in metrics_ports if port]
        flags = [*(["--redis-url", redis_url] if redis_url else []), *scheduler_flags]
        self._tier([self._service(f"scheduler-{i}" if i else "scheduler", "scheduler", port,
                                  ["--metrics-port", str(metrics_port), *flags])
                    for i, (port, metrics_port) in enumerate(zip(ports, metrics_ports))])
        model_flags = ["--model", str(model)] if model else []
        dialled = [dial(address) for address in self.schedulers]
        self._tier([self._sim(f"sim-{i}", spec, model_flags, dialled) for i, spec in enumerate(sims)])
        for name, child in self.children.items():
            if name.startswith("sim-"):
                self.workers.update((m["id"], m["address"]) for m in _WORKER_LINE.finditer(child.log_path.read_text()))
        port, http_port = free_port(), free_port()
        self.gateway, self.http_gateway = f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"
        self._tier([self._service("gateway", "gateway", port,
                                  ["--http-port", str(http_port), "--scheduler", ",".join(self.schedulers), *model_flags])])

    def _service(self, name: str, command: str, port: int, flags: list[str]) -> Child:
        address = f"127.0.0.1:{port}"
        return self._child(name, [command, "--port", str(port), *flags], lambda: _serving(address))

    def _sim(self, name: str, spec: SimSpec, model_flags: list[str], schedulers: list[str]) -> Child:
        log_path = self.run_dir / f"{name}.log"
        argv = ["sim-worker", "--scheduler", ",".join(schedulers), *spec.flags(), *model_flags]
        return self._child(name, argv, lambda: _printed_ready(log_path))

    def _child(self, name: str, argv: list[str], ready) -> Child:
        child = Child(name, [sys.executable, "-m", "tandem.cli", *argv], self.run_dir / f"{name}.log", ready)
        self.children[name] = child
        return child

    def _tier(self, children: list[Child]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_INTERNAL_TOKEN": self.token,
               "TANDEM_RUN_DIR": str(self.run_dir)}
        env.pop("TANDEM_REDIS_URL", None)
        self.tiers.append(children)
        for child in children:
            child.start(env)
        wait_ready(children, START_TIMEOUT_S, threading.Event())

    def stop(self, grace: float = 10.0) -> None:
        stop_all(list(reversed(self.tiers)), grace)
        self.tiers = []

    @property
    def scheduler(self) -> str:
        """The first replica's address."""
        return self.schedulers[0]

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-tandem-internal-token", self.token),)  # grpc_server.INTERNAL_TOKEN_KEY

    def scheduler_stats(self, recent_routes: int = 0) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.scheduler) as channel:
            return scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(
                scheduler_pb2.SchedulerStatsRequest(recent_routes=recent_routes), timeout=10, metadata=self.metadata)

    def pid(self, name: str) -> int:
        return self.children[name].pid


def _serving(address: str) -> bool:
    from services.common.health_cli import SERVING, check

    return check(address, timeout=1.0) == SERVING


def _printed_ready(log_path: Path) -> bool:
    return "\nready\n" in "\n" + log_path.read_text(errors="replace")
