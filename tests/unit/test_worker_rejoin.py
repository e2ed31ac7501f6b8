"""A worker's membership across a scheduler restart: the worker's own Registration and
TokenReporter against a real scheduler servicer that is stopped and started again on the same port
with a fresh embedded store (as `tandem up` restarts a killed scheduler). Nothing but the restart
happens: the worker notices, registers again, reopens its token stream, and keeps its identity;
tokens produced while no stream was open wait for the next one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest

from services.common.grpc_server import create_server
from services.common.store import EmbeddedStore
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.registry import WorkerRegistry
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer
from services.scheduler.worker_clients import WorkerClients
from services.worker.events import TrackedRequest
from services.worker.registration import Registration
from services.worker.reporter import TokenReporter
from services.worker.runtime import ModelPlan, WorkerIdentity, WorkerRuntime
from services.worker.transport import internal_metadata, open_channel
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.streams import TokenStreams
from tests.waiting import eventually

TOKEN = "s3cret"
TTL_S = 1.0
WORKER = scheduler_pb2.WorkerInfo(worker_id="decode-w", role=common_pb2.WORKER_ROLE_DECODE, address="127.0.0.1:1",
                                  model="smol", num_blocks=64, block_size=16)
TOKEN_EVENT = scheduler_pb2.TokenEvent(request_id="r-1", output_offset=0, token_ids=[7])


@dataclass(slots=True)
class Scheduler:
    """One life of the scheduler on `port`: its own registry, store and token streams."""

    name: str
    dispatcher: Dispatcher
    server: object

    @classmethod
    async def start(cls, port: int, name: str) -> Scheduler:
        dispatcher = Dispatcher(WorkerRegistry(EmbeddedStore(), TTL_S), WorkerClients(TOKEN), max_queue=4,
                                max_running=4)
        server = create_server("127.0.0.1", port, internal_token=TOKEN)
        server.add_service(SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                           SchedulerServicer(dispatcher, scheduler_id=name))
        await server.start()
        await server.mark_serving()
        return cls(name, dispatcher, server)

    async def stop(self) -> None:
        """As SIGKILL looks to the worker: every connection drops at once."""
        await self.server.stop(0)
        await self.dispatcher.close()

    async def workers(self) -> list[str]:
        return [record.info.worker_id for record in await self.dispatcher.registry.live_workers()]


async def test_a_worker_rejoins_a_restarted_scheduler_and_reopens_its_token_stream():
    port = free_port()
    first = await Scheduler.start(port, "first")
    channel = open_channel(f"127.0.0.1:{port}")
    metadata = internal_metadata(TOKEN)
    taken_back: list[str] = []
    lost: list[int] = []
    membership: list[str] = []  # what the worker heard, in order

    async def on_reregistered(response: scheduler_pb2.RegisterWorkerResponse) -> None:
        taken_back.append(response.scheduler_id)
        membership.append(f"taken back by {response.scheduler_id}")

    def on_forgotten() -> None:  # before it registers again: its last answer is still the first scheduler's
        membership.append(f"forgotten while registered with {registration.response.scheduler_id}")

    registration = Registration(channel, WORKER, lambda: scheduler_pb2.WorkerLoad(free_blocks=64), metadata,
                                on_reregistered, on_forgotten=on_forgotten)
    reporter = TokenReporter(channel, WORKER.worker_id, metadata, on_lost=lambda: lost.append(1))
    second = None
    try:
        assert (await registration.register()).scheduler_id == "first"
        reporter.start()
        registration.start_heartbeats()
        await eventually(lambda: first.dispatcher.streams.is_open("decode-w"), "the token stream at the first")
        assert await first.workers() == ["decode-w"]

        await first.stop()
        await eventually(lambda: lost, "the reporter noticing its stream broke")
        # down a while, as a restart takes: the channel's reconnection attempts fail
        await eventually(lambda: channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                         "the worker's channel failing to reconnect")
        reporter.send(scheduler_pb2.TokenBatch(events=[TOKEN_EVENT]))  # routed here by the next scheduler, early
        second = await Scheduler.start(port, "second")
        batches: list[scheduler_pb2.TokenBatch] = []
        second.dispatcher.streams = TokenStreams(lambda _, batch: batches.append(batch),
                                                 second.dispatcher.membership.lost,
                                                 second.dispatcher.registry.report_blocks)
        await eventually(lambda: taken_back, "the worker registering again with the second scheduler")
        await eventually(lambda: second.dispatcher.streams.is_open("decode-w"), "the token stream at the second")
        assert taken_back == ["second"] and lost == [1]  # one break; the failed attempts after it fail nothing
        assert membership == ["forgotten while registered with first", "taken back by second"]
        await eventually(lambda: any(b.events for b in batches), "the early tokens reaching the second scheduler")
        assert [list(b.events) for b in batches if b.events] == [[TOKEN_EVENT]]
        assert registration.response.scheduler_id == "second"
        assert await second.workers() == ["decode-w"]
        assert await registration.heartbeat()  # known again: no further re-registration
        await registration.stop(deregister=True)
        assert await second.workers() == []  # the deregistration reached the second scheduler
    finally:
        await registration.stop(deregister=False)
        await reporter.stop()
        await channel.close()
        if second is not None:
            await second.stop()


async def test_a_worker_whose_id_is_held_by_other_info_registers_once_that_registration_lapses():
    port = free_port()
    scheduler = await Scheduler.start(port, "only")
    channel = open_channel(f"127.0.0.1:{port}")
    metadata = internal_metadata(TOKEN)
    moved = scheduler_pb2.WorkerInfo()
    moved.CopyFrom(WORKER)
    moved.address = "127.0.0.1:2"  # the same worker id, restarted on another address
    try:
        first = Registration(channel, WORKER, lambda: scheduler_pb2.WorkerLoad(free_blocks=64), metadata)
        await first.register()  # never heartbeats: its registration lapses after the TTL
        with_new_address = Registration(channel, moved, lambda: scheduler_pb2.WorkerLoad(free_blocks=64), metadata)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await with_new_address._register_once()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        assert (await with_new_address.register()).scheduler_id == "only"  # retried until the id was free
        records = await scheduler.dispatcher.registry.live_workers()
        assert [(r.info.worker_id, r.info.address) for r in records] == [("decode-w", "127.0.0.1:2")]
    finally:
        await channel.close()
        await scheduler.stop()


async def test_taken_back_a_worker_drops_only_the_requests_it_held_when_forgotten_not_those_placed_since():
    """The scheduler places requests on a worker as soon as it has taken it back, and their gateways
    attach only after: the worker, taking up the fresh registration, must not drop those (the
    scheduler that placed one is never told, and its request waits out its deadline)."""
    runtime = WorkerRuntime(WorkerIdentity("colo-w", common_pb2.WORKER_ROLE_COLOCATED, "127.0.0.1:1", "m", "cpu"),
                            ModelPlan({"m": 1}, 1), make_engine=None, schedulers=[])
    runtime.track(TrackedRequest("failed-by-expiry", num_prompt_tokens=4, logprobs=False), awaited=True)
    runtime.track(TrackedRequest("read-by-its-gateway", num_prompt_tokens=4, logprobs=False), awaited=True)
    reader = runtime.streams.follow("read-by-its-gateway", 1)
    next_event = asyncio.ensure_future(reader.__anext__())
    await eventually(lambda: runtime.streams.attached("read-by-its-gateway"), "the gateway attaching")
    runtime._on_forgotten()  # a heartbeat found the worker forgotten
    runtime.track(TrackedRequest("placed-after-taking-back", num_prompt_tokens=4, logprobs=False), awaited=True)
    try:
        await runtime._on_reregistered(SimpleNamespace(announce=lambda: None), scheduler_pb2.RegisterWorkerResponse())
        assert [runtime.was_aborted(rid) for rid in ("failed-by-expiry", "read-by-its-gateway",
                                                     "placed-after-taking-back")] == [True, False, False]
    finally:
        next_event.cancel()  # the gateway leaves: that request is given up too
        await asyncio.gather(next_event, return_exceptions=True)
        await eventually(lambda: runtime.was_aborted("read-by-its-gateway"), "the request its reader left dropped")
