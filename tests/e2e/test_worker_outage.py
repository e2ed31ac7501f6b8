"""A worker outage through the real gateway: while the mesh's only decode worker is frozen
(SIGSTOP) and its heartbeats lapse, the gateway's gRPC health and GET /health say NOT_SERVING / 503
with Retry-After, and requests get 503 / UNAVAILABLE with a retry hint in stable words; once the
worker runs again (SIGCONT) and re-registers, the gateway is SERVING and serves as before.
"""

from __future__ import annotations

import os
import signal

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway import client_errors
from tandem.v1 import gateway_pb2
from tests.e2e.api import API_KEY
from tests.mesh import Mesh
from tests.waiting import DEADLINE_S, wait_until

GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)


def grpc_health(mesh: Mesh) -> int:
    with grpc.insecure_channel(mesh.endpoint("gateway").address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def health(mesh: Mesh, http: httpx.Client) -> tuple[int, int]:
    return grpc_health(mesh), http.get("/health").status_code


SERVING = (health_pb2.HealthCheckResponse.SERVING, 200)
NOT_SERVING = (health_pb2.HealthCheckResponse.NOT_SERVING, 503)


def test_gateway_health_follows_the_only_decode_worker_out_and_back(mesh, http):
    decode = mesh.endpoint("decode-0")
    assert decode.pid is not None
    wait_until(lambda: health(mesh, http) == SERVING, "the gateway SERVING before the outage")
    os.kill(decode.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: health(mesh, http) == NOT_SERVING, "the gateway NOT_SERVING once the worker's TTL lapsed")
        probe = http.get("/health")
        assert (probe.headers["retry-after"], probe.json()) == ("1", {"status": "not_serving"})

        refused = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                            headers={"x-request-id": "outage-http"})
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
        assert refused.json()["error"]["message"] == f"{client_errors.NO_WORKER} (request outage-http)"

        request = gateway_pb2.GenerateRequest(prompt="Hello", request_id="outage-grpc")
        with pytest.raises(grpc.RpcError) as caught:
            list(mesh.gateway().Generate(request, metadata=GRPC_AUTH, timeout=60))
        assert (caught.value.code(), caught.value.details()) == (
            grpc.StatusCode.UNAVAILABLE, f"{client_errors.NO_WORKER} (request outage-grpc)")
        assert dict(caught.value.trailing_metadata())["retry-after"] == "1"
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    wait_until(lambda: health(mesh, http) == SERVING, "the gateway SERVING once the worker is back")
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    mesh.wait_idle(DEADLINE_S)
