"""A worker's heartbeats on its one Heartbeats stream (services/worker/heartbeat_stream.py) against a
real scheduler servicer: one stream carries them all, liveness still lapses by the TTL while the
stream stays open, a late answer never pairs with a later heartbeat, a restarted scheduler hears
the next heartbeat at once, and a scheduler without the stream gets unary calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from services.common.grpc_server import create_server
from services.common.store import EmbeddedStore
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.registry import WorkerRegistry
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer
from services.scheduler.worker_clients import WorkerClients
from services.worker.heartbeat_stream import HeartbeatStream
from services.worker.registration import Registration
from services.worker.transport import internal_metadata, open_channel
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.waiting import DEADLINE_S, eventually

TOKEN = "s3cret"
TTL_S = 5.0
WORKER = scheduler_pb2.WorkerInfo(worker_id="decode-w", role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                                  model="smol", num_blocks=64, block_size=16)
METADATA = internal_metadata(TOKEN)


class Clock:
    """A monotonic clock the test moves by hand (the registry's and the store's)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class Scheduler:
    """A real scheduler servicer on `port`, counting the Heartbeats streams it was asked to open."""

    name: str
    dispatcher: Dispatcher
    server: object
    opened: list[str]

    @classmethod
    async def start(cls, port: int, name: str, clock: Clock | None = None) -> Scheduler:
        clock = clock or Clock()
        registry = WorkerRegistry(EmbeddedStore(clock), TTL_S, clock=clock)
        dispatcher = Dispatcher(registry, WorkerClients(TOKEN), max_queue=4, max_running=4)
        opened: list[str] = []
        servicer = SchedulerServicer(dispatcher, scheduler_id=name)
        heartbeats = servicer.Heartbeats

        def counted(requests, context):
            opened.append(name)
            return heartbeats(requests, context)

        servicer.Heartbeats = counted
        server = create_server("127.0.0.1", port, internal_token=TOKEN)
        server.add_service(SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, servicer)
        await server.start()
        await server.mark_serving()
        return cls(name, dispatcher, server, opened)

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.dispatcher.close()

    async def workers(self) -> list[str]:
        return [record.info.worker_id for record in await self.dispatcher.registry.live_workers()]


def registration(channel: grpc.aio.Channel, taken_back: list[str]) -> Registration:
    async def on_reregistered(response: scheduler_pb2.RegisterWorkerResponse) -> None:
        taken_back.append(response.scheduler_id)

    return Registration(channel, WORKER, lambda: scheduler_pb2.WorkerLoad(free_blocks=64), METADATA, on_reregistered)


async def test_heartbeats_ride_one_stream_and_a_restarted_scheduler_hears_the_next_one_at_once():
    port = free_port()
    first = await Scheduler.start(port, "first")
    channel = open_channel(f"127.0.0.1:{port}")
    taken_back: list[str] = []
    worker = registration(channel, taken_back)
    second = None
    try:
        await worker.register()
        worker.interval_s = DEADLINE_S  # each answer may take the 2 s bound on a loaded machine
        assert [await worker.heartbeat() for _ in range(3)] == [True, True, True]
        assert first.opened == ["first"]  # three heartbeats, one stream

        await first.stop()
        second = await Scheduler.start(port, "second")
        await asyncio.wait_for(channel.channel_ready(), DEADLINE_S)
        # The old stream is found broken: the same heartbeat goes again on a new one, which the second
        # scheduler answers with "unknown", so the worker registers again, all in this one heartbeat.
        assert await worker.heartbeat() is False
        await eventually(lambda: taken_back, "the worker taking up its fresh registration")
        assert taken_back == ["second"] and second.opened == ["second"]
        assert await worker.heartbeat()
        assert second.opened == ["second"]
        assert await second.workers() == ["decode-w"]
    finally:
        await worker.stop(deregister=False)
        await channel.close()
        await first.stop()
        if second is not None:
            await second.stop()


async def test_a_worker_whose_heartbeats_stop_lapses_by_the_ttl_though_its_stream_stays_open():
    port = free_port()
    clock = Clock()
    scheduler = await Scheduler.start(port, "only", clock)
    channel = open_channel(f"127.0.0.1:{port}")
    worker = registration(channel, [])
    try:
        await worker.register()
        worker.interval_s = DEADLINE_S
        clock.now += TTL_S - 0.5
        assert await worker.heartbeat()  # renews: live for another TTL from here
        clock.now += TTL_S - 0.5
        assert await scheduler.workers() == ["decode-w"]

        clock.now += 0.5  # a TTL since the last heartbeat, the stream still open (a frozen worker's is)
        assert await scheduler.workers() == []
        assert scheduler.opened == ["only"]
        assert await worker.heartbeat() is False  # its next heartbeat, on the same stream, is told so
        assert scheduler.opened == ["only"]
    finally:
        await worker.stop(deregister=False)
        await channel.close()
        await scheduler.stop()


class HeldAnswers(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Answers each heartbeat on a stream with its load's `running` echoed in the policy's
    max_num_seqs; holds the answer to `running == 1` until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.opened = 0

    async def Heartbeats(self, requests, context):
        self.opened += 1
        async for request in requests:
            if request.load.running == 1:
                await self.release.wait()
            yield scheduler_pb2.HeartbeatResponse(known=True,
                                                  policy=scheduler_pb2.BatchPolicy(max_num_seqs=request.load.running))


class UnaryOnly(scheduler_pb2_grpc.SchedulerServiceServicer):
    """A scheduler from before the Heartbeats stream: its servicer answers Heartbeat calls only."""

    def __init__(self) -> None:
        self.calls = 0

    async def Heartbeat(self, request, context):
        self.calls += 1
        return scheduler_pb2.HeartbeatResponse(known=True)


async def serve(servicer: scheduler_pb2_grpc.SchedulerServiceServicer) -> tuple[object, str]:
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)  # it binds a port and reports it
    server.add_service(SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, servicer)
    await server.start()
    return server, f"127.0.0.1:{server.port}"


def beat(running: int) -> scheduler_pb2.HeartbeatRequest:
    return scheduler_pb2.HeartbeatRequest(worker_id="w", load=scheduler_pb2.WorkerLoad(running=running))


async def test_a_late_answer_closes_the_stream_and_never_pairs_with_the_next_heartbeat():
    servicer = HeldAnswers()
    server, address = await serve(servicer)
    channel = open_channel(address)
    stream = HeartbeatStream(scheduler_pb2_grpc.SchedulerServiceStub(channel), METADATA)
    try:
        assert (await stream.exchange(beat(0), DEADLINE_S)).policy.max_num_seqs == 0
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stream.exchange(beat(1), 0.2)  # its answer is held until released
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        servicer.release.set()  # the held answer goes out on the closed stream, read by nobody
        assert (await stream.exchange(beat(2), DEADLINE_S)).policy.max_num_seqs == 2
        assert servicer.opened == 2
    finally:
        stream.close()
        await channel.close()
        await server.stop(0)


async def test_a_scheduler_without_the_stream_gets_unary_heartbeats():
    servicer = UnaryOnly()
    server, address = await serve(servicer)
    channel = open_channel(address)
    stream = HeartbeatStream(scheduler_pb2_grpc.SchedulerServiceStub(channel), METADATA)
    try:
        assert (await stream.exchange(beat(0), DEADLINE_S)).known
        assert (await stream.exchange(beat(0), DEADLINE_S)).known
        assert servicer.calls == 2
    finally:
        stream.close()
        await channel.close()
        await server.stop(0)
