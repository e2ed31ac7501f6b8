"""Test harness: starts a real local Tandem mesh with `tandem up` and reaches each of its services over gRPC.

The launcher prints one line per endpoint (`NAME KIND ADDRESS [pid N]`) and then `ready`;
`Mesh` parses those lines, so the tests reach every service by its real address. The mesh runs
with `internal_token` (TANDEM_INTERNAL_TOKEN when set, else a new one), which `internal_metadata`
presents on calls to its internal services.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tandem.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

ENDPOINT = re.compile(r"^(?P<name>\S+)\s+(?P<kind>grpc|http|redis|metrics)\s+(?P<address>\S+)(?:\s+pid\s+(?P<pid>\d+))?")
START_TIMEOUT_S = 240


@dataclass(slots=True)
class Endpoint:
    name: str
    kind: str
    address: str
    pid: int | None


@dataclass
class Mesh:
    process: subprocess.Popen
    endpoints: list[Endpoint]
    internal_token: str
    log: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, *args: str, env: dict[str, str] | None = None, run_dir: Path) -> Mesh:
        environment = {**os.environ, "TANDEM_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1", **(env or {})}
        token = environment.get("TANDEM_INTERNAL_TOKEN") or secrets.token_urlsafe(32)
        environment["TANDEM_INTERNAL_TOKEN"] = token
        process = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "up", "--grpc-port", "0", "--http-port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment, start_new_session=True,
        )
        mesh = cls(process, [], token)
        mesh._read_until_ready()
        return mesh

    def _read_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.process.stdout is not None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError("tandem up exited before ready:\n" + "".join(self.log[-40:]))
            self.log.append(line)
            if line.strip() == "ready":
                threading.Thread(target=self._drain, daemon=True).start()
                return
            match = ENDPOINT.match(line.strip())
            if match:
                pid = match["pid"]
                self.endpoints.append(Endpoint(match["name"], match["kind"], match["address"], int(pid) if pid else None))
        self.stop()
        raise RuntimeError("tandem up did not print ready in time:\n" + "".join(self.log[-40:]))

    def _drain(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def endpoint(self, name: str, kind: str = "grpc") -> Endpoint:
        for ep in self.endpoints:
            if ep.name == name and ep.kind == kind:
                return ep
        raise KeyError(f"no {kind} endpoint named {name}; have {[(e.name, e.kind) for e in self.endpoints]}")

    def names(self, prefix: str) -> list[str]:
        return [ep.name for ep in self.endpoints if ep.name.startswith(prefix) and ep.kind == "grpc"]

    @property
    def http_url(self) -> str:
        address = self.endpoint("gateway", "http").address
        return address if address.startswith("http") else f"http://{address}"

    def gateway(self) -> gateway_pb2_grpc.GenerateServiceStub:
        return gateway_pb2_grpc.GenerateServiceStub(grpc.insecure_channel(self.endpoint("gateway").address))

    @property
    def internal_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata that authenticates a call to the mesh's scheduler or workers."""
        return (("x-tandem-internal-token", self.internal_token),)  # grpc_server.INTERNAL_TOKEN_KEY

    def scheduler_stats(self) -> scheduler_pb2.SchedulerStats:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(grpc.insecure_channel(self.endpoint("scheduler").address))
        return stub.Stats(scheduler_pb2.SchedulerStatsRequest(recent_routes=64), timeout=5,
                          metadata=self.internal_metadata)

    def worker_stats(self, name: str) -> worker_pb2.WorkerStats:
        channel = grpc.insecure_channel(self.endpoint(name).address)
        if name.startswith("prefill"):
            stub = worker_pb2_grpc.PrefillServiceStub(channel)
        elif name.startswith("decode"):
            stub = worker_pb2_grpc.DecodeServiceStub(channel)
        else:
            stub = worker_pb2_grpc.ColocatedServiceStub(channel)
        return stub.Stats(worker_pb2.WorkerStatsRequest(), timeout=5, metadata=self.internal_metadata)

    def wait_idle(self, timeout: float = 1.0) -> None:
        """Waits until every worker holds no referenced or reserved block and the scheduler holds no request."""
        deadline = time.monotonic() + timeout
        while True:
            busy = self._busy()
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"mesh not idle after {timeout}s: {busy}")
            time.sleep(0.05)

    def _busy(self) -> list[str]:
        busy = []
        for name in self.names("prefill") + self.names("decode") + self.names("colocated"):
            stats = self.worker_stats(name)
            if stats.referenced_blocks or stats.reserved_blocks or stats.running or stats.waiting:
                busy.append(f"{name}: referenced={stats.referenced_blocks} reserved={stats.reserved_blocks} "
                            f"running={stats.running} waiting={stats.waiting}")
        sched = self.scheduler_stats()
        if sched.running or sched.waiting:
            busy.append(f"scheduler: running={sched.running} waiting={sched.waiting}")
        return busy


def greedy_request(token_ids: list[int], max_tokens: int, **fields) -> gateway_pb2.GenerateRequest:
    from tandem.v1 import common_pb2

    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return gateway_pb2.GenerateRequest(token_ids=token_ids, sampling=sampling, **fields)


def collect(stream) -> tuple[list[int], list[gateway_pb2.GenerateResponse]]:
    messages = list(stream)
    return [t for m in messages for t in m.token_ids], messages
