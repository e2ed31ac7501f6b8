"""Closed by default, on real processes over loopback: a service without an internal token refuses
to start, runs open only when told; a scheduler with one refuses unauthenticated calls, caps what
callers size, and listens (metrics included) on its --host only; `tandem up` hands its children a
random token by environment and makes it the password of the Redis it starts.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import psutil
import pytest
import redis

from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.health_cli import wait_until_serving
from tandem.cli import up
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.unit.test_internal_auth import NO_TOKEN

TANDEM = str(Path(sys.executable).parent / "tandem")
MISSING = "missing credentials: send `x-tandem-internal-token: <token>` metadata with a configured key"
INVALID = "invalid credentials: send `x-tandem-internal-token: <token>` metadata with a configured key"

pytestmark = pytest.mark.slow


def service_env(tmp_path: Path, **variables: str) -> dict[str, str]:
    outer = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return outer | {"TANDEM_RUN_DIR": str(tmp_path / "run"), **variables}


def listening(pid: int) -> set[tuple[str, int]]:
    process = psutil.Process(pid)
    connections = process.net_connections("tcp") if hasattr(process, "net_connections") else process.connections("tcp")
    # gRPC listens on an IPv6 socket bound to the v4-mapped address: still 127.0.0.1 only.
    return {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("command", ["scheduler", "prefill", "decode", "colocated", "gateway"])
def test_a_service_without_a_token_refuses_to_start(command: str, tmp_path: Path) -> None:
    done = subprocess.run([TANDEM, command, "--host", "127.0.0.1", "--port", "0"], env=service_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == f"tandem {command}: {NO_TOKEN}"


@dataclass(frozen=True, slots=True)
class Scheduler:
    process: subprocess.Popen[bytes]
    address: str
    port: int
    metrics_port: int
    log: Path


def start_scheduler(tmp_path: Path, *flags: str, **variables: str) -> Scheduler:
    port, metrics_port = free_port(), free_port()
    log = tmp_path / f"scheduler-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [TANDEM, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
             *flags], env=service_env(tmp_path, **variables), stdout=out, stderr=subprocess.STDOUT)
    scheduler = Scheduler(process, f"127.0.0.1:{port}", port, metrics_port, log)
    try:
        wait_until_serving(scheduler.address, timeout=60)
    except TimeoutError as exc:
        stop(scheduler.process)
        raise AssertionError(f"{exc}\n{log.read_text()}") from exc
    return scheduler


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def token() -> str:
    return secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory, token: str) -> Iterator[Scheduler]:
    started = start_scheduler(tmp_path_factory.mktemp("closed"), TANDEM_INTERNAL_TOKEN=token)
    yield started
    stop(started.process)


def calls(stub: scheduler_pb2_grpc.SchedulerServiceStub):
    """One call of each kind a stranger would try: read ids, end streams, join as a worker, submit work."""
    worker = scheduler_pb2.WorkerInfo(worker_id="fake", role=common_pb2.WORKER_ROLE_PREFILL,
                                      address="127.0.0.1:1", num_blocks=8, block_size=16)
    submit = scheduler_pb2.SubmitRequest(request_id="r", token_ids=[1, 2, 3])
    return {
        "Stats": lambda md: stub.Stats(scheduler_pb2.SchedulerStatsRequest(recent_routes=8), metadata=md, timeout=5),
        "Abort": lambda md: stub.Abort(common_pb2.AbortRequest(request_ids=["r"]), metadata=md, timeout=5),
        "RegisterWorker": lambda md: stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=worker),
                                                         metadata=md, timeout=5),
        "Heartbeat": lambda md: stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="fake"), metadata=md,
                                               timeout=5),
        "Submit": lambda md: list(stub.Submit(submit, metadata=md, timeout=5)),
        "ReportTokens": lambda md: list(stub.ReportTokens(iter([scheduler_pb2.TokenBatch(worker_id="fake")]),
                                                          metadata=md, timeout=5)),
    }


def test_the_scheduler_refuses_calls_without_the_token(scheduler: Scheduler, token: str) -> None:
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        refused = {}
        for name, call in calls(stub).items():
            for metadata, expected in (((), MISSING), (((INTERNAL_TOKEN_KEY, token[:-1]),), INVALID)):
                with pytest.raises(grpc.RpcError) as error:
                    call(metadata)
                refused[name, expected] = (error.value.code(), error.value.details())
        stats = stub.Stats(scheduler_pb2.SchedulerStatsRequest(), metadata=((INTERNAL_TOKEN_KEY, token),), timeout=5)
    assert refused == {key: (grpc.StatusCode.UNAUTHENTICATED, key[1]) for key in refused}
    assert len(refused) == 12
    assert [w.info.worker_id for w in stats.workers] == []  # the fake worker never got in


def test_caller_set_sizes_are_capped(scheduler: Scheduler, token: str) -> None:
    metadata = ((INTERNAL_TOKEN_KEY, token),)
    too_long = scheduler_pb2.WorkerInfo(worker_id="w" * 300, role=common_pb2.WORKER_ROLE_PREFILL,
                                        address="127.0.0.1:1", num_blocks=8, block_size=16)
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as abort:
            stub.Abort(common_pb2.AbortRequest(request_ids=[f"r{i}" for i in range(1025)]), metadata=metadata,
                       timeout=5)
        with pytest.raises(grpc.RpcError) as register:
            stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=too_long), metadata=metadata, timeout=5)
        stats = stub.Stats(scheduler_pb2.SchedulerStatsRequest(), metadata=metadata, timeout=5)
    assert (abort.value.code(), abort.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request_ids: at most 1024 ids per Abort, got 1025; send several Aborts")
    assert (register.value.code(), register.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "worker.worker_id: at most 256 characters, got 300")
    assert list(stats.workers) == []


def test_grpc_and_metrics_listen_on_the_configured_host_only(scheduler: Scheduler) -> None:
    assert listening(scheduler.process.pid) == {("127.0.0.1", scheduler.port), ("127.0.0.1", scheduler.metrics_port)}


def test_insecure_internal_runs_open_and_warns(tmp_path: Path) -> None:
    scheduler = start_scheduler(tmp_path, "--insecure-internal")
    try:
        with grpc.insecure_channel(scheduler.address) as channel:
            stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(
                scheduler_pb2.SchedulerStatsRequest(), timeout=5)
    finally:
        stop(scheduler.process)
    assert stats.store == "embedded"
    assert "WARNING services.common.internal_auth: INSECURE: scheduler runs with --insecure-internal" in \
        scheduler.log.read_text()


# --- `tandem up` -----------------------------------------------------------------------------------


def redis_answer(url: str, command: bytes) -> bytes:
    """What the Redis at `url` answers an unauthenticated `command`."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(256)


