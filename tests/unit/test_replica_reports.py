"""What a worker sends each scheduler replica, so that no replica's work grows with the others'
(services/common/placer.py, services/worker/store_renewal.py):
- a request's first and final events go to the replica that placed it, named on the scheduler's
  calls; a request no known replica placed goes to every one;
- the block changes go to one replica: the first whose report stream is up;
- every replica hears every heartbeat, but one writes it to the store they share; while its
  heartbeats fail the next one does, and the others keep the worker live from their own mirror.
"""

from __future__ import annotations

import asyncio
import zlib
from types import SimpleNamespace

import grpc
from opentelemetry import trace

from services.common.block_hash import BlockHash
from services.common.placer import PLACER_KEY, placer_of
from services.common.store import EmbeddedStore, WorkerInfo, WorkerLoad, WorkerRole
from services.runtime.engine import RequestOutput
from services.scheduler.registry import WorkerRegistry
from services.scheduler.worker_clients import WorkerClients
from services.worker.engine_loop import StepResult
from services.worker.events import TokenBatcher, TrackedRequest
from services.worker.registration import Registration
from services.worker.runtime import ModelPlan, WorkerIdentity, WorkerRuntime
from services.worker.store_renewal import StoreRenewal
from services.worker.transport import open_channel
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, scheduler_pb2
from tests.clock import FakeClock
from tests.unit.test_heartbeat_stream import METADATA, TTL_S, WORKER, Clock, Scheduler
from tests.waiting import DEADLINE_S

INFO = WorkerInfo(worker_id="d-0", role=WorkerRole.DECODE, address="127.0.0.1:5003", model="smol",
                  num_blocks=64, block_size=4)


# -- the placer --------------------------------------------------------------------------------

async def test_the_scheduler_names_itself_on_every_call_to_a_worker() -> None:
    clients = WorkerClients("token", scheduler_id="sched-a")
    try:
        metadata = clients.metadata(trace.INVALID_SPAN)
        assert placer_of(metadata) == "sched-a" and ("x-tandem-internal-token", "token") in metadata
        assert placer_of(clients.assign("127.0.0.1:1")._metadata) == "sched-a"
        assert placer_of(WorkerClients("token").metadata(trace.INVALID_SPAN)) == ""  # unnamed: no pair
        assert placer_of([(PLACER_KEY, b"bytes")]) == "" and placer_of(None) == ""
    finally:
        await clients.close()


def test_the_batcher_gives_each_reported_event_its_placer() -> None:
    batcher = TokenBatcher("w")
    batcher.track(TrackedRequest("ra", 3, logprobs=False, placer="a"))
    batcher.track(TrackedRequest("rb", 3, logprobs=False, placer="b"))
    outputs = [RequestOutput(rid, [9], [], None, 3, 0, 1) for rid in ("rb", "ra")]
    step = StepResult(outputs, batch_size=2, iteration=1, started_ns=0, ended_ns=1, work={},
                      running_ids=frozenset({"ra", "rb"}), stored=[], evicted=[], snapshot=None)
    produced = batcher.batch(step)
    assert [e.request_id for e in produced.report.events] == ["rb", "ra"] and produced.placers == ("b", "a")


class Recorder:
    def __init__(self) -> None:
        self.batches: list[scheduler_pb2.TokenBatch] = []
        self.connected = asyncio.Event()  # as TokenReporter's: its stream is up

    def send(self, batch: scheduler_pb2.TokenBatch) -> None:
        self.batches.append(batch)


