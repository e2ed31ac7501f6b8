"""`tandem up`'s supervision with stand-in services (a scheduler with a registry, workers that
register, the real gateway): start order and output, a child dying during start, a worker killed
after `ready` and restarted, a crash loop that makes it give up, and a clean stop with no process
left; the restart backoff with an injected clock. The real mesh: tests/integration/test_up.py and
tests/integration/test_self_healing.py.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import psutil
import pytest

from services.common.health_cli import check
from services.common.tls import MutualTLS
from tandem.cli.supervisor import Backoff, Child, RestartPolicy, StopRequest, Supervisor, stop_all
from tandem.cli.up import Endpoint, LocalSystem, UpConfig, _device_env, _devices, add_arguments, role_flags
from tests.certificates import CertificateAuthority
from tests.clock import FakeClock
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
# A `services` package that puts stand-ins for scheduler, prefill and decode in front of the real
# services (common, gateway) by extending its __path__.
FAKE_INIT = f"__path__ = [__path__[0], {str(REPO / 'services')!r}]\n"
FAKE_COMMON = '''
import asyncio, os
from pathlib import Path
import grpc
from services.common.channels import internal_channel
from services.common.grpc_server import create_server
from services.common.tls import mutual_tls
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

def add_arguments(parser):
    for flag in ("--host", "--port", "--advertise", "--scheduler", "--model", "--threads", "--device",
                 "--dtype", "--quantization", "--metrics-port", "--redis-url"):
        parser.add_argument(flag)

class Registry(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self):
        self.workers = []
    async def RegisterWorker(self, request, context):
        self.workers.append(request.worker)
        return scheduler_pb2.RegisterWorkerResponse()
    async def Stats(self, request, context):
        return scheduler_pb2.SchedulerStats(workers=[scheduler_pb2.WorkerStatus(info=w) for w in self.workers])

def internal_tls():  # the internal plane's mutual TLS, when the environment gives it, as services read it
    files = [os.environ.get(f"TANDEM_INTERNAL_TLS_{name}") for name in ("CA", "CERT", "KEY")]
    return mutual_tls(*(Path(f) if f else None for f in files))

async def serve(args, role):
    tls = internal_tls()
    if os.environ.get("FAKE_FAIL") == role:
        raise SystemExit(f"{role}: failing on purpose")
    if os.environ.get("FAKE_CRASH_ON_RESTART") == role:
        marker = Path(os.environ["TANDEM_RUN_DIR"]) / f"{role}.started"
        if marker.exists():
            raise SystemExit(f"{role}: failing on restart on purpose")
        marker.touch()
    server = create_server(args.host, int(args.port), credentials=tls.server_credentials() if tls else None)
    if role == "scheduler":
        server.add_service("tandem.v1.SchedulerService",
                           scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, Registry())
    await server.start()
    if role != "scheduler":
        async with internal_channel(args.scheduler, tls=tls) as channel:
            info = scheduler_pb2.WorkerInfo(worker_id=args.advertise, address=args.advertise,
                                             role=common_pb2.WorkerRole.Value(f"WORKER_ROLE_{role.upper()}"),
                                             model=Path(args.model).name)  # as the gateway's health expects
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


def start_up(fakes: Path, tmp_path: Path, *flags: str, fail: str = "", crash_on_restart: str = "",
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(fakes), "TANDEM_RUN_DIR": str(tmp_path / "run"), "FAKE_FAIL": fail,
           "FAKE_CRASH_ON_RESTART": crash_on_restart, **(env or {})}
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


def read_until_ready(up: subprocess.Popen[str]) -> list[list[str]]:
    """The endpoint lines `tandem up` prints before `ready`, split into fields."""
    assert up.stdout is not None
    rows = []
    for line in up.stdout:
        if line == "ready\n":
            return rows
        rows.append(line.split())
    _, err = up.communicate(timeout=30)
    pytest.fail(f"tandem up exited with {up.returncode} before ready:\n{err}")


def pump(stream: IO[str] | None) -> queue.Queue[str]:
    """The stream's lines, as they come, on a queue (read by a daemon thread)."""
    lines: queue.Queue[str] = queue.Queue()
    assert stream is not None
    threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in stream], daemon=True).start()
    return lines