def up_config(*argv: str) -> up.UpConfig:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--host", "127.0.0.1", *argv])
    return up.UpConfig(**{name: getattr(args, name) for name in up.UpConfig.__dataclass_fields__})


def test_up_generates_a_new_token_each_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_INTERNAL_TOKEN", raising=False)
    first, second = up._internal_token(None), up._internal_token(None)
    assert len(first) == len(second) == 43 and first != second  # secrets.token_urlsafe(32)
    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", first)
    assert up._internal_token(None) == first


def test_up_gives_children_the_token_by_environment_and_redis_a_password(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TANDEM_INSECURE_INTERNAL", "1")  # `tandem up` overrides what it inherits
    token = secrets.token_urlsafe(32)
    (tmp_path / "logs").mkdir()
    system = up.LocalSystem(up_config(), tmp_path, tmp_path / "logs", token)
    stop_event = threading.Event()
    try:
        redis_url = system._start_redis(stop_event)
        scheduler = system._start_scheduler(redis_url, stop_event)
        redis_child, scheduler_child = (psutil.Process(tier[0].pid) for tier in system.tiers)
        noauth = redis_answer(redis_url, b"PING\r\n")
        authenticated = redis.Redis.from_url(redis_url).ping()
        with grpc.insecure_channel(scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            stats = stub.Stats(scheduler_pb2.SchedulerStatsRequest(), metadata=((INTERNAL_TOKEN_KEY, token),),
                               timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Stats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)
        environment = scheduler_child.environ()
        argv = " ".join(redis_child.cmdline() + scheduler_child.cmdline())
    finally:
        system.stop()
    assert noauth == b"-NOAUTH Authentication required.\r\n"
    assert authenticated is True
    assert (stats.store, stats.degraded) == ("redis", False)  # the scheduler got the password too
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert environment["TANDEM_INTERNAL_TOKEN"] == token and "TANDEM_INSECURE_INTERNAL" not in environment
    assert environment["TANDEM_REDIS_URL"] == redis_url
    assert token not in argv  # `ps` shows arguments to every user
    assert [e.line().split()[2] for e in system.endpoints if e.kind == "redis"] == [redis_url.replace(f":{token}@", "")]
    assert stat.S_IMODE((tmp_path / "logs" / "redis.conf").stat().st_mode) == 0o600
