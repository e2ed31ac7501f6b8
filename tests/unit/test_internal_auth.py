"""Closed by default: every RPC of every internal service needs the internal token (health and
reflection stay open), and the token settings resolve exactly as the flags' help says.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common import internal_auth
from services.common.grpc_server import INTERNAL_TOKEN_KEY, GrpcServer, create_server
from services.common.internal_auth import InternalAuthError, auth_from_args
from services.colocated.main import SPEC as COLOCATED
from services.decode.main import SPEC as DECODE
from services.prefill.main import SPEC as PREFILL
from services.scheduler.servicer import SERVICE_NAME as SCHEDULER
from tandem.v1 import (
    common_pb2, gateway_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc,
)

TOKEN = "a-token-of-sufficient-length"
NO_TOKEN = (
    "no internal token: set TANDEM_INTERNAL_TOKEN (or pass --internal-token-file FILE) to the secret that every "
    "Tandem service of this deployment shares, e.g. from python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
    "; or give mutual TLS (--internal-tls-ca, --internal-tls-cert, --internal-tls-key); or pass --insecure-internal "
    "(TANDEM_INSECURE_INTERNAL=1) to leave the internal RPCs open to anyone who can "
    "reach them"
)
# Every service the scheduler and the workers serve, as they register it, with its generated base servicer
# (whose methods all answer UNIMPLEMENTED: reaching one means the call got past authentication).
SERVICES = [(SCHEDULER, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server)] + [
    service for spec in (PREFILL, DECODE, COLOCATED) for service in spec.services
]
BASES = {
    "SchedulerService": scheduler_pb2_grpc.SchedulerServiceServicer,
    "PrefillService": worker_pb2_grpc.PrefillServiceServicer,
    "DecodeService": worker_pb2_grpc.DecodeServiceServicer,
    "ColocatedService": worker_pb2_grpc.ColocatedServiceServicer,
    "KvTransferService": kv_transfer_pb2_grpc.KvTransferServiceServicer,
    "TokenStreamService": worker_pb2_grpc.TokenStreamServiceServicer,
    "ModelService": worker_pb2_grpc.ModelServiceServicer,
}
DESCRIPTORS = {name: service for module in (scheduler_pb2, worker_pb2, kv_transfer_pb2)
               for name, service in module.DESCRIPTOR.services_by_name.items()}
METHODS = [(full, method) for full, _ in SERVICES for method in DESCRIPTORS[full.rsplit(".", 1)[1]].methods]


@pytest.fixture
async def server() -> GrpcServer:
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)
    for full_name, register in SERVICES:
        server.add_service(full_name, register, BASES[full_name.rsplit(".", 1)[1]]())
    await server.start()
    await server.mark_serving()
    yield server
    await server.stop(grace=0)


async def _status(channel: grpc.aio.Channel, service: str, method, metadata) -> grpc.StatusCode:
    """The status of calling `method` (any streaming kind): with one empty request message, or none on
    a client stream. The token rides the call's metadata; a message written to a client stream races
    the server's early status, and grpcio then reports INTERNAL instead of it (grpc/grpc#36066)."""
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    callable_ = kind[(method.client_streaming, method.server_streaming)](
        f"/{service}/{method.name}", request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString)
    request = () if method.client_streaming else (request_class(),)
    call = callable_(*request, metadata=metadata, timeout=5)
    return await call.code()


def test_every_internal_service_is_covered() -> None:
    """Every service of the protos but the gateway's public one is served by the scheduler or a worker."""
    declared = {service.full_name for module in (common_pb2, gateway_pb2, scheduler_pb2, worker_pb2, kv_transfer_pb2)
                for service in module.DESCRIPTOR.services_by_name.values()}
    assert {full for full, _ in SERVICES} == declared - {"tandem.v1.GenerateService"}
    assert {m.name for _, m in METHODS} >= {
        "Submit", "Abort", "Stats", "RegisterWorker", "Heartbeat", "ReportTokens", "Reserve", "Prefill", "Push"}


