"""`tandem up`'s supervision with stand-in services (a scheduler with a registry, workers that
register, the real gateway): start order and output, a child dying during start, a worker dying
after `ready`, and a clean stop with no process left. The real mesh: tests/integration/test_up.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from services.common.health_cli import check
from tandem.up import Endpoint, _devices

REPO = Path(__file__).resolve().parents[2]
# A `services` package that puts stand-ins for scheduler, prefill and decode in front of the real
# services (common, gateway) by extending its __path__.
FAKE_INIT = f"__path__ = [__path__[0], {str(REPO / 'services')!r}]\n"
FAKE_COMMON = '''
import asyncio, os
import grpc
from services.common.grpc_server import create_server
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

def add_arguments(parser):
    for flag in ("--host", "--port", "--advertise", "--scheduler", "--model", "--threads", "--device",
                 "--metrics-port", "--redis-url"):
        parser.add_argument(flag)

class Registry(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self):
        self.workers = []
    async def RegisterWorker(self, request, context):
        self.workers.append(request.worker)
        return scheduler_pb2.RegisterWorkerResponse()
    async def Stats(self, request, context):
        return scheduler_pb2.SchedulerStats(workers=[scheduler_pb2.WorkerStatus(info=w) for w in self.workers])

async def serve(args, role):
    if os.environ.get("FAKE_FAIL") == role:
        raise SystemExit(f"{role}: failing on purpose")
    server = create_server(args.host, int(args.port))
    if role == "scheduler":
        server.add_service("tandem.v1.SchedulerService",
                           scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, Registry())
    await server.start()
    if role != "scheduler":
        async with grpc.aio.insecure_channel(args.scheduler) as channel:
            info = scheduler_pb2.WorkerInfo(worker_id=args.advertise, address=args.advertise)
            await scheduler_pb2_grpc.SchedulerServiceStub(channel).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(worker=info))
    await server.mark_serving()
    await server.run_until_signal(grace=1)
'''
FAKE_MAIN = '''
import asyncio
from services.fake import add_arguments, serve

def main(args):
    asyncio.run(serve(args, {role!r}))
    return 0
'''


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fakes")
    package = root / "services"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_INIT)
    (package / "fake.py").write_text(FAKE_COMMON)
    for role in ("scheduler", "prefill", "decode"):
        (package / role).mkdir()
        (package / role / "__init__.py").write_text("")
        (package / role / "main.py").write_text(FAKE_MAIN.format(role=role))
    return root


def start_up(fakes: Path, tmp_path: Path, *flags: str, fail: str = "") -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(fakes), "TANDEM_RUN_DIR": str(tmp_path / "run"), "FAKE_FAIL": fail}
    argv = [sys.executable, "-m", "tandem.cli", "up", "--grpc-port", "0", "--http-port", "0", "--model",
            str(tmp_path), *flags]
    # cwd outside the repository: `python -m` puts the cwd first on sys.path, before the stand-ins.
    return subprocess.Popen(argv, cwd=fakes, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.fixture
def model_dir(tmp_path: Path, default_model_dir: Path) -> Iterator[Path]:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(default_model_dir / name)
    yield tmp_path


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_a_child_dying_during_start_stops_the_rest_and_shows_its_log(fakes, model_dir):
    up = start_up(fakes, model_dir, fail="decode")
    try:
        out, err = up.communicate(timeout=120)
    finally:
        stop(up)
    assert up.returncode == 1
    assert "ready" not in out
    assert "tandem up: decode-0 exited with status 1" in err
    assert err.rstrip().endswith("decode: failing on purpose")
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(model_dir) in " ".join(p.info["cmdline"] or [])]


def test_up_prints_endpoints_survives_a_dead_worker_and_stops_cleanly(fakes, model_dir):
    up = start_up(fakes, model_dir, "--prefill", "2", "--redis-url", "redis://127.0.0.1:1/0")
    try:
        assert up.stdout is not None
        lines = [line.rstrip("\n") for line in iter(up.stdout.readline, "ready\n")]
        rows = [line.split() for line in lines]
        assert [(r[0], r[1]) for r in rows] == [
            ("redis", "redis"), ("scheduler", "grpc"), ("scheduler", "metrics"), ("prefill-0", "grpc"),
            ("prefill-0", "metrics"), ("prefill-1", "grpc"), ("prefill-1", "metrics"), ("decode-0", "grpc"),
            ("decode-0", "metrics"), ("gateway", "grpc"), ("gateway", "http"), ("gateway", "metrics")]
        assert rows[0][2] == "redis://127.0.0.1:1/0" and len(rows[0]) == 3  # given, not started: no pid
        pids = {r[0]: int(r[4]) for r in rows if r[1] == "grpc"}
        assert all(check(r[2]) == "SERVING" for r in rows if r[1] == "grpc")
        children = psutil.Process(up.pid).children(recursive=True)
        assert set(pids.values()) == {child.pid for child in children}

        os.kill(pids["decode-0"], signal.SIGKILL)
        time.sleep(1.5)
        assert up.poll() is None and check(rows[-3][2]) == "SERVING"
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
    finally:
        stop(up)
    assert up.returncode == 0
    assert "tandem up: decode-0 exited with status -9" in err
    assert psutil.wait_procs(children, timeout=5)[1] == []


def test_endpoint_line_and_devices():
    assert Endpoint("prefill-0", "grpc", "127.0.0.1:5", 42).line() == "prefill-0   grpc    127.0.0.1:5  pid 42"
    assert _devices("cpu", 2) == ["cpu", "cpu"]
    assert _devices("cuda:1", 1) == ["cuda:1"]


def test_auto_devices_round_robin_over_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert _devices("auto", 3) == ["cuda:0", "cuda:1", "cuda:0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _devices("auto", 2) == ["cpu", "cpu"]
