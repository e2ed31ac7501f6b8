"""TLS, with certificates the tests make: a public door given a certificate serves gRPC and HTTPS
and refuses plaintext; the internal plane under mutual TLS refuses a caller without a certificate
the CA signed and accepts one with; the flags resolve as their help says; every server and internal
channel sets keepalive the way the other side accepts.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI

from services.common import internal_auth
from services.common.channels import channel_options, internal_channel
from services.common.grpc_server import (
    KEEPALIVE_TIME_MS, MIN_PING_INTERVAL_MS, SERVER_KEEPALIVE_OPTIONS, GrpcServer, create_server,
)
from services.common.internal_auth import InternalAuth, InternalAuthError
from services.common.tls import MutualTLS, TLSConfigError, mutual_tls, server_certificate
from services.gateway.http_server import start_http
from services.scheduler.servicer import SERVICE_NAME as SCHEDULER
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.certificates import CertificateAuthority, Issued

# The scheduler's generated base servicer answers UNIMPLEMENTED: reaching it means the call got in.
REACHED = grpc.StatusCode.UNIMPLEMENTED


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def issued(ca: CertificateAuthority, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    directory = tmp_path_factory.mktemp("issued")
    stranger = CertificateAuthority.create(tmp_path_factory.mktemp("stranger"), "stranger-ca")
    return {"server": ca.issue(directory, "server"), "client": ca.issue(directory, "client"),
            "stranger": stranger.issue(directory, "stranger")}


def plane(issued: Issued) -> MutualTLS:
    return mutual_tls(issued.ca, issued.cert, issued.key)


async def _scheduler(credentials: grpc.ServerCredentials, internal_token: str | None = None) -> GrpcServer:
    server = create_server("127.0.0.1", 0, credentials=credentials, internal_token=internal_token)
    server.add_service(SCHEDULER, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                       scheduler_pb2_grpc.SchedulerServiceServicer())
    await server.start()
    return server


async def _stats_status(channel: grpc.aio.Channel) -> grpc.StatusCode:
    call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(scheduler_pb2.SchedulerStatsRequest(), timeout=5)
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    raise AssertionError("the base servicer answered a Stats call")


@pytest.fixture
async def mtls_scheduler(issued) -> Iterator[GrpcServer]:
    server = await _scheduler(plane(issued["server"]).server_credentials())
    yield server
    await server.stop(grace=0)


async def test_the_internal_plane_under_mutual_tls_accepts_a_peer_with_a_certificate(mtls_scheduler, issued) -> None:
    async with internal_channel(f"127.0.0.1:{mtls_scheduler.port}", plane(issued["client"])) as channel:
        assert await _stats_status(channel) == REACHED


async def test_the_internal_plane_refuses_a_caller_without_a_certificate(mtls_scheduler, issued) -> None:
    address = f"127.0.0.1:{mtls_scheduler.port}"
    server_only = grpc.ssl_channel_credentials(issued["client"].ca.read_bytes())
    async with grpc.aio.secure_channel(address, server_only) as channel:
        assert await _stats_status(channel) == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(address) as channel:
        assert await _stats_status(channel) == grpc.StatusCode.UNAVAILABLE
    async with internal_channel(address) as channel:
        assert await _stats_status(channel) == grpc.StatusCode.UNAVAILABLE


async def test_the_internal_plane_refuses_a_certificate_another_ca_signed(mtls_scheduler, issued) -> None:
    stranger = issued["stranger"]
    foreign = MutualTLS(issued["client"].ca.read_bytes(), stranger.cert.read_bytes(), stranger.key.read_bytes())
    async with internal_channel(f"127.0.0.1:{mtls_scheduler.port}", foreign) as channel:
        assert await _stats_status(channel) == grpc.StatusCode.UNAVAILABLE


async def test_a_token_still_counts_beside_mutual_tls(issued) -> None:
    """Both configured: a caller needs the certificate and the token."""
    server = await _scheduler(plane(issued["server"]).server_credentials(), internal_token="t" * 16)
    try:
        async with internal_channel(f"127.0.0.1:{server.port}", plane(issued["client"])) as channel:
            assert await _stats_status(channel) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(grace=0)


async def test_a_public_door_with_a_certificate_serves_tls_and_refuses_plaintext(issued) -> None:
    door = server_certificate(issued["server"].cert, issued["server"].key)
    server = await _scheduler(door.grpc_credentials())
    address = f"127.0.0.1:{server.port}"
    try:
        trusting = grpc.ssl_channel_credentials(issued["server"].ca.read_bytes())
        async with grpc.aio.secure_channel(address, trusting) as channel:
            assert await _stats_status(channel) == REACHED
        async with grpc.aio.insecure_channel(address) as channel:
            assert await _stats_status(channel) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(grace=0)


async def test_the_http_door_with_a_certificate_serves_https_only(issued) -> None:
    app = FastAPI()
    app.get("/ping")(lambda: {"pong": True})
    door = server_certificate(issued["server"].cert, issued["server"].key)
    http = await start_http(app, "127.0.0.1", 0, grace=0.1, tls=door)
    try:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=issued["server"].ca)) as client:
            answer = await client.get(f"https://127.0.0.1:{http.port}/ping")
        assert (answer.status_code, answer.json()) == (200, {"pong": True})
        async with httpx.AsyncClient() as client:
            with pytest.raises(httpx.TransportError):
                await client.get(f"http://127.0.0.1:{http.port}/ping")
    finally:
        await http.stop()


# --- Flags ----------------------------------------------------------------------------------------


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    for flag in ("internal-token", "internal-token-file", "insecure-internal", "internal-tls-ca", "internal-tls-cert",
                 "internal-tls-key", "internal-tls-server-name"):
        monkeypatch.delenv("TANDEM_" + flag.upper().replace("-", "_"), raising=False)

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        internal_auth.add_arguments(parser)
        return parser.parse_args(argv)

    return parse


def test_mutual_tls_alone_closes_the_internal_plane(parse, issued, monkeypatch: pytest.MonkeyPatch) -> None:
    server = issued["server"]
    monkeypatch.setenv("TANDEM_INTERNAL_TLS_KEY", str(server.key))
    auth = internal_auth.auth_from_args(parse("--internal-tls-ca", str(server.ca), "--internal-tls-cert",
                                              str(server.cert), "--internal-tls-server-name", "tandem"), "scheduler")
    assert auth == InternalAuth(None, MutualTLS(*server.pem(), server_name="tandem"))


def test_mutual_tls_and_insecure_internal_conflict(parse, issued) -> None:
    server = issued["server"]
    with pytest.raises(InternalAuthError) as refused:
        internal_auth.auth_from_args(parse("--internal-tls-ca", str(server.ca), "--internal-tls-cert", str(server.cert),
                                           "--internal-tls-key", str(server.key), "--insecure-internal"), "decode")
    assert str(refused.value) == ("--insecure-internal (TANDEM_INSECURE_INTERNAL) and an internal token or mutual "
                                  "TLS are both set; drop one")


def test_mutual_tls_needs_all_three_files(parse, issued) -> None:
    with pytest.raises(InternalAuthError) as refused:
        internal_auth.auth_from_args(parse("--internal-tls-cert", str(issued["server"].cert)), "prefill")
    assert str(refused.value) == ("mutual TLS needs --internal-tls-ca, --internal-tls-cert and --internal-tls-key; "
                                  "--internal-tls-ca, --internal-tls-key missing")


def test_tls_files_that_cannot_be_used_are_named(tmp_path: Path, issued) -> None:
    text = tmp_path / "not.pem"
    text.write_text("hello\n")
    with pytest.raises(TLSConfigError) as unreadable:
        server_certificate(tmp_path / "absent.pem", issued["server"].key)
    assert str(unreadable.value) == f"cannot read --tls-cert {tmp_path / 'absent.pem'}: No such file or directory"
    with pytest.raises(TLSConfigError) as not_pem:
        server_certificate(issued["server"].cert, text)
    assert str(not_pem.value) == f"--tls-key {text} holds no PEM block (-----BEGIN ...); give a PEM-encoded file"
    with pytest.raises(TLSConfigError) as half:
        server_certificate(issued["server"].cert, None)
    assert str(half.value) == "TLS needs both --tls-cert and --tls-key; --tls-key is missing"
    assert server_certificate(None, None) is None


# --- Keepalive ------------------------------------------------------------------------------------


def test_servers_and_internal_channels_keep_connections_alive() -> None:
    client = dict(channel_options())
    assert client["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS == 20_000
    assert client["grpc.keepalive_timeout_ms"] == 10_000
    assert client["grpc.keepalive_permit_without_calls"] == 1
    server = dict(SERVER_KEEPALIVE_OPTIONS)
    assert server["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    # A server answers pings faster than its minimum with GOAWAY: the clients must ping no faster.
    assert server["grpc.http2.min_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_MS <= KEEPALIVE_TIME_MS
    assert server["grpc.keepalive_permit_without_calls"] == 1
