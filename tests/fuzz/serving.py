"""What every fuzz test checks besides its own statuses: the fuzz budget, how one call's outcome is
read, and that the mesh still serves afterwards (no process died, every health check SERVING, the
reference greedy request returns exactly its tokens, nothing left running or reserved).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from hypothesis import HealthCheck, settings

from services.common.health_cli import SERVING, check
from tests.mesh import Mesh, collect, greedy_request
from tests.waiting import DEADLINE_S

API_KEY = "sk-fuzz"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
MESH_ENV = {
    "TANDEM_API_KEYS": API_KEY,
    "TANDEM_THREADS": "1",
    "TANDEM_KV_MEMORY": "256MiB",
    "TANDEM_HEARTBEAT_TTL": "3",  # a worker a fuzzed RegisterWorker invented lapses within 3 s
}
REFERENCE_PROMPT = [(77 * 7919 + i * 131) % 40000 + 200 for i in range(12)]
REFERENCE_TOKENS = 6
CALL_TIMEOUT_S = 30.0
# Never a server fault: INTERNAL (an exception escaped a servicer) or UNKNOWN (grpc's word for one).
FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def budget(max_examples: int) -> settings:
    """Reproducible (derandomized, no example database) and bounded; no deadline, since a loaded
    2-core machine makes any per-example time limit flaky."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example, HealthCheck.filter_too_much])


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended: OK, or a status with its message."""

    code: grpc.StatusCode
    details: str

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details!r}"


def outcome_of(call: Callable[[], object]) -> tuple[Outcome, object]:
    """Runs `call` (which must consume a stream itself); the outcome and the call's result (None on error)."""
    try:
        result = call()
    except grpc.RpcError as error:
        return Outcome(error.code(), error.details() or ""), None
    return Outcome(grpc.StatusCode.OK, ""), result


def reference_tokens(mesh: Mesh) -> list[int]:
    """The greedy tokens of the reference request (ignore_eos: always REFERENCE_TOKENS of them)."""
    request = greedy_request(REFERENCE_PROMPT, REFERENCE_TOKENS)
    request.sampling.ignore_eos = True
    tokens, _ = collect(mesh.gateway().Generate(request, metadata=AUTH, timeout=120))
    assert len(tokens) == REFERENCE_TOKENS, tokens
    return tokens


def assert_still_serving(mesh: Mesh, reference: list[int]) -> None:
    """No process died, every service says SERVING, the reference request returns the same tokens,
    and the mesh holds nothing once it is done."""
    dead = [f"{ep.name} (pid {ep.pid})" for ep in mesh.endpoints if ep.pid is not None and not _alive(ep.pid)]
    assert not dead, f"died while fuzzed: {dead}; see the logs in the mesh's run dir"
    assert mesh.process.poll() is None, "tandem up exited:\n" + "".join(mesh.log[-40:])
    statuses = {ep.name: check(ep.address, timeout=5) for ep in _grpc_endpoints(mesh.endpoints)}
    assert set(statuses.values()) == {SERVING}, statuses
    assert reference_tokens(mesh) == reference
    mesh.wait_idle(DEADLINE_S)


def _grpc_endpoints(endpoints: Iterable) -> list:
    return [ep for ep in endpoints if ep.kind == "grpc"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
