"""Migration on a real mesh: a decode worker SIGKILLed under a greedy stream, after some of its
tokens reached the client. The scheduler re-prefills the prompt and the delivered tokens on the
other decode worker and the stream goes on: the client gets exactly the tokens the undisturbed
mesh gave, none lost or repeated. (Migration off, and no worker left: tests/integration/test_faults.py
and tests/unit/test_scheduler_service.py.)

One mesh: 1 prefill and 2 decode workers, a 2 s heartbeat TTL, migration on (the default).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tandem.v1 import gateway_pb2
from tests.mesh import Mesh, collect, greedy_request
from tests.waiting import DEADLINE_S

API_KEY = "migration-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
ENV = {"TANDEM_API_KEYS": API_KEY, "TANDEM_KV_MEMORY": "40MiB", "TANDEM_THREADS": "1",
       "TANDEM_HEARTBEAT_TTL": "2.0"}
CLIENT_TIMEOUT_S = 120
MAX_TOKENS = 48
BEFORE_KILL = 4  # tokens the client has when the decode worker dies
PROMPT = [(i * 131) % 40000 + 200 for i in range(24)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir) -> Iterator[Mesh]:
    started = Mesh.start("--prefill", "1", "--decode", "2", "--model", str(default_model_dir),
                         env=ENV, run_dir=tmp_path_factory.mktemp("migration"))
    yield started
    started.stop()


def stream(request_id: str) -> gateway_pb2.GenerateRequest:
    request = greedy_request(PROMPT, MAX_TOKENS, request_id=request_id)
    request.sampling.ignore_eos = True
    return request


def decode_pid(mesh: Mesh, request_id: str) -> int:
    """The pid of the decode worker the scheduler routed the request to."""
    stats = mesh.scheduler_stats()
    route = next(r for r in stats.recent_routes if r.request_id == request_id)
    address = next(w.info.address for w in stats.workers if w.info.worker_id == route.decode_worker_id)
    pid = next(ep.pid for ep in mesh.endpoints if ep.kind == "grpc" and ep.address == address)
    assert pid is not None
    return pid


def test_a_decode_worker_killed_mid_stream_loses_no_token_and_repeats_none(mesh):
    reference, _ = collect(mesh.gateway().Generate(stream("reference"), metadata=AUTH, timeout=CLIENT_TIMEOUT_S))
    assert len(reference) == MAX_TOKENS
    mesh.wait_idle(DEADLINE_S)
    before = mesh.scheduler_stats()

    call = mesh.gateway().Generate(stream("migrated"), metadata=AUTH, timeout=CLIENT_TIMEOUT_S)
    responses = []
    while sum(len(r.token_ids) for r in responses) < BEFORE_KILL:
        responses.append(next(call))
    os.kill(decode_pid(mesh, "migrated"), signal.SIGKILL)
    tokens = [t for r in responses for t in r.token_ids] + collect(call)[0]

    assert tokens == reference
    after = mesh.scheduler_stats()
    assert (after.migrated - before.migrated, after.failed - before.failed) == (1, 0)
    routes = [r.decode_worker_id for r in after.recent_routes if r.request_id == "migrated"]
    assert len(routes) == 2 and routes[0] != routes[1]
