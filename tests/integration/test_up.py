"""`tandem up --prefill 1 --decode 1` as a user runs it: it prints `ready`, every printed gRPC
endpoint answers SERVING, a request is served, and SIGTERM leaves no child process behind."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from services.common.health_cli import check
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60


@dataclass(frozen=True, slots=True)
class Line:
    name: str
    kind: str
    address: str
    pid: int | None


def parse(line: str) -> Line:
    """'decode-0    grpc    127.0.0.1:41234  pid 77' -> Line('decode-0', 'grpc', '127.0.0.1:41234', 77)."""
    fields = line.split()
    pid = int(fields[4]) if len(fields) == 5 and fields[3] == "pid" else None
    return Line(fields[0], fields[1], fields[2], pid)


def read_until_ready(process: subprocess.Popen[str], timeout: float) -> list[Line]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for text in process.stdout:
            lines.put(text.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    endpoints = []
    while True:
        try:
            text = lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"`tandem up` printed no `ready` within {timeout} s")
        if text is None:
            pytest.fail(f"`tandem up` exited with {process.wait()} before `ready`")
        if text == "ready":
            return endpoints
        endpoints.append(parse(text))


@pytest.fixture
def up(tmp_path: Path, default_model_dir: Path) -> Iterator[subprocess.Popen[str]]:
    argv = [sys.executable, "-m", "tandem.cli", "up", "--prefill", "1", "--decode", "1", "--grpc-port", "0",
            "--http-port", "0", "--model", str(default_model_dir), "--threads-per-worker", "1"]
    stderr = (tmp_path / "up.stderr").open("w")
    env = {**os.environ, "TANDEM_RUN_DIR": str(tmp_path / "run")}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                               start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        stderr.close()
        print((tmp_path / "up.stderr").read_text())


def test_up_serves_and_stops_without_orphans(up):
    endpoints = read_until_ready(up, READY_TIMEOUT_S)
    grpc_endpoints = {e.name: e for e in endpoints if e.kind == "grpc"}
    assert set(grpc_endpoints) == {"scheduler", "prefill-0", "decode-0", "gateway"}
    assert [e.name for e in endpoints if e.kind == "http"] == ["gateway"]
    for endpoint in grpc_endpoints.values():
        assert check(endpoint.address) == "SERVING", endpoint

    with grpc.insecure_channel(grpc_endpoints["gateway"].address) as channel:
        request = gateway_pb2.GenerateRequest(prompt="The capital of France is",
                                              sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0))
        responses = list(gateway_pb2_grpc.GenerateServiceStub(channel).Generate(request, timeout=120))
    assert sum(len(r.token_ids) for r in responses) == 4
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    children = psutil.Process(up.pid).children(recursive=True)
    printed = {e.pid for e in endpoints if e.pid is not None}
    assert printed <= {child.pid for child in children}
    up.send_signal(signal.SIGTERM)
    assert up.wait(timeout=STOP_TIMEOUT_S) == 0
    _, alive = psutil.wait_procs(children, timeout=5)
    assert alive == []