def wait_line(lines: queue.Queue[str], prefix: str, seen: list[str], timeout: float = 60) -> str:
    """The first line starting with `prefix` (every line read goes to `seen`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"no line starting {prefix!r} within {timeout} s; got:\n" + "\n".join(seen))
        seen.append(line)
        if line.startswith(prefix):
            return line


def test_up_prints_endpoints_restarts_a_killed_worker_and_stops_cleanly(fakes, model_dir):
    up = start_up(fakes, model_dir, "--prefill", "2", "--redis-url", "redis://127.0.0.1:1/0")
    try:
        rows = read_until_ready(up)
        assert [(r[0], r[1]) for r in rows] == [
            ("redis", "redis"), ("scheduler", "grpc"), ("scheduler", "metrics"), ("prefill-0", "grpc"),
            ("prefill-0", "metrics"), ("prefill-1", "grpc"), ("prefill-1", "metrics"), ("decode-0", "grpc"),
            ("decode-0", "metrics"), ("gateway", "grpc"), ("gateway", "http"), ("gateway", "metrics")]
        assert rows[0][2] == "redis://127.0.0.1:1/0" and len(rows[0]) == 3  # given, not started: no pid
        pids = {r[0]: int(r[4]) for r in rows if r[1] == "grpc"}
        assert all(check(r[2]) == "SERVING" for r in rows if r[1] == "grpc")
        children = psutil.Process(up.pid).children(recursive=True)
        assert set(pids.values()) == {child.pid for child in children}

        errors, seen = pump(up.stderr), []
        os.kill(pids["decode-0"], signal.SIGKILL)
        assert wait_line(errors, "tandem up: decode-0 exited with status", seen) == (
            f"tandem up: decode-0 exited with status -9 (log {model_dir / 'run' / 'decode-0.log'})")  # it logged nothing
        assert wait_line(errors, "tandem up: restarting", seen) == (
            "tandem up: restarting decode-0 in 0.5 s (restart 1 of at most 5 in a row)")
        restarted = int(wait_line(errors, "tandem up: decode-0 restarted, pid ", seen).rsplit(" ", 1)[1])
        assert wait_line(errors, "tandem up: decode-0 is ready again", seen) == (
            f"tandem up: decode-0 is ready again (pid {restarted})")
        decode = next(r[2] for r in rows if r[0] == "decode-0" and r[1] == "grpc")
        assert restarted != pids["decode-0"] and check(decode) == "SERVING"
        assert up.poll() is None and check(rows[-3][2]) == "SERVING"
        children = psutil.Process(up.pid).children(recursive=True)
        assert restarted in {child.pid for child in children}
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        stop(up)
    assert psutil.wait_procs(children, timeout=5)[1] == []


def test_up_comes_up_when_the_internal_plane_runs_on_mutual_tls(fakes, model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("internal-tls")
    issued = CertificateAuthority.create(directory).issue(directory, "tandem-service")
    env = {"TANDEM_INTERNAL_TLS_CA": str(issued.ca), "TANDEM_INTERNAL_TLS_CERT": str(issued.cert),
           "TANDEM_INTERNAL_TLS_KEY": str(issued.key)}
    up = start_up(fakes, model_dir, "--start-timeout", "60", env=env)
    try:
        addresses = {row[0]: row[2] for row in read_until_ready(up) if row[1] == "grpc"}
        tls = MutualTLS(*issued.pem())
        for name in ("scheduler", "prefill-0", "decode-0"):
            assert check(addresses[name], tls=tls) == "SERVING", name
            with pytest.raises(grpc.RpcError):  # it serves mutual TLS only: a plaintext question gets no answer
                check(addresses[name])
        assert check(addresses["gateway"]) == "SERVING"  # the public door: plaintext without --tls-cert
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        stop(up)


def test_a_crash_loop_gives_up_after_max_restarts_and_stops_everything(fakes, model_dir):
    up = start_up(fakes, model_dir, "--max-restarts", "2", crash_on_restart="scheduler")
    try:
        rows = read_until_ready(up)
        children = psutil.Process(up.pid).children(recursive=True)
        os.kill(next(int(r[4]) for r in rows if r[:2] == ["scheduler", "grpc"]), signal.SIGKILL)
        _, err = up.communicate(timeout=120)
    finally:
        stop(up)
    assert up.returncode == 1
    said = [line for line in err.splitlines() if line.startswith(("tandem up: scheduler", "tandem up: restarting"))]
    assert said[0].startswith("tandem up: scheduler exited with status -9")
    assert said[1:] == [
        "tandem up: restarting scheduler in 0.5 s (restart 1 of at most 2 in a row)",
        said[2],
        said[3],
        "tandem up: restarting scheduler in 1.0 s (restart 2 of at most 2 in a row)",
        said[5],
        said[6],
        "tandem up: scheduler exited 3 time(s) in a row, each within 30 s of its start, after 2 restart(s) "
        "(--max-restarts); giving up and stopping everything"]
    assert said[2].startswith("tandem up: scheduler restarted, pid ")
    assert said[3].startswith("tandem up: scheduler exited with status 1")
    # the log tails said: after the first restart its one failure, after the second both (the log is appended)
    assert err.count("scheduler: failing on restart on purpose") == 1 + 2
    assert psutil.wait_procs(children, timeout=5)[1] == []


def test_backoff_doubles_up_to_the_cap_then_gives_up_and_resets_after_a_stable_run():
    clock = FakeClock()
    backoff = Backoff(RestartPolicy(max_restarts=8, first_delay_s=0.5, max_delay_s=30.0, stable_s=30.0), clock)
    backoff.started()
    delays = []
    for _ in range(9):
        clock.now += 29.9  # each run ends just short of stable
        delays.append(backoff.failed())
        backoff.started()
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, None]

    clock.now += 30.0  # a run of stable_s starts the count afresh
    assert backoff.failed() == 0.5 and backoff.failures == 1
    assert Backoff(RestartPolicy(max_restarts=0), clock).failed() is None
    assert RestartPolicy(max_restarts=10_000).delay(10_000) == 30.0


def test_supervisor_restarts_a_dead_child_with_the_same_command_and_environment(tmp_path):
    clock, said = FakeClock(), []
    script = "import os, time; print('run', os.environ['MARK'], flush=True); time.sleep(120)"
    child = Child("svc", [sys.executable, "-c", script], tmp_path / "svc.log", ready=lambda: True)
    child.start({**os.environ, "MARK": "m1"})
    supervisor = Supervisor([child], RestartPolicy(max_restarts=2), clock, said.append)
    log = tmp_path / "svc.log"
    try:
        pids = [child.pid]
        for failure, delay in ((1, 0.5), (2, 1.0)):
            clock.now += 1.0
            # it runs with the environment given
            wait_until(lambda: log.read_text().count("run m1") == failure, f"run {failure} of svc")
            kill_and_wait(child)
            assert supervisor.check() and said.pop(0).startswith("svc exited with status -9 (log ")
            assert said == [f"restarting svc in {delay} s (restart {failure} of at most 2 in a row)"]
            clock.now += delay - 0.01
            assert supervisor.check() and len(said) == 1 and child.exit_code() == -9  # not yet
            clock.now += 0.01
            assert supervisor.check()
            pids.append(child.pid)
            assert said[1:] == [f"svc restarted, pid {child.pid}"]
            assert supervisor.check() and said[2:] == [f"svc is ready again (pid {child.pid})"]
            said.clear()
        wait_until(lambda: log.read_text().count("run m1") == 3, "run 3 of svc")
        assert log.read_text().splitlines() == [
            "run m1", "", "--- tandem up: restarting svc after exit status -9 ---", "run m1",
            "", "--- tandem up: restarting svc after exit status -9 ---", "run m1"]
        assert len(set(pids)) == 3

        kill_and_wait(child)
        assert not supervisor.check()
        assert said[1:] == ["svc exited 3 time(s) in a row, each within 30 s of its start, after 2 restart(s) "
                            "(--max-restarts); giving up and stopping everything"]
    finally:
        stop_all([[child]], grace=5)


def kill_and_wait(child: Child) -> None:
    os.kill(child.pid, signal.SIGKILL)
    assert child.process is not None
    child.process.wait(timeout=30)


def test_endpoint_line_and_devices():
    assert Endpoint("prefill-0", "grpc", "127.0.0.1:5", 42).line() == "prefill-0   grpc    127.0.0.1:5  pid 42"
    assert _devices("cpu", 2) == ["cpu", "cpu"]
    assert _devices("cuda:1", 1) == ["cuda:1"]


def test_a_signal_handler_setting_the_stop_request_wakes_its_waiter_at_once():
    # `tandem up` sets it from its SIGTERM handler, which runs on the main thread inside wait():
    # a threading.Event deadlocks there when the signal lands while wait() holds the Event's lock.
    stop = StopRequest()
    previous = signal.signal(signal.SIGALRM, lambda *_: stop.set())
    try:
        assert not stop.wait(0.01) and not stop.is_set()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        started = time.monotonic()
        assert stop.wait(60) and stop.is_set()
        assert time.monotonic() - started < 30  # woken by the handler, not by the timeout
        for _ in range(100_000):  # set() never blocks, however many wake-ups are pending
            stop.set()
        assert stop.wait(60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        stop.close()


def test_auto_devices_round_robin_over_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert _devices("auto", 3) == ["cuda:0", "cuda:1", "cuda:0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _devices("auto", 2) == ["cpu", "cpu"]


def test_up_says_how_long_each_service_took_to_come_up(fakes, model_dir):
    up = start_up(fakes, model_dir, "--redis-url", "redis://127.0.0.1:1/0")
    try:
        rows = read_until_ready(up)
        up.send_signal(signal.SIGTERM)
        _, err = up.communicate(timeout=60)
    finally:
        stop(up)
    pids = {r[0]: r[4] for r in rows if r[1] == "grpc"}
    started = [line.split() for line in err.splitlines() if line.startswith("tandem up: started ")]
    # tandem up: started NAME in S.S s (pid PID), tier by tier: the scheduler, the workers, the gateway;
    # the workers of one tier start together, so theirs come in the order they get ready
    said = [(words[3], words[8].rstrip(")")) for words in started]
    tiers = [["scheduler"], ["decode-0", "prefill-0"], ["gateway"]]
    assert [sorted(said[:1]), sorted(said[1:3]), said[3:]] == [[(name, pids[name]) for name in tier] for tier in tiers]
    assert all(words[4] == "in" and float(words[5]) >= 0 and words[6:7] == ["s"] for words in started)


def test_each_gpu_worker_sees_only_its_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _device_env("cpu") == ("cpu", {})
    assert _device_env("cuda:1") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})
    assert _device_env("cuda") == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "0"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 6")  # N indexes the launcher's own visible GPUs
    assert [_device_env(device) for device in _devices("auto", 3)] == [
        ("cuda:0", {"CUDA_VISIBLE_DEVICES": "4"}), ("cuda:0", {"CUDA_VISIBLE_DEVICES": "6"}),
        ("cuda:0", {"CUDA_VISIBLE_DEVICES": "4"})]
    with pytest.raises(ValueError) as raised:
        _device_env("cuda:2")
    assert str(raised.value) == ("--device cuda:2: CUDA_VISIBLE_DEVICES='4, 6' shows 2 GPU(s); pick one of "
                                 "cuda:0..cuda:1 or unset CUDA_VISIBLE_DEVICES")
    with pytest.raises(ValueError, match=r"^--device cuda:x: use cpu, cuda, cuda:N \(N a GPU number\) or auto$"):
        _device_env("cuda:x")


def test_a_child_runs_with_its_own_environment_over_the_launchers(tmp_path):
    script = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['TANDEM_X'])"
    child = Child("svc", [sys.executable, "-c", script], tmp_path / "svc.log", ready=lambda: True,
                  env={"CUDA_VISIBLE_DEVICES": "3"})
    child.start({**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3", "TANDEM_X": "x"})
    wait_until(lambda: child.exit_code() is not None, "svc to exit")
    assert child.exit_code() == 0
    assert (tmp_path / "svc.log").read_text() == "3 x\n"


def test_one_slo_target_without_the_other_is_refused_before_anything_starts(fakes, model_dir):
    up = start_up(fakes, model_dir, "--slo-ttft-ms", "2000")
    try:
        out, err = up.communicate(timeout=60)
    finally:
        stop(up)
    assert (up.returncode, out) == (2, "")
    assert err.strip().splitlines()[-1] == "tandem up: give both --slo-ttft-ms and --slo-itl-ms, or neither"


def test_several_schedulers_without_redis_are_refused_before_anything_starts(monkeypatch, capsys):
    import argparse

    from tandem.cli import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    monkeypatch.setattr(up.shutil, "which", lambda name: None)
    assert up.main(parser.parse_args(["--schedulers", "2"])) == 2
    assert capsys.readouterr().err == (
        "tandem up: --schedulers 2 needs Redis, which the replicas share (the embedded store lives in one "
        "scheduler's process); give --redis-url or install redis-server\n")


def test_hybrid_mode_starts_decode_workers_that_prefill_too() -> None:
    assert [role_flags("hybrid", role) for role in ("prefill", "decode")] == [[], ["--hybrid"]]
    assert role_flags("disaggregated", "decode") == [] and role_flags("colocated", "colocated") == []


def test_children_take_the_users_openmp_wait_policy_and_no_other(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    config = UpConfig(**{name: getattr(args, name) for name in UpConfig.__dataclass_fields__})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert "OMP_WAIT_POLICY" not in LocalSystem(config, tmp_path, tmp_path / "logs", "t")._env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert LocalSystem(config, tmp_path, tmp_path / "logs", "t")._env["OMP_WAIT_POLICY"] == "PASSIVE"
