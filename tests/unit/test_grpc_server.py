"""The server bootstrap on a real loopback port: health, reflection, auth, error mapping,
deadline and trace-context helpers, graceful shutdown, and `tandem health` exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common import health_cli
from services.common.errors import (
    DeadlineExceeded, FailedPrecondition, InvalidRequest, NotFound, Overloaded, TandemError, Unauthenticated,
    Unavailable, error_from_rpc,
)
from services.common.grpc_server import GrpcServer, create_server, propagated_metadata, remaining_timeout
from tandem.v1 import (gateway_pb2, gateway_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc, scheduler_pb2,
                       scheduler_pb2_grpc)

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATE = "tandem.v1.GenerateService"
SCHEDULER = "tandem.v1.SchedulerService"
KV_TRANSFER = "tandem.v1.KvTransferService"

ERRORS: dict[str, TandemError] = {
    "invalid": InvalidRequest("sampling.temperature", "must be >= 0, got -1"),
    "not_found": NotFound("unknown model 'gpt-9': this gateway serves 'smol'"),
    "overloaded": Overloaded("waiting queue full (256 requests)", retry_after=2.5),
    "unavailable": Unavailable("decode worker decode-0 was lost"),
    "deadline": DeadlineExceeded("deadline passed while queued"),
    "unauthenticated": Unauthenticated("token expired"),
    "precondition": FailedPrecondition("block size 16 != 32"),
}
CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
}


def _wanted_error(context: grpc.aio.ServicerContext) -> str | None:
    return dict(context.invocation_metadata()).get("x-raise")


class ToyGenerate(gateway_pb2_grpc.GenerateServiceServicer):
    """Streams two messages, raising the error named by `x-raise` metadata before or between them."""

    async def Generate(self, request, context):
        wanted = _wanted_error(context)
        if wanted and request.prompt != "late":
            raise ERRORS[wanted]
        yield gateway_pb2.GenerateResponse(request_id="r1", token_ids=[1, 2], text="hi")
        if wanted:
            raise ERRORS[wanted]
        yield gateway_pb2.GenerateResponse(token_ids=[3], finish_reason=1)

    async def ListModels(self, request, context):
        wanted = _wanted_error(context)
        if wanted == "echo":
            remaining = remaining_timeout(context, default=-1.0)
            carried = propagated_metadata(context, internal_token="secret")
            return gateway_pb2.ListModelsResponse(
                models=[gateway_pb2.ModelCard(id=f"{remaining:.3f}", owned_by=json.dumps(carried))])
        if wanted:
            raise ERRORS[wanted]
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelCard(id="smol", max_model_len=2048)])


class ToyScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """ReportTokens (bidirectional) rejects a batch without a worker id; it acks once, at the end."""

    async def ReportTokens(self, request_iterator, context):
        batches = 0
        async for batch in request_iterator:
            if not batch.worker_id:
                raise InvalidRequest("worker_id", "required on every batch")
            batches += 1
        yield scheduler_pb2.ReportAck(batches=batches)


class ToyKvTransfer(kv_transfer_pb2_grpc.KvTransferServiceServicer):
    """Push (client streaming) rejects a chunk without a request id."""

    async def Push(self, request_iterator, context):
        chunks = 0
        async for chunk in request_iterator:
            if not chunk.request_id:
                raise InvalidRequest("request_id", "required on every chunk")
            chunks += 1
        return kv_transfer_pb2.PushAck(chunks=chunks)


async def _started(**kwargs) -> GrpcServer:
    server = create_server("127.0.0.1", 0, **kwargs)
    server.add_service(GENERATE, gateway_pb2_grpc.add_GenerateServiceServicer_to_server, ToyGenerate())
    server.add_service(SCHEDULER, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, ToyScheduler())
    server.add_service(KV_TRANSFER, kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server, ToyKvTransfer())
    await server.start()
    return server


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    server = await _started()
    yield server
    await server.stop(0)


@pytest.fixture
async def channel(server: GrpcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


async def _health(channel: grpc.aio.Channel, service: str = "") -> str:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def test_health_is_not_serving_until_marked(server: GrpcServer, channel: grpc.aio.Channel) -> None:
    assert [await _health(channel, name) for name in ("", GENERATE, SCHEDULER)] == ["NOT_SERVING"] * 3
    await server.mark_serving()
    assert [await _health(channel, name) for name in ("", GENERATE, SCHEDULER)] == ["SERVING"] * 3
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _health(channel, "tandem.v1.NoSuchService")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_watch_passes_through_the_interceptors(server: GrpcServer, channel: grpc.aio.Channel) -> None:
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=GENERATE))
    first = await watch.read()
    await server.mark_serving()
    second = await watch.read()
    watch.cancel()
    assert (first.status, second.status) == (health_pb2.HealthCheckResponse.NOT_SERVING,
                                              health_pb2.HealthCheckResponse.SERVING)


async def test_reflection_lists_every_service(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    names = sorted(s.name for s in responses[0].list_services_response.service)
    assert names == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", GENERATE, KV_TRANSFER,
                     SCHEDULER]


@pytest.mark.parametrize("name", sorted(ERRORS))
async def test_unary_errors_map_to_exact_codes(channel: grpc.aio.Channel, name: str) -> None:
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=(("x-raise", name),))
    assert (caught.value.code(), caught.value.details()) == (CODES[name], ERRORS[name].message)


@pytest.mark.parametrize("name", sorted(ERRORS))
async def test_streaming_errors_map_to_exact_codes(channel: grpc.aio.Channel, name: str) -> None:
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    call = stub.Generate(gateway_pb2.GenerateRequest(prompt="x"), metadata=(("x-raise", name),))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [response async for response in call]
    assert (caught.value.code(), caught.value.details()) == (CODES[name], ERRORS[name].message)


async def test_error_after_the_first_message_keeps_what_was_sent(channel: grpc.aio.Channel) -> None:
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    call = stub.Generate(gateway_pb2.GenerateRequest(prompt="late"), metadata=(("x-raise", "unavailable"),))
    first = await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert list(first.token_ids) == [1, 2]
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "decode worker decode-0 was lost")


async def test_overloaded_sends_retry_after_and_round_trips(channel: grpc.aio.Channel) -> None:
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=(("x-raise", "overloaded"),))
    assert {("retry-after", "3"), ("retry-after-ms", "2500")} <= set(caught.value.trailing_metadata())
    relayed = error_from_rpc(caught.value)
    assert (type(relayed), relayed.message, relayed.retry_after) == (
        Overloaded, "waiting queue full (256 requests)", 2.5)  # the precise hint, from retry-after-ms


async def test_invalid_request_round_trips_with_its_field(channel: grpc.aio.Channel) -> None:
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=(("x-raise", "invalid"),))
    relayed = error_from_rpc(caught.value)
    assert (type(relayed), relayed.field, relayed.message) == (
        InvalidRequest, "sampling.temperature", "sampling.temperature: must be >= 0, got -1")


async def test_client_streaming_errors_are_mapped(channel: grpc.aio.Channel) -> None:
    stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
    ok = await stub.Push(iter([kv_transfer_pb2.KvChunk(request_id="r")] * 3))
    assert ok.chunks == 3
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Push(iter([kv_transfer_pb2.KvChunk(request_id="r"), kv_transfer_pb2.KvChunk()]))
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "request_id: required on every chunk")


async def test_bidirectional_streaming_errors_are_mapped(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    ok = [ack async for ack in stub.ReportTokens(iter([scheduler_pb2.TokenBatch(worker_id="w")] * 3))]
    assert [ack.batches for ack in ok] == [3]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [ack async for ack in stub.ReportTokens(iter([scheduler_pb2.TokenBatch(worker_id="w"),
                                                       scheduler_pb2.TokenBatch()]))]
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "worker_id: required on every batch")


UNDECODABLE = (grpc.StatusCode.INVALID_ARGUMENT, "request: Error parsing message with type '{}': Wire format "
               "was corrupt; send a serialized message of the method's request type")


async def test_bytes_that_do_not_parse_are_invalid_argument(channel: grpc.aio.Channel) -> None:
    generate = channel.unary_stream(f"/{GENERATE}/Generate")  # no serializer: the bytes go as they are
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [message async for message in generate(b"\x00")]
    assert (caught.value.code(), caught.value.details()) == (
        UNDECODABLE[0], UNDECODABLE[1].format("tandem.v1.GenerateRequest"))
    report = channel.stream_stream(f"/{SCHEDULER}/ReportTokens")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [ack async for ack in report(iter([scheduler_pb2.TokenBatch(worker_id="w").SerializeToString(), b"\x00"]))]
    assert (caught.value.code(), caught.value.details()) == (
        UNDECODABLE[0], UNDECODABLE[1].format("tandem.v1.TokenBatch"))


async def test_deadline_and_trace_context_are_passed_on(channel: grpc.aio.Channel) -> None:
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    metadata = (("x-raise", "echo"), ("traceparent", traceparent), ("tracestate", "k=v"), ("other", "dropped"))
    timed = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=5)
    untimed = await stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata)
    assert 4.0 < float(timed.models[0].id) <= 5.1  # the wire rounds timeouts up a little
    assert untimed.models[0].id == "-1.000"
    assert json.loads(timed.models[0].owned_by) == [
        ["traceparent", traceparent], ["tracestate", "k=v"], ["x-tandem-internal-token", "secret"]]


async def test_api_keys_are_required_except_for_health() -> None:
    server = await _started(api_keys={"k1", "k2"})
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = gateway_pb2_grpc.GenerateServiceStub(channel)
            request = gateway_pb2.ListModelsRequest()
            refused = [((), "missing credentials"), ((("authorization", "Bearer nope"),), "invalid credentials"),
                       ((("authorization", "k1"),), "invalid credentials")]
            for metadata, details in refused:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.ListModels(request, metadata=metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert caught.value.details().startswith(details)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [r async for r in stub.Generate(gateway_pb2.GenerateRequest(prompt="x"))]
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            by_bearer = await stub.ListModels(request, metadata=(("authorization", "bearer k2"),))
            by_header = await stub.ListModels(request, metadata=(("x-api-key", "k1"),))
            assert by_bearer.models[0].id == by_header.models[0].id == "smol"
            assert await _health(channel) == "NOT_SERVING"
    finally:
        await server.stop(0)


async def test_internal_token_guards_internal_services() -> None:
    server = await _started(internal_token="s3cret")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            batches = [scheduler_pb2.TokenBatch(worker_id="w")]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [ack async for ack in stub.ReportTokens(iter(batches),
                                                        metadata=(("x-tandem-internal-token", "wrong"),))]
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            acks = [ack async for ack in stub.ReportTokens(iter(batches),
                                                            metadata=(("x-tandem-internal-token", "s3cret"),))]
            assert [ack.batches for ack in acks] == [1]
    finally:
        await server.stop(0)


async def test_a_busy_port_is_a_clear_error(server: GrpcServer) -> None:
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        create_server("127.0.0.1", server.port)


def _health_args(address: str, service: str = "", timeout: float = 2.0) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    health_cli.add_arguments(parser)
    return parser.parse_args([address, "--service", service, "--timeout", str(timeout)])


async def test_health_command_exit_codes(server: GrpcServer, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{server.port}"
    assert await asyncio.to_thread(health_cli.main, _health_args(address)) == 1
    assert capsys.readouterr().err == f"{address}: NOT_SERVING\n"
    await server.mark_serving()
    assert await asyncio.to_thread(health_cli.main, _health_args(address, GENERATE)) == 0
    assert capsys.readouterr().out == f"{address} {GENERATE}: SERVING\n"
    assert await asyncio.to_thread(health_cli.main, _health_args(address, "tandem.v1.Nope")) == 1
    assert capsys.readouterr().err.startswith(f"{address} tandem.v1.Nope: unknown service (NOT_FOUND")


async def test_health_command_on_a_closed_port_fails(server: GrpcServer, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{server.port}"
    await server.stop(0)
    assert await asyncio.to_thread(health_cli.main, _health_args(address, timeout=1.0)) == 1
    assert capsys.readouterr().err.startswith(f"{address}: unreachable (UNAVAILABLE")


_SERVE = """
import asyncio, sys
from services.common.grpc_server import create_server

async def main():
    server = create_server("127.0.0.1", 0)
    await server.start()
    await server.mark_serving()
    print(server.port, flush=True)
    await server.run_until_signal(grace=1.0)
    print("stopped", flush=True)

asyncio.run(main())
"""


def test_sigterm_stops_the_server_gracefully() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True, env=env,
                               cwd=REPO_ROOT)
    try:
        address = f"127.0.0.1:{process.stdout.readline().strip()}"
        health_cli.wait_until_serving(address, timeout=10)
        checked = subprocess.run([sys.executable, "-m", "services.common.health_cli", address],
                                 capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=30)
        assert (checked.returncode, checked.stdout) == (0, f"{address}: SERVING\n")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert process.stdout.read() == "stopped\n"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
