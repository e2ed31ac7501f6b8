"""TLS on real processes over loopback, with certificates the test makes: a scheduler, a colocated
worker and a gateway whose internal plane runs on mutual TLS alone (no internal token, so no
`--insecure-internal` either), and whose public doors serve TLS. The SDK given the CA gets the HF
reference's tokens, HTTPS answers, plaintext clients are refused at both doors, and an internal
caller without a certificate is refused while one with a certificate is served.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tandem
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.certificates import CertificateAuthority, Issued
from tests.hf_reference import MAX_NEW_TOKENS, assert_matches
from tests.mesh import greedy_request
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

TANDEM = str(Path(sys.executable).parent / "tandem")
API_KEY = "tls-mesh-key"
START_S = 240


@dataclass(frozen=True, slots=True)
class TlsMesh:
    gateway: str
    http: str
    scheduler: str
    ca: Path
    client: Issued  # a certificate the CA signed, for internal calls
    processes: tuple[subprocess.Popen[bytes], ...]
    logs: tuple[Path, ...]

    def secure(self, address: str, issued: Issued | None = None) -> grpc.Channel:
        """A channel trusting the CA, presenting `issued`'s certificate when given."""
        key, cert = (issued.key.read_bytes(), issued.cert.read_bytes()) if issued else (None, None)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(self.ca.read_bytes(), key, cert))


def _start(command: str, flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([TANDEM, command, "--host", "127.0.0.1", *flags], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def _serving(mesh: TlsMesh) -> bool:
    with mesh.secure(mesh.gateway) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[TlsMesh]:
    directory = tmp_path_factory.mktemp("tls-mesh")
    ca = CertificateAuthority.create(directory)
    service, door, client = (ca.issue(directory, name) for name in ("internal", "gateway", "operator"))
    outer = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env = outer | {"TANDEM_RUN_DIR": str(directory / "run"), "TANDEM_INTERNAL_TLS_CA": str(service.ca),
                   "TANDEM_INTERNAL_TLS_CERT": str(service.cert), "TANDEM_INTERNAL_TLS_KEY": str(service.key)}
    ports = {name: free_port() for name in ("scheduler", "gateway", "http")}
    scheduler = f"127.0.0.1:{ports['scheduler']}"
    commands = {
        "scheduler": ["--port", str(ports["scheduler"]), "--metrics-port", "0"],
        "colocated": ["--port", "0", "--scheduler", scheduler, "--model", str(default_model_dir), "--metrics-port",
                      "0", "--kv-memory", "64MiB", "--threads", "1"],
        "gateway": ["--port", str(ports["gateway"]), "--http-port", str(ports["http"]), "--scheduler", scheduler,
                    "--model", str(default_model_dir), "--api-keys", API_KEY, "--tls-cert", str(door.cert),
                    "--tls-key", str(door.key)],
    }
    logs = tuple(directory / f"{name}.log" for name in commands)
    processes = tuple(_start(name, flags, env, log) for (name, flags), log in zip(commands.items(), logs))
    started = TlsMesh(f"127.0.0.1:{ports['gateway']}", f"https://127.0.0.1:{ports['http']}", scheduler, ca.file,
                      client, processes, logs)
    try:
        wait_until(lambda: _serving(started) or any(p.poll() is not None for p in processes),
                   "the TLS mesh to serve", timeout=START_S)
        exited = [log.name for p, log in zip(processes, logs) if p.poll() is not None]
        assert not exited, f"exited: {exited}\n" + "\n".join(log.read_text()[-2000:] for log in logs)
        yield started
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_the_sdk_given_the_ca_gets_the_reference_tokens(mesh: TlsMesh, parity_prompts, parity_references) -> None:
    tls = tandem.TLSConfig.from_files(ca=mesh.ca)
    with tandem.Client(mesh.gateway, api_key=API_KEY, tls=tls) as sdk:
        completion = sdk.complete(token_ids=parity_prompts[0], max_tokens=MAX_NEW_TOKENS, temperature=0,
                                  timeout=300)
    assert_matches(completion.token_ids, parity_references[0], "over TLS")


def test_https_answers_and_plaintext_is_refused_at_both_doors(mesh: TlsMesh) -> None:
    body = {"model": "ignored-by-a-one-model-gateway", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    headers = {"authorization": f"Bearer {API_KEY}"}
    models = httpx.get(f"{mesh.http}/v1/models", headers=headers, timeout=30,
                       verify=ssl.create_default_context(cafile=mesh.ca))
    assert models.status_code == 200
    body["model"] = models.json()["data"][0]["id"]
    answer = httpx.post(f"{mesh.http}/v1/completions", json=body, headers=headers, timeout=120,
                        verify=ssl.create_default_context(cafile=mesh.ca))
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    with pytest.raises(httpx.TransportError):
        httpx.post(mesh.http.replace("https://", "http://") + "/v1/completions", json=body, headers=headers, timeout=30)
    with grpc.insecure_channel(mesh.gateway) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(gateway_pb2_grpc.GenerateServiceStub(channel).Generate(greedy_request([1, 2, 3], 2), timeout=10,
                                                                        metadata=(("authorization",
                                                                                   f"Bearer {API_KEY}"),)))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_internal_plane_serves_only_callers_with_a_certificate(mesh: TlsMesh) -> None:
    request = scheduler_pb2.SchedulerStatsRequest()
    with mesh.secure(mesh.scheduler, mesh.client) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(request, timeout=10)
    assert [w.info.role for w in stats.workers] == [common_pb2.WORKER_ROLE_COLOCATED]  # it registered over mTLS
    for channel in (grpc.insecure_channel(mesh.scheduler), mesh.secure(mesh.scheduler)):
        with channel, pytest.raises(grpc.RpcError) as refused:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