async def test_each_event_goes_to_the_replica_that_placed_its_request_and_an_unknown_one_to_all() -> None:
    channels = [open_channel("127.0.0.1:1"), open_channel("127.0.0.1:2")]
    runtime = WorkerRuntime(WorkerIdentity("w", common_pb2.WORKER_ROLE_COLOCATED, "127.0.0.1:3", "m", "cpu"),
                            ModelPlan({"m": 1}, 1), make_engine=None, schedulers=channels, report_blocks=False)
    try:
        runtime.reporters = [Recorder(), Recorder()]
        runtime.registrations = [SimpleNamespace(response=scheduler_pb2.RegisterWorkerResponse(scheduler_id=name))
                                 for name in ("a", "b")]
        batch = scheduler_pb2.TokenBatch(iteration=7, batch_size=4, events=[
            scheduler_pb2.TokenEvent(request_id=rid) for rid in ("of-a", "of-b", "unnamed", "of-a-gone")])
        runtime._report(batch, ("a", "b", "", "restarted-a"))
        received = [[[e.request_id for e in b.events] for b in r.batches] for r in runtime.reporters]
        assert received == [[["of-a", "unnamed", "of-a-gone"]], [["of-b", "unnamed", "of-a-gone"]]]
        assert [(b.iteration, b.batch_size) for r in runtime.reporters for b in r.batches] == [(7, 4), (7, 4)]
        runtime._report(scheduler_pb2.TokenBatch(events=[scheduler_pb2.TokenEvent(request_id="of-b")]), ("b",))
        assert [len(r.batches) for r in runtime.reporters] == [1, 2]  # nothing for a
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def test_the_block_changes_ride_the_first_replica_whose_stream_is_up() -> None:
    """The replicas share the prefix index through the store, so one takes the worker's block changes:
    the first, and once its stream broke (it died), the next one up."""
    channels = [open_channel("127.0.0.1:1"), open_channel("127.0.0.1:2")]
    runtime = WorkerRuntime(WorkerIdentity("w", common_pb2.WORKER_ROLE_COLOCATED, "127.0.0.1:3", "m", "cpu"),
                            ModelPlan({"m": 1}, 1), make_engine=None, schedulers=channels)
    try:
        runtime.reporters = [Recorder(), Recorder()]
        runtime.registrations = [SimpleNamespace(response=scheduler_pb2.RegisterWorkerResponse(scheduler_id=name))
                                 for name in ("a", "b")]
        for reporter in runtime.reporters:
            reporter.connected.set()

        def report_of_b(stored: str) -> None:
            runtime.blocks.note("m", [BlockHash(stored)], [])
            runtime._report(scheduler_pb2.TokenBatch(events=[scheduler_pb2.TokenEvent(request_id="of-b")]), ("b",),
                            blocks_wait_s=0.0)

        report_of_b("b1")
        runtime.reporters[0].connected.clear()  # the first replica's stream broke
        report_of_b("b2")
        assert [[(list(b.stored_blocks), [e.request_id for e in b.events]) for b in r.batches]
                for r in runtime.reporters] == [[(["b1"], [])], [([], ["of-b"]), (["b2"], ["of-b"])]]
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


# -- heartbeats to the store -------------------------------------------------------------------

def test_one_seat_renews_drawn_from_the_worker_id_and_the_next_while_it_fails() -> None:
    renewal = StoreRenewal("w-7", 4)
    first = zlib.crc32(b"w-7") % 4
    assert [renewal.renews(seat) for seat in range(4)] == [seat == first for seat in range(4)]
    renewal.heard(first, False)
    assert [renewal.renews(seat) for seat in range(4)] == [seat == (first + 1) % 4 for seat in range(4)]
    renewal.heard((first + 1) % 4, False)
    assert renewal.renews((first + 2) % 4)
    renewal.heard(first, True)  # back: it takes the renewal again
    assert renewal.renews(first) and not renewal.renews((first + 2) % 4)
    assert StoreRenewal("any", 1).renews(0)


class CountingStore:
    """One replica's door to the store the replicas share, counting its heartbeat writes."""

    def __init__(self, shared: EmbeddedStore) -> None:
        self._shared = shared
        self.heartbeats = 0

    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl: float) -> bool:
        self.heartbeats += 1
        return await self._shared.heartbeat(worker_id, load, ttl)

    def __getattr__(self, name: str):
        return getattr(self._shared, name)


