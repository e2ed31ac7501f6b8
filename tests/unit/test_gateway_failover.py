"""The gateway over several schedulers (`--scheduler a,b`): requests go to them by their leading
prefix (replica_choice.py: one prompt family to one scheduler); a Submit
that cannot reach its scheduler before placement goes to the next one, and, while none can be
reached, round after round until the deadline (a scheduler restarting loses no request that has
not started); a scheduler's own refusal is final."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from services.common.errors import Unavailable
from services.common.grpc_server import GrpcServer, create_server
from services.common.tokenizer import TextCodec
from services.gateway import client_errors
from services.gateway.generation import GenerationPipeline
from services.gateway.main import GENERATE_SERVICE
from services.gateway.request import ServedModel
from services.gateway.servicer import GenerateServicer
from services.gateway.upstream import Upstream
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.placing_scheduler import PlacingScheduler
from tests.waiting import eventually

REPLY = [1000, 1001]


class CountingScheduler(PlacingScheduler):
    """Places every request and answers REPLY, or refuses with `refuse`; counts its requests."""

    def __init__(self) -> None:
        self.submits: list[str] = []
        self.refuse: Exception | None = None

    async def events(self, request, context) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.submits.append(request.request_id)
        if self.refuse is not None:
            raise self.refuse
        yield scheduler_pb2.TokenEvent(request_id=request.request_id, token_ids=REPLY,
                                       finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                       usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=2))


async def start_scheduler(port: int = 0) -> tuple[CountingScheduler, GrpcServer]:
    scheduler = CountingScheduler()
    server = create_server("127.0.0.1", port)
    scheduler.serve_on(server)
    await server.start()
    scheduler.placed_at(server.port)
    return scheduler, server


@asynccontextmanager
async def gateway(default_model_dir: Path, *ports: int) -> AsyncIterator[gateway_pb2_grpc.GenerateServiceStub]:
    codec = TextCodec.from_model_dir(default_model_dir)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
    pipeline = GenerationPipeline(codec, ServedModel.from_model_dir(default_model_dir, codec), Upstream(channels))
    server = create_server("127.0.0.1", 0)
    server.add_service(GENERATE_SERVICE, gateway_pb2_grpc.add_GenerateServiceServicer_to_server,
                       GenerateServicer(pipeline, default_timeout=30.0))
    await server.start()
    client = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield gateway_pb2_grpc.GenerateServiceStub(client)
    finally:
        await client.close()
        await server.stop(0)
        for channel in channels:
            await channel.close()
        pipeline.close()


async def tokens(stub: gateway_pb2_grpc.GenerateServiceStub, request_id: str, timeout: float = 20.0) -> list[int]:
    request = gateway_pb2.GenerateRequest(prompt="Hi", request_id=request_id)
    return [t async for r in stub.Generate(request, timeout=timeout) for t in r.token_ids]


async def test_requests_of_one_prompt_go_to_one_scheduler(default_model_dir) -> None:
    (a, a_server), (b, b_server) = await start_scheduler(), await start_scheduler()
    try:
        async with gateway(default_model_dir, a_server.port, b_server.port) as stub:
            for i in range(4):
                assert await tokens(stub, f"r{i}") == REPLY
        assert sorted([a.submits, b.submits], key=len) == [[], ["r0", "r1", "r2", "r3"]]
    finally:
        await a_server.stop(0)
        await b_server.stop(0)


async def test_a_scheduler_that_cannot_be_reached_is_passed_over(default_model_dir) -> None:
    live, server = await start_scheduler()
    try:
        async with gateway(default_model_dir, free_port(), server.port) as stub:
            for i in range(3):
                assert await tokens(stub, f"r{i}") == REPLY
        assert live.submits == ["r0", "r1", "r2"]
    finally:
        await server.stop(0)


async def test_a_request_sent_while_the_only_scheduler_restarts_waits_for_it(default_model_dir, caplog) -> None:
    caplog.set_level(logging.INFO, logger="services.gateway.generation")
    port = free_port()
    async with gateway(default_model_dir, port) as stub:
        pending = asyncio.ensure_future(tokens(stub, "early"))
        await eventually(lambda: "no scheduler can be reached" in caplog.text, "a round of refused connections")
        assert not pending.done()
        scheduler, server = await start_scheduler(port)
        try:
            assert await asyncio.wait_for(pending, 20) == REPLY
            assert scheduler.submits == ["early"]
        finally:
            await server.stop(0)


async def test_a_schedulers_own_refusal_is_final(default_model_dir) -> None:
    (a, a_server), (b, b_server) = await start_scheduler(), await start_scheduler()
    a.refuse = b.refuse = Unavailable("no live decode worker serves model 'x'")
    try:
        async with gateway(default_model_dir, a_server.port, b_server.port) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await tokens(stub, "refused")
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert error.value.details() == f"{client_errors.NO_WORKER} (request refused)"  # the scheduler answered
        assert sorted([a.submits, b.submits], key=len) == [[], ["refused"]]  # the other was not asked
    finally:
        await a_server.stop(0)
        await b_server.stop(0)


async def test_no_scheduler_reachable_until_the_deadline_is_unavailable(default_model_dir) -> None:
    async with gateway(default_model_dir, free_port(), free_port()) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await tokens(stub, "lost", timeout=1.5)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # given up while time was left to say so
        assert error.value.details() == f"{client_errors.NO_SCHEDULER} (request lost)"