@pytest.mark.parametrize(("full_name", "method"), METHODS, ids=[f"{f.rsplit('.', 1)[1]}.{m.name}" for f, m in METHODS])
async def test_each_internal_method_needs_the_token(server: GrpcServer, full_name: str, method) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        missing = await _status(channel, full_name, method, ())
        wrong = await _status(channel, full_name, method, ((INTERNAL_TOKEN_KEY, TOKEN + "x"),))
        right = await _status(channel, full_name, method, ((INTERNAL_TOKEN_KEY, TOKEN),))
    assert (missing, wrong, right) == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED,
                                       grpc.StatusCode.UNIMPLEMENTED)


async def test_health_and_reflection_stay_open(server: GrpcServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SCHEDULER), timeout=5)
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        listed = [s.name async for answer in reflection for s in answer.list_services_response.service]
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {full for full, _ in SERVICES} <= set(listed)


# --- Where the token comes from -------------------------------------------------------------------


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    for name in ("TANDEM_INTERNAL_TOKEN", "TANDEM_INTERNAL_TOKEN_FILE", "TANDEM_INSECURE_INTERNAL"):
        monkeypatch.delenv(name, raising=False)

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        internal_auth.add_arguments(parser)
        return parser.parse_args(argv)

    return parse


def test_no_token_refuses_with_what_to_set(parse) -> None:
    with pytest.raises(InternalAuthError) as refused:
        auth_from_args(parse(), "scheduler")
    assert str(refused.value) == NO_TOKEN


def test_token_from_the_variable_the_flag_or_a_file(parse, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert auth_from_args(parse("--internal-token", TOKEN), "scheduler").token == TOKEN
    secret = tmp_path / "token"
    secret.write_text(f"  {TOKEN}\n")  # as a mounted Kubernetes secret may hold it
    assert auth_from_args(parse("--internal-token-file", str(secret)), "scheduler").token == TOKEN
    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN", TOKEN + "-env")
    assert auth_from_args(parse(), "scheduler").token == TOKEN + "-env"
    monkeypatch.delenv("TANDEM_INTERNAL_TOKEN")
    monkeypatch.setenv("TANDEM_INTERNAL_TOKEN_FILE", str(secret))
    assert auth_from_args(parse(), "scheduler").token == TOKEN


@pytest.mark.parametrize(("argv", "message"), [
    (("--internal-token", "short"),
     "the internal token must be at least 16 characters of letters, digits, '-', '_', '.' or '~' (got 5 "
     "characters); generate one with python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"),
    (("--internal-token", "has spaces in it, sadly"),
     "the internal token must be at least 16 characters of letters, digits, '-', '_', '.' or '~' (got 23 "
     "characters); generate one with python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"),
    (("--internal-token", TOKEN, "--internal-token-file", "/x"),
     "both TANDEM_INTERNAL_TOKEN (--internal-token) and --internal-token-file are set; drop one"),
    (("--internal-token-file", "/nonexistent/token"),
     "cannot read --internal-token-file /nonexistent/token: No such file or directory"),
    (("--internal-token", TOKEN, "--insecure-internal"),
     "--insecure-internal (TANDEM_INSECURE_INTERNAL) and an internal token or mutual TLS are both set; "
     "drop one"),
])
def test_bad_token_settings_say_what_to_change(parse, argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(InternalAuthError) as refused:
        auth_from_args(parse(*argv), "scheduler")
    assert str(refused.value) == message


def test_an_empty_token_file_is_refused(parse, tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(InternalAuthError) as refused:
        auth_from_args(parse("--internal-token-file", str(empty)), "decode")
    assert str(refused.value) == f"--internal-token-file {empty} is empty; write the token into it"


def test_insecure_internal_runs_open_and_says_so(parse, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TANDEM_INSECURE_INTERNAL", "1")
    with caplog.at_level(logging.WARNING, logger="services.common.internal_auth"):
        assert auth_from_args(parse(), "decode") == internal_auth.InternalAuth()
    (record,) = caplog.records
    assert record.getMessage().startswith("INSECURE: decode runs with --insecure-internal: its internal RPCs "
                                          "accept calls from anyone who can reach it")