async def test_a_replica_told_another_renews_keeps_the_worker_live_without_writing_the_store() -> None:
    clock = FakeClock()
    shared = EmbeddedStore(clock)
    renewer, mirror = CountingStore(shared), CountingStore(shared)
    registries = [WorkerRegistry(store, 5.0, clock) for store in (renewer, mirror)]
    for registry in registries:
        await registry.register(INFO, WorkerLoad())
    for _ in range(3):
        clock.now += 4.0
        assert await registries[0].heartbeat("d-0", WorkerLoad(free_blocks=5))
        assert await registries[1].heartbeat("d-0", WorkerLoad(free_blocks=5), renew_store=False)
    assert (renewer.heartbeats, mirror.heartbeats) == (3, 0)
    clock.now += 4.0  # the renewer's heartbeats stop: the store's entry lapses, the mirror's holds
    assert await registries[1].heartbeat("d-0", WorkerLoad(free_blocks=3), renew_store=False)
    clock.now += 2.0
    assert await shared.list_workers() == []
    assert [(r.info.worker_id, r.load.free_blocks) for r in await registries[1].live_workers()] == [("d-0", 3)]
    clock.now += 5.0  # and the worker's lapse is heard within the TTL all the same
    assert await registries[1].live_workers() == []
    assert await registries[1].heartbeat("d-0", WorkerLoad(), renew_store=False) is False


async def test_a_replica_that_never_heard_the_worker_asks_the_store_before_making_it_register_again() -> None:
    clock = FakeClock()
    shared = EmbeddedStore(clock)
    await WorkerRegistry(shared, 5.0, clock).register(INFO, WorkerLoad())
    restarted = CountingStore(shared)
    assert await WorkerRegistry(restarted, 5.0, clock).heartbeat("d-0", WorkerLoad(), renew_store=False)
    assert restarted.heartbeats == 1


async def test_two_replicas_one_store_write_a_heartbeat_handed_on_when_the_writer_goes() -> None:
    """Real scheduler servicers on one shared store, and the worker's two Registrations."""
    clock = Clock()
    shared = EmbeddedStore(clock)
    doors = [CountingStore(shared), CountingStore(shared)]
    ports = [free_port(), free_port()]
    schedulers = [await Scheduler.start(port, f"s{i}", clock) for i, port in enumerate(ports)]
    for scheduler, door in zip(schedulers, doors, strict=True):
        scheduler.dispatcher.registry.store = door
    channels = [open_channel(f"127.0.0.1:{port}") for port in ports]
    renewal = StoreRenewal(WORKER.worker_id, 2)
    workers = [Registration(channel, WORKER, lambda: scheduler_pb2.WorkerLoad(free_blocks=64), METADATA,
                            renewal=(renewal, seat)) for seat, channel in enumerate(channels)]
    writer = next(seat for seat in (0, 1) if renewal.renews(seat))
    other = 1 - writer
    try:
        for worker in workers:
            await worker.register()
            worker.interval_s = DEADLINE_S
        for _ in range(2):
            assert [await worker.heartbeat() for worker in workers] == [True, True]
        assert doors[writer].heartbeats == 2 and doors[other].heartbeats == 0

        await schedulers[writer].stop()
        try:
            await workers[writer].heartbeat()
            raise AssertionError("a heartbeat to a stopped scheduler went through")
        except grpc.aio.AioRpcError:
            pass
        assert await workers[other].heartbeat()
        assert doors[other].heartbeats == 1  # it writes now
        clock.now += TTL_S - 1  # past the writer's last write: the other's renewed the store entry
        assert [r.info.worker_id for r in await shared.list_workers()] == [WORKER.worker_id]
    finally:
        for worker in workers:
            await worker.stop(deregister=False)
        await asyncio.gather(*(channel.close() for channel in channels))
        for scheduler in schedulers:
            await scheduler.stop()
