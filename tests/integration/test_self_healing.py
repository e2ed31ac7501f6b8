"""Self-healing on a real mesh (`tandem up`, real redis-server, one prefill and one decode worker):
a decode worker killed with SIGKILL is restarted on its address and serves token-exact; one sent
SIGTERM mid-request finishes the request, deregisters and exits 0; a scheduler killed mid-request
loses it not (the decode worker streams it on to the gateway), is restarted, finds its workers
again and serves.
The backoff and the supervisor's messages in detail: tests/unit/test_up.py.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.health_cli import SERVING, check
from tests.hf_reference import Reference, assert_matches
from tests.mesh import Mesh, collect, greedy_request
from tandem.v1 import common_pb2

pytestmark = pytest.mark.slow

RECOVERY_TIMEOUT_S = 180  # a restarted worker loads the model again, on a busy 2-core machine
REQUEST_TIMEOUT_S = 120
# A SIGTERMed worker drains its request for as long as the request may take, not 10 s: 63 tokens on
# one thread of a loaded 2-core machine took longer (the drain test failed at load average 13).
ENV = {"TANDEM_KV_MEMORY": "256MiB", "TANDEM_THREADS": "1", "TANDEM_HEARTBEAT_TTL": "3",
       "TANDEM_SHUTDOWN_GRACE": str(REQUEST_TIMEOUT_S)}
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("self-healing")


@pytest.fixture(scope="module")
def mesh(run_dir: Path, default_model_dir: Path) -> Iterator[Mesh]:
    started = Mesh.start("--prefill", "1", "--decode", "1", "--model", str(default_model_dir), env=ENV,
                         run_dir=run_dir)
    yield started
    started.stop()
    for log in sorted(run_dir.glob("*.log")):  # shown when a test failed
        print(f"--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> Reference:
    from transformers import AutoTokenizer

    from tests.hf_reference import reference_outputs

    prompt_ids = AutoTokenizer.from_pretrained(default_model_dir)(PROMPT)["input_ids"]
    ref = reference_outputs(default_model_dir, [prompt_ids], MAX_TOKENS)[0]
    assert len(ref.tokens) == MAX_TOKENS, "the prompt must not end early: the SIGTERM test needs a long request"
    return ref


def said(mesh: Mesh, since: int, what: str, timeout: float = RECOVERY_TIMEOUT_S) -> str:
    """The first line of `tandem up: {what}...` the launcher printed after log line `since`."""
    deadline = time.monotonic() + timeout
    while True:
        for line in mesh.log[since:]:
            if line.startswith(f"tandem up: {what}"):
                return line.rstrip("\n")
        assert time.monotonic() < deadline, f"no 'tandem up: {what}' within {timeout} s:\n" + "".join(mesh.log[since:])
        time.sleep(0.1)


def back_again(mesh: Mesh, since: int, name: str) -> int:
    """Waits until `name` is ready again after a restart; its new pid (the mesh's endpoint follows it)."""
    pid = int(re.fullmatch(rf"tandem up: {name} is ready again \(pid (\d+)\)", said(mesh, since, f"{name} is ready"))[1])
    endpoint = mesh.endpoint(name)
    assert pid != endpoint.pid
    endpoint.pid = pid
    return pid


def wait_serving(mesh: Mesh) -> None:
    """Until the gateway says it can serve (its health follows the scheduler's workers)."""
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while check(mesh.endpoint("gateway").address, timeout=1.0) != SERVING:
        assert time.monotonic() < deadline, "the gateway is not SERVING again"
        time.sleep(0.1)


def registered(mesh: Mesh) -> dict[str, str]:
    """Worker address -> worker id, as the scheduler's registry lists them."""
    return {w.info.address: w.info.worker_id for w in mesh.scheduler_stats().workers}


def generate_reference(mesh: Mesh, reference: Reference) -> list[int]:
    tokens, messages = collect(mesh.gateway().Generate(greedy_request(reference.prompt_ids, MAX_TOKENS),
                                                       timeout=REQUEST_TIMEOUT_S))
    assert messages[-1].usage.completion_tokens == len(tokens)
    return tokens


def test_a_killed_decode_worker_is_restarted_on_its_address_and_serves_token_exact(mesh, reference):
    decode = mesh.endpoint("decode-0")
    since = len(mesh.log)
    os.kill(decode.pid, signal.SIGKILL)
    assert said(mesh, since, "decode-0 exited").startswith("tandem up: decode-0 exited with status -9 (log ")
    assert said(mesh, since, "restarting decode-0") == (
        "tandem up: restarting decode-0 in 0.5 s (restart 1 of at most 5 in a row)")
    back_again(mesh, since, "decode-0")
    assert decode.address in registered(mesh)
    wait_serving(mesh)
    assert_matches(generate_reference(mesh, reference), reference, "after the decode worker's restart")


def test_a_sigtermed_decode_worker_finishes_its_request_deregisters_and_exits_0(mesh, reference, run_dir):
    decode = mesh.endpoint("decode-0")
    worker_id = registered(mesh)[decode.address]
    since = len(mesh.log)
    call = mesh.gateway().Generate(greedy_request(reference.prompt_ids, MAX_TOKENS), timeout=REQUEST_TIMEOUT_S)
    first = next(call)
    os.kill(decode.pid, signal.SIGTERM)
    tokens, _ = collect(call)
    assert_matches(list(first.token_ids) + tokens, reference, "drained by a stopping decode worker")
    assert said(mesh, since, "decode-0 exited") == (
        f"tandem up: decode-0 exited with status 0 (log {run_dir / 'decode-0.log'}); last lines:")
    back_again(mesh, since, "decode-0")
    log = (run_dir / "decode-0.log").read_text()
    stopped = log.split("--- tandem up: restarting decode-0 after exit status 0 ---")[0].rsplit("--- tandem up:", 1)[-1]
    assert f"deregistered {worker_id} from the scheduler" in stopped  # the run that exited 0 left the registry
    wait_serving(mesh)


def test_a_killed_scheduler_loses_no_placed_request_restarts_and_finds_its_workers(mesh, reference):
    workers = registered(mesh)
    assert set(workers) == {mesh.endpoint("prefill-0").address, mesh.endpoint("decode-0").address}
    since = len(mesh.log)
    long = greedy_request(reference.prompt_ids, 400)
    long.sampling.ignore_eos = True
    call = mesh.gateway().Generate(long, timeout=REQUEST_TIMEOUT_S)
    first: list[int] = []
    while len(first) < 2:  # token 0 comes from the prefill worker, the next from the decode worker
        first += next(call).token_ids
    os.kill(mesh.endpoint("scheduler").pid, signal.SIGKILL)
    rest, messages = collect(call)  # the decode worker streams on: the tokens never passed the scheduler
    assert len(first + rest) == 400 and messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    back_again(mesh, since, "scheduler")
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while registered(mesh) != workers:
        assert time.monotonic() < deadline, f"the restarted scheduler lists {registered(mesh)}, not {workers}"
        time.sleep(0.1)
    wait_serving(mesh)
    assert_matches(generate_reference(mesh, reference), reference, "after the scheduler's restart")
