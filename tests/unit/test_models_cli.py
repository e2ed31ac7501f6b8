"""`tandem models list` against a stand-in gateway's /v1/models, and `tandem models provision`
against a stand-in scheduler serving SchedulerService.ProvisionModel on loopback: the request and
credentials sent, the output, every refusal's message and exit code."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest

from services.common.grpc_server import INTERNAL_TOKEN_KEY
from tandem.cli import models
from tandem.cli.ports import free_port
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

TOKEN = "a-provisioning-token-0123"
API_KEY = "client-key"
CARDS = [
    {"id": "smol", "object": "model", "root": "smol", "max_model_len": 8192, "resident": True, "resident_workers": 2},
    {"id": "big", "object": "model", "root": "big", "max_model_len": 32768, "resident": False, "resident_workers": 0},
    {"id": "smol:fr", "object": "model", "root": "smol", "parent": "smol", "max_model_len": 8192, "resident": True,
     "resident_workers": 2},
]  # fmt: skip


class ProvisioningScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Pins model "smol" on w1, w2, ... (as many as asked); refuses "nope" (NOT_FOUND), "latency"
    (FAILED_PRECONDITION) and "huge" (RESOURCE_EXHAUSTED) as the scheduler does; checks the token."""

    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.ProvisionModelRequest] = []

    def ProvisionModel(self, request, context):
        if dict(context.invocation_metadata()).get(INTERNAL_TOKEN_KEY) != TOKEN:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid internal token")
        self.requests.append(request)
        refusals = {
            "nope": (grpc.StatusCode.NOT_FOUND, "no live worker's catalogue holds model 'nope'"),
            "latency": (grpc.StatusCode.FAILED_PRECONDITION, "model 'latency' is not provisioned"),
            "huge": (grpc.StatusCode.RESOURCE_EXHAUSTED, "only 1 of 2 colocated workers could take it"),
        }
        if request.model in refusals:
            context.abort(*refusals[request.model])
        return scheduler_pb2.ProvisionModelResponse(worker_ids=[f"w{i + 1}" for i in range(request.replicas)])


@pytest.fixture(scope="module")
def scheduler() -> Iterator[tuple[ProvisioningScheduler, str]]:
    fake = ProvisioningScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                self._send(401, {"error": {"message": "invalid API key", "type": "authentication_error"}})
            else:
                self._send(200, {"object": "list", "data": CARDS})

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tandem models")
    models.add_arguments(parser)
    code = models.main(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", TOKEN)


# --- provision ----------------------------------------------------------------------------------


def test_provision_pins_the_model_with_the_internal_token(scheduler, token, capsys) -> None:
    fake, address = scheduler
    assert run(["provision", "smol", "--replicas", "2", "--scheduler", address], capsys) == (
        0, f"model 'smol' is pinned on 2 workers ({address}): w1, w2\n", "")
    assert (fake.requests[-1].model, fake.requests[-1].replicas) == ("smol", 2)


def test_provision_asks_the_next_scheduler_when_one_cannot_be_reached(scheduler, token, capsys) -> None:
    _, address = scheduler
    down = free_port()
    code, out, _ = run(["provision", "smol", "--scheduler", f"127.0.0.1:{down},{address}"], capsys)
    assert (code, out) == (0, f"model 'smol' is pinned on 1 worker ({address}): w1\n")


@pytest.mark.parametrize(("name", "message"), [
    ("nope", "NOT_FOUND: no live worker's catalogue holds model 'nope'"),
    ("latency", "FAILED_PRECONDITION: model 'latency' is not provisioned"),
    ("huge", "RESOURCE_EXHAUSTED: only 1 of 2 colocated workers could take it"),
])  # fmt: skip
def test_a_refusal_exits_1_with_the_schedulers_reason(scheduler, token, capsys, name: str, message: str) -> None:
    assert run(["provision", name, "--scheduler", scheduler[1]], capsys) == (
        1, "", f"tandem models provision: {message}\n")


def test_a_wrong_token_exits_1_saying_which_credentials_to_give(scheduler, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", "not-the-deployment-token")
    code, _, err = run(["provision", "smol", "--scheduler", scheduler[1]], capsys)
    assert code == 1
    assert err == ("tandem models provision: UNAUTHENTICATED: missing or invalid internal token (the scheduler "
                   "refused the credentials: give the deployment's internal token (TANDEM_INTERNAL_TOKEN or "
                   "--internal-token-file) or its mutual TLS files)\n")


def test_no_credentials_exit_2_before_anything_is_sent(scheduler, monkeypatch, capsys) -> None:
    fake, address = scheduler
    monkeypatch.delenv("TANDEM_INTERNAL_TOKEN", raising=False)
    sent = len(fake.requests)
    code, _, err = run(["provision", "smol", "--scheduler", address], capsys)
    assert code == 2 and err.startswith("tandem models provision: no internal token: set TANDEM_INTERNAL_TOKEN")
    assert len(fake.requests) == sent


def test_no_reachable_scheduler_exits_3(token, capsys) -> None:
    down = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    code, _, err = run(["provision", "smol", "--scheduler", ",".join(down)], capsys)
    assert code == 3
    assert err.startswith(f"tandem models provision: no scheduler could be reached ({', '.join(down)}): UNAVAILABLE: ")
    assert err.endswith("; is it running? (--scheduler)\n")


def test_replicas_must_be_positive(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["provision", "smol", "--replicas", "0"], capsys)
    assert exit_info.value.code == 2
    assert "argument --replicas: must be at least 1, got 0" in capsys.readouterr().err


# --- list ---------------------------------------------------------------------------------------


def test_list_prints_every_model_with_its_residency(gateway, capsys) -> None:
    assert run(["list", "--url", gateway, "--api-key", API_KEY], capsys) == (0, (
        "MODEL    RESIDENT  WORKERS  CONTEXT  ADAPTER OF\n"
        "smol     yes       2        8192\n"
        "big      no        0        32768\n"
        "smol:fr  yes       2        8192     smol\n"), "")  # fmt: skip
    code, out, _ = run(["list", "--url", gateway, "--api-key", API_KEY, "--json"], capsys)
    assert (code, json.loads(out)) == (0, CARDS)


def test_list_exits_1_when_the_gateway_refuses_and_3_when_it_cannot_be_reached(gateway, capsys) -> None:
    code, _, err = run(["list", "--url", gateway, "--api-key", "wrong"], capsys)
    assert (code, err) == (1, f"tandem models list: GET {gateway}/v1/models: HTTP 401: invalid API key\n")
    down = free_port()
    code, _, err = run(["list", "--url", f"http://127.0.0.1:{down}"], capsys)
    assert code == 3 and err.startswith(f"tandem models list: cannot reach the gateway at http://127.0.0.1:{down}: ")
