"""The scheduler as a real grpc.aio server on loopback, with fake workers on their own ports:
the disaggregated and colocated flows, placements, reservations, queue limits, aborts, deadlines,
worker loss (token stream broken, heartbeat lapsed) and continuations, the degraded store, and
`tandem scheduler` + `tandem health`.

Liveness runs on a FakeClock: a worker lapses, and the degraded store is tried again, only when a
test advances it, so a loaded machine that starves this process cannot lapse a worker. The fake
workers heartbeat only when a test says (`heartbeat()`).

The scheduler carries no tokens: Submit answers with the request's Placement and ends OK when the
worker reports the final event (or says AttemptLost when its worker is lost; the test then acts as
the gateway and submits the continuation). A fake worker generates token i = 1000 + i, like a
deterministic model: a prompt that ends with tokens 1000..1000+k-1 (a continuation) goes on with
token k. Its prefill reports its first token on its ReportTokens stream and has the decode worker
report the rest on its own; `hold` keeps a decode worker from finishing (it reports its first token only).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.colocated.assignments import serve_assignments
from services.common.errors import Overloaded, Unavailable
from services.common.grpc_server import INTERNAL_TOKEN_KEY, create_server
from services.common.health_cli import wait_until_serving
from services.common.spans import Attr, Event
from services.common.store import EmbeddedStore, Store
from services.common.tracing import SpanName, setup_tracing
from services.common.wire import DEFAULT_MAX_TOKENS
from services.scheduler import dispatcher as dispatcher_module
from services.scheduler.batch_policy import SloPolicy
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.registry import STORE_RETRY_S, WorkerRegistry
from services.scheduler.main import SchedulerConfig, batch_policy
from services.scheduler.planner import room
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer
from services.scheduler.worker_clients import WorkerClients
from tandem.cli.ports import free_port
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.redis_store import RedisStore
from tests.clock import FakeClock
from tests.flaky_store import FlakyStore
from tests.redis_fixture import RedisServer, private_redis  # noqa: F401 (fixture)
from tests.waiting import DEADLINE_S, eventually, eventually_async

TOKEN = "s3cret"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_METADATA = ((INTERNAL_TOKEN_KEY, TOKEN), ("traceparent", f"00-{TRACE_ID}-b7ad6b7169203331-01"))
MODEL = "smol"
LENGTH = common_pb2.FINISH_REASON_LENGTH
WATCH_S = 0.05  # real seconds between the watcher's looks at the (fake) clock
ROLES = {"p": common_pb2.WORKER_ROLE_PREFILL, "d": common_pb2.WORKER_ROLE_DECODE,
         "c": common_pb2.WORKER_ROLE_COLOCATED}


def token(i: int) -> int:
    return 1000 + i


def generated(prompt: list[int]) -> int:
    """How many outputs a (continued) prompt already holds."""
    return sum(1 for t in prompt if t >= token(0))


@dataclass
class Call:
    worker: str
    method: str
    request: object
    metadata: dict[str, str]


@dataclass
class FakeWorker:
    """One worker of any role: records every call, reports tokens on its own ReportTokens stream."""

    worker_id: str
    mesh: Mesh
    free_blocks: int = 100
    num_blocks: int = 1000
    refuse: bool = False  # decode: refuse every Reserve for lack of blocks, whatever it reports
    hold_reserve: bool = False  # decode: never answer a Reserve
    hold: bool = False  # decode: report token 1, then nothing
    hold_prefill: bool = False  # prefill: never return, never report
    late_first_token: bool = False  # prefill: report token 0 after the decode worker's tokens
    cut_assign: bool = False  # colocated: break the Assign stream at its first request, unanswered
    address: str = ""
    calls: list[Call] = field(default_factory=list)

    async def start(self) -> None:
        self.server = create_server("127.0.0.1", 0, internal_token=TOKEN)
        services = {"p": worker_pb2_grpc.add_PrefillServiceServicer_to_server,
                    "d": worker_pb2_grpc.add_DecodeServiceServicer_to_server,
                    "c": worker_pb2_grpc.add_ColocatedServiceServicer_to_server}
        self.server.add_service("worker", services[self.worker_id[0]], self)
        await self.server.start()
        self.address = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.aio.insecure_channel(self.mesh.address)
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self.batches: asyncio.Queue[scheduler_pb2.TokenBatch] = asyncio.Queue()
        self.report()  # the stream opens with the worker's id
        self.stream = self.stub.ReportTokens(self._batches(), metadata=CLIENT_METADATA)
        info = scheduler_pb2.WorkerInfo(worker_id=self.worker_id, role=ROLES[self.worker_id[0]],
                                        address=self.address, model=MODEL, num_blocks=self.num_blocks, block_size=16,
                                        load=scheduler_pb2.WorkerLoad(free_blocks=self.free_blocks))
        await self.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=info), metadata=CLIENT_METADATA)

    def report(self, *events: scheduler_pb2.TokenEvent) -> None:
        self.batches.put_nowait(scheduler_pb2.TokenBatch(worker_id=self.worker_id, events=events))

    async def heartbeat(self) -> bool:
        request = scheduler_pb2.HeartbeatRequest(worker_id=self.worker_id,
                                                 load=scheduler_pb2.WorkerLoad(free_blocks=self.free_blocks))
        return (await self.stub.Heartbeat(request, metadata=CLIENT_METADATA)).known

    async def kill(self) -> None:
        """As SIGKILL looks to the scheduler: the token stream breaks, the server goes away."""
        self.stream.cancel()
        await self.server.stop(0)

    async def close(self) -> None:
        self.stream.cancel()
        await self.channel.close()
        await self.server.stop(0)

    async def _batches(self) -> AsyncIterator[scheduler_pb2.TokenBatch]:
        while True:
            yield await self.batches.get()

    def _record(self, method: str, request, context) -> None:
        self.calls.append(Call(self.worker_id, method, request, dict(context.invocation_metadata())))
        self.mesh.order.append(f"{self.worker_id} {method}")

    def called(self, method: str) -> list:
        return [c.request for c in self.calls if c.method == method]

    def generate(self, request_id: str, prompt_tokens: int, max_tokens: int, start: int, done: int = 0) -> None:
        """Report outputs start..max_tokens-1 (tokens done+start...): all at once, or output `start`
        only when holding."""
        end = start + 1 if self.hold else max_tokens
        for i in range(start, end):
            event = scheduler_pb2.TokenEvent(request_id=request_id, output_offset=i, token_ids=[token(done + i)])
            if i == max_tokens - 1:
                event.finish_reason = LENGTH
                event.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=max_tokens))
            self.report(event)

    # -- the worker services ---------------------------------------------------------------------

    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        self._record("Prefill", request, context)
        if self.hold_prefill:
            await asyncio.Event().wait()
        max_tokens, prompt, done = request.sampling.max_tokens, len(request.token_ids), generated(request.token_ids)
        first = scheduler_pb2.TokenEvent(request_id=request.request_id, output_offset=0, token_ids=[token(done)])
        finished = max_tokens == 1
        if finished:
            first.finish_reason = LENGTH
            first.usage.CopyFrom(common_pb2.Usage(prompt_tokens=prompt, completion_tokens=1))
        if not self.late_first_token:
            self.report(first)
        if not finished:
            decode = self.mesh.by_address(request.decode_address)
            decode.generate(request.request_id, prompt, max_tokens, start=1, done=done)
        if self.late_first_token:
            await asyncio.sleep(0.05)
            self.report(first)
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token_id=token(done),
                                          prompt_tokens=prompt, finish_reason=first.finish_reason)

    async def Reserve(self, request: worker_pb2.ReserveRequest, context) -> worker_pb2.ReserveResponse:
        self._record("Reserve", request, context)
        if self.hold_reserve:
            await asyncio.Event().wait()
        blocks = -(-request.num_tokens // 16)
        if self.refuse or blocks > self.free_blocks:
            raise Overloaded(f"{self.worker_id}: {self.free_blocks} free blocks", retry_after=2.0)
        return worker_pb2.ReserveResponse(block_ids=list(range(10, 10 + blocks)), free_blocks=self.free_blocks,
                                          block_size=16)

    async def Release(self, request: worker_pb2.ReleaseRequest, context) -> worker_pb2.ReleaseResponse:
        self._record("Release", request, context)
        return worker_pb2.ReleaseResponse()

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        self._record("Abort", request, context)
        return common_pb2.AbortResponse(aborted_ids=request.request_ids)

    async def Stats(self, request: worker_pb2.WorkerStatsRequest, context) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(worker_id=self.worker_id)

    async def Assign(self, requests: AsyncIterator[worker_pb2.RunRequest],
                     context) -> AsyncIterator[worker_pb2.RunResult]:
        async def run(request: worker_pb2.RunRequest) -> int:
            self._record("Assign", request, context)
            if not self.cut_assign:
                self.generate(request.request_id, len(request.token_ids), request.sampling.max_tokens, start=0,
                              done=generated(request.token_ids))
            return 0

        async for result in serve_assignments(requests, run):
            if self.cut_assign:
                raise Unavailable(f"{self.worker_id} is stopping")
            yield result


@dataclass
class Mesh:
    address: str
    dispatcher: Dispatcher
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    ttl: float
    clock: FakeClock
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    async def add(self, worker_id: str, **options) -> FakeWorker:
        worker = FakeWorker(worker_id, self, **options)
        await worker.start()
        self.workers[worker_id] = worker
        return worker

    def by_address(self, address: str) -> FakeWorker:
        return next(w for w in self.workers.values() if w.address == address)

    def submit(self, request_id: str, prompt_tokens: int = 20, max_tokens: int = 4, seed: int | None = None,
               **fields):
        request = scheduler_pb2.SubmitRequest(
            request_id=request_id, model=MODEL, token_ids=list(range(200, 200 + prompt_tokens)),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=seed), **fields)
        return self.stub.Submit(request, metadata=CLIENT_METADATA, timeout=DEADLINE_S)

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        return await self.stub.Stats(scheduler_pb2.SchedulerStatsRequest(recent_routes=8), metadata=CLIENT_METADATA)

    async def recovered(self) -> scheduler_pb2.SchedulerStats:
        """Stats once the scheduler is no longer degraded (it retries the store STORE_RETRY_S after it
        failed, on the mesh's clock: advance it first)."""
        async def probe() -> scheduler_pb2.SchedulerStats | None:
            stats = await self.stats()
            return None if stats.degraded else stats

        return await eventually_async(probe, "the scheduler recovered from the store outage")

    async def idle(self) -> scheduler_pb2.SchedulerStats:
        """Stats once the scheduler holds no request."""
        async def probe() -> scheduler_pb2.SchedulerStats | None:
            stats = await self.stats()
            return stats if stats.running == stats.waiting == len(self.dispatcher.inflight) == 0 else None

        return await eventually_async(probe, "the scheduler holding no request")


@asynccontextmanager
async def scheduler(*workers: str, ttl: float = 30.0, max_queue: int = 8, max_running: int = 4,
                    store: Store | None = None, spans: InMemorySpanExporter | None = None, migration: bool = True,
                    policy: scheduler_pb2.BatchPolicy | None = None, slo: SloPolicy | None = None,
                    watch_s: float = WATCH_S, **options) -> AsyncIterator[Mesh]:
    """A scheduler with the named fake workers ("p-0", "d-0", "c-0", ...) registered; its spans go to
    `spans` when given. `ttl` is in the mesh's clock's seconds, and in real ones for the scheduler's
    calls to workers (their control timeout); `watch_s` is the watcher's period, in real seconds."""
    clock = FakeClock()
    registry = WorkerRegistry(store or EmbeddedStore(clock), ttl, clock=clock)
    tracer = setup_tracing("scheduler", exporter=spans, install_global=False).get_tracer("test") if spans else None
    dispatcher = Dispatcher(registry, WorkerClients(TOKEN), max_queue=max_queue, max_running=max_running,
                            migration=migration, tracer=tracer)
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)
    server.add_service(SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                       SchedulerServicer(dispatcher, scheduler_id="test", policy=policy, slo=slo))
    await server.start()
    dispatcher.start(watch_s)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    mesh = Mesh(f"127.0.0.1:{server.port}", dispatcher, scheduler_pb2_grpc.SchedulerServiceStub(channel), ttl,
                clock)
    try:
        for worker_id in workers:
            await mesh.add(worker_id, **options.get(worker_id, {}))
        yield mesh
    finally:
        for worker in mesh.workers.values():
            await worker.close()
        await channel.close()
        await dispatcher.close()
        await server.stop(0)


async def rest(call) -> list[scheduler_pb2.SubmitEvent]:
    """The remaining messages of a Submit call read with read() (gRPC forbids mixing it with `async for`)."""
    events = []
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


async def placed(call) -> scheduler_pb2.Placement:
    """The Placement the call answers with first."""
    event = await call.read()
    assert event.HasField("placement"), event
    return event.placement


async def completes(call) -> scheduler_pb2.Placement:
    """The call's Placement, after which it ends OK (the worker reported the final event)."""
    events = await asyncio.wait_for(rest(call), DEADLINE_S)
    assert len(events) == 1 and events[0].HasField("placement"), events
    return events[0].placement


async def lost_after_kill(call, victim: FakeWorker) -> scheduler_pb2.AttemptLost:
    """Kills `victim` once the call is placed and its Prefill, if any, reached the prefill worker (the
    Placement is sent while the Prefill is in flight); the call says AttemptLost at once and ends OK."""
    placement = await placed(call)
    if placement.prefill_worker_id:
        prefill = victim.mesh.workers[placement.prefill_worker_id]
        await eventually(lambda: [r for r in prefill.called("Prefill") if r.request_id == placement.attempt_id],
                         f"{placement.prefill_worker_id} called with Prefill {placement.attempt_id}")
    await victim.kill()
    (event,) = await asyncio.wait_for(rest(call), DEADLINE_S)
    assert event.HasField("lost"), event
    return event.lost


def continuation(mesh: Mesh, request_id: str, delivered: list[int], migration: int = 1, prompt_tokens: int = 20,
                 max_tokens: int | None = 4, cache_salt: str = "", **sampling):
    """The continuation a gateway submits after AttemptLost, having delivered `delivered`."""
    request = scheduler_pb2.SubmitRequest(
        request_id=request_id, model=MODEL, token_ids=list(range(200, 200 + prompt_tokens)), cache_salt=cache_salt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling), delivered_token_ids=delivered,
        migration=migration)
    return mesh.stub.Submit(request, metadata=CLIENT_METADATA, timeout=DEADLINE_S)


async def refused_to_move(call, request_id: str, delivered: int, why: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await rest(call)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details() == (f"request {request_id}: a worker serving it was lost after {delivered} "
                                     f"token(s) and it cannot move on ({why}); retry the request")


# -- the flows -----------------------------------------------------------------------------------------

async def test_disaggregated_request_reserves_first_then_prefills_and_relays_in_order() -> None:
    async with scheduler("p-0", "d-0", **{"p-0": dict(late_first_token=True)}) as mesh:
        placement = await completes(mesh.submit("r1", prompt_tokens=20, max_tokens=4))
        prefill, decode = mesh.workers["p-0"], mesh.workers["d-0"]

        assert (placement.attempt_id, placement.generator_worker_id, placement.generator_address) == (
            "r1", "d-0", decode.address)
        assert (placement.prefill_worker_id, placement.prefill_address) == ("p-0", prefill.address)
        assert (placement.route.prefill_worker_id, placement.route.decode_worker_id) == ("p-0", "d-0")
        assert placement.route.reserved_blocks == 2 and placement.queue_ms >= 0

        assert mesh.order[:2] == ["d-0 Reserve", "p-0 Prefill"]
        (reserve,) = decode.called("Reserve")
        (request,) = prefill.called("Prefill")
        assert reserve.num_tokens == 21  # the prompt and the first token's slot
        assert (list(request.decode_block_ids), request.decode_address) == ([10, 11], decode.address)
        assert request.seed > 0 and request.sampling.seed == request.seed == placement.seed
        for call in prefill.calls + decode.calls:
            assert call.metadata["traceparent"].split("-")[1] == TRACE_ID
        assert decode.called("Release") == [] and decode.called("Abort") == []

        stats = await mesh.idle()
        assert (stats.submitted, stats.completed, stats.failed) == (1, 1, 0)
        assert [r.request_id for r in stats.recent_routes] == ["r1"]
        assert [w.info.worker_id for w in stats.workers] == ["d-0", "p-0"] and stats.store == "embedded"


async def test_a_request_ended_by_its_first_token_releases_its_reservation() -> None:
    async with scheduler("p-0", "d-0") as mesh:
        await completes(mesh.submit("r1", max_tokens=1))
        await eventually(lambda: mesh.workers["d-0"].called("Release"), 'mesh.workers["d-0"].called("Release")')
        assert [r.request_id for r in mesh.workers["d-0"].called("Release")] == ["r1"]
        await mesh.idle()


async def test_colocated_workers_run_the_whole_request_with_a_drawn_or_given_seed() -> None:
    async with scheduler("c-0", "p-0", "d-0") as mesh:
        placement = await completes(mesh.submit("r1", max_tokens=3))
        assert (placement.route.prefill_worker_id, placement.route.decode_worker_id) == ("c-0", "")
        assert (placement.generator_worker_id, placement.prefill_worker_id, placement.prefill_address) == ("c-0", "", "")
        await completes(mesh.submit("r2", max_tokens=2, seed=42))
        drawn, given = mesh.workers["c-0"].called("Assign")
        assert drawn.seed > 0 and drawn.sampling.seed == drawn.seed
        assert given.seed == given.sampling.seed == 42
        assert mesh.workers["p-0"].calls == [] and mesh.workers["d-0"].calls == []


async def test_a_placement_carries_the_decision_and_stats_the_candidates_scores() -> None:
    """The gateway reads no score: a Placement's route leaves them out, Stats' recent routes keep them."""
    async with scheduler("c-0", "c-1") as mesh:
        placement = await completes(mesh.submit("r1", prompt_tokens=20))
        (route,) = (await mesh.idle()).recent_routes
        assert [(s.cost, s.cached_blocks) for s in route.prefill_scores] == [(20.0, 0), (20.0, 0)]
        assert {s.worker_id for s in route.prefill_scores} == {"c-0", "c-1"} and not route.decode_scores
        assert route.prefill_scores[0].worker_id == route.prefill_worker_id == placement.generator_worker_id
        decision = scheduler_pb2.RouteInfo()
        decision.CopyFrom(route)
        decision.ClearField("prefill_scores")
        assert placement.route == decision and decision.request_id == "r1"


async def test_a_registering_worker_receives_the_configured_batch_policy() -> None:
    policy = batch_policy(SchedulerConfig(batch_max_tokens=1024, batch_chunk_size=128))
    async with scheduler(policy=policy) as mesh:
        info = scheduler_pb2.WorkerInfo(worker_id="p-9", role=ROLES["p"], address="127.0.0.1:9", model=MODEL,
                                        num_blocks=8, block_size=16)
        response = await mesh.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=info),
                                                  metadata=CLIENT_METADATA)
    assert response.policy == scheduler_pb2.BatchPolicy(max_num_batched_tokens=1024, max_num_seqs=0, chunk_size=128)


async def test_a_heartbeat_with_a_step_cost_model_gets_the_policy_meeting_the_slos() -> None:
    slo = SloPolicy(ttft_ms=1000, itl_ms=50, context_tokens=1024, max_seqs_cap=64)
    async with scheduler(slo=slo) as mesh:
        info = scheduler_pb2.WorkerInfo(worker_id="d-9", role=ROLES["d"], address="127.0.0.1:9", model=MODEL,
                                        num_blocks=8, block_size=16)
        await mesh.stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=info), metadata=CLIENT_METADATA)
        unfitted = await mesh.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(worker_id="d-9"), metadata=CLIENT_METADATA)
        cost = scheduler_pb2.StepCostModel(fixed_ms=10, per_token_ms=0.05, per_context_token_ms=0.0001,
                                           per_decode_context_ms=0.001)
        fitted = await mesh.stub.Heartbeat(scheduler_pb2.HeartbeatRequest(
            worker_id="d-9", load=scheduler_pb2.WorkerLoad(step_cost=cost)), metadata=CLIENT_METADATA)
    assert unfitted.known and not unfitted.HasField("policy")
    assert fitted.policy == scheduler_pb2.BatchPolicy(max_num_batched_tokens=576, max_num_seqs=64, chunk_size=512,
                                                      batch_window_ms=10, step_target_ms=50, min_prefill_tokens=52)


def test_slo_targets_go_together() -> None:
    with pytest.raises(ValueError, match=r"^--slo-ttft-ms and --slo-itl-ms go together, both > 0"):
        SchedulerConfig(slo_ttft_ms=1000)


def test_a_negative_batch_setting_is_refused_naming_its_flag() -> None:
    with pytest.raises(ValueError, match=r"^--batch-max-seqs must be >= 0 \(0 keeps each worker's own setting\), got -1$"):
        SchedulerConfig(batch_max_seqs=-1)


async def test_no_worker_for_the_model_is_unavailable() -> None:
    async with scheduler("p-0") as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [e async for e in mesh.submit("r1")]
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live decode worker serves model 'smol'" in error.value.details()
        stats = await mesh.idle()
        assert stats.failed == 1


# -- admission -----------------------------------------------------------------------------------------

async def test_a_full_queue_is_resource_exhausted_with_a_retry_hint() -> None:
    async with scheduler("p-0", "d-0", max_running=1, max_queue=1, **{"d-0": dict(hold=True)}) as mesh:
        running = mesh.submit("running")
        assert (await placed(running)).attempt_id == "running"
        queued = mesh.submit("queued")
        await eventually(lambda: mesh.dispatcher.admission.waiting == 1, 'mesh.dispatcher.admission.waiting == 1')
        stats = await mesh.stats()
        assert (stats.running, stats.waiting, stats.max_queue) == (1, 1, 1)

        with pytest.raises(grpc.aio.AioRpcError) as error:
            [e async for e in mesh.submit("refused")]
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting queue is full" in error.value.details()
        assert dict(error.value.trailing_metadata())["retry-after"] == "60"  # nothing has drained yet

        running.cancel()  # its slot goes to the queued request
        assert (await placed(queued)).attempt_id == "queued"
        queued.cancel()
        stats = await mesh.idle()
        assert (stats.submitted, stats.rejected, stats.aborted) == (3, 1, 2)


async def test_a_request_without_decode_room_waits_in_the_queue_until_a_worker_reports_room() -> None:
    options = {"d-0": dict(free_blocks=1), "d-1": dict(free_blocks=2)}
    async with scheduler("p-0", "d-0", "d-1", ttl=30.0, **options) as mesh:
        call = mesh.submit("big", prompt_tokens=40)  # 41 tokens: 3 blocks
        await eventually(lambda: mesh.dispatcher.admission.waiting == 1, 'mesh.dispatcher.admission.waiting == 1')
        assert (await mesh.stats()).waiting == 1
        assert mesh.workers["d-0"].calls == mesh.workers["d-1"].calls == []  # no Reserve while no room

        mesh.workers["d-1"].free_blocks = 3
        assert await mesh.workers["d-1"].heartbeat()
        assert (await completes(call)).route.decode_worker_id == "d-1"
        assert [r.request_id for r in mesh.workers["d-1"].called("Reserve")] == ["big"]
        assert mesh.workers["d-0"].calls == []
        stats = await mesh.idle()
        assert (stats.completed, stats.rejected) == (1, 0)


async def test_room_is_asked_once_for_a_request_let_in_at_once_and_again_after_a_wait(monkeypatch) -> None:
    """A request let in at once is routed on the one room() its arrival asked (nothing ran between);
    one that waited asks again when a report may let it in, and before it is routed. The watcher
    never ticks here: each tick lets the waiters ask again, which would add a check at random."""
    asked: list[str] = []

    def counting_room(registry, inflight, request):
        asked.append(request.request_id)
        return room(registry, inflight, request)

    monkeypatch.setattr(dispatcher_module, "room", counting_room)
    options = {"d-0": dict(free_blocks=1)}
    async with scheduler("p-0", "d-0", watch_s=3600.0, **options) as mesh:
        await completes(mesh.submit("small", prompt_tokens=10))  # 11 tokens: 1 block
        assert asked == ["small"]

        call = mesh.submit("big", prompt_tokens=40)  # 41 tokens: 3 blocks, d-0 has 1 free
        await eventually(lambda: mesh.dispatcher.admission.waiting == 1, 'mesh.dispatcher.admission.waiting == 1')
        assert asked == ["small", "big"]  # once: it fits some day (not NEVER), not now (LATER), so it waits
        mesh.workers["d-0"].free_blocks = 3
        assert await mesh.workers["d-0"].heartbeat()
        assert (await completes(call)).route.decode_worker_id == "d-0"
        assert asked == ["small", "big", "big", "big"]  # let in by the report, then checked again before routing


async def test_reserves_refused_on_a_stale_report_wait_for_the_next_report_in_order() -> None:
    async with scheduler("p-0", "d-0", ttl=30.0, max_queue=2, **{"d-0": dict(refuse=True)}) as mesh:
        decode = mesh.workers["d-0"]
        first = mesh.submit("first")
        await eventually(lambda: decode.called("Reserve") and mesh.dispatcher.admission.waiting == 1, 'decode.called("Reserve") and mesh.dispatcher.admission.waiting == 1')
        second = mesh.submit("second")  # behind the first, which waits at the head
        await eventually(lambda: mesh.dispatcher.admission.waiting == 2, 'mesh.dispatcher.admission.waiting == 2')
        await mesh.dispatcher.membership.check()  # a watcher tick changes nothing: d-0 counts as full
        assert [r.request_id for r in decode.called("Reserve")] == ["first"]

        decode.refuse = False
        assert await decode.heartbeat()
        await completes(first)
        await completes(second)
        assert [r.request_id for r in decode.called("Reserve")] == ["first", "first", "second"]
        stats = await mesh.idle()
        assert (stats.completed, stats.rejected, stats.failed) == (2, 0, 0)


async def test_the_scheduler_records_one_span_a_request_its_queue_and_route_as_events() -> None:
    spans = InMemorySpanExporter()
    async with scheduler("p-0", "d-0", spans=spans, **{"d-0": dict(refuse=True)}) as mesh:
        decode = mesh.workers["d-0"]
        call = mesh.submit("r1", max_tokens=3)
        await eventually(lambda: decode.called("Reserve") and mesh.dispatcher.admission.waiting == 1,
                         'decode.called("Reserve") and mesh.dispatcher.admission.waiting == 1')
        decode.refuse = False
        assert await decode.heartbeat()
        await completes(call)
        await mesh.idle()
    (submit,) = spans.get_finished_spans()
    assert submit.name == SpanName.SCHEDULER_SUBMIT
    assert [e.name for e in submit.events] == [  # the refused Reserve is an exception event (failures.py)
        Event.ADMITTED, "exception", Event.NO_ROOM, Event.ADMITTED, Event.ROUTED]
    assert set(json.loads(submit.events[2].attributes[Attr.ROUTE_SCORES])) == {"p-0", "d-0"}
    times = [submit.start_time, *(e.timestamp for e in submit.events), submit.end_time]
    assert times == sorted(times)
    attributes = dict(submit.attributes)
    assert {k: attributes[k] for k in (Attr.ROUTE_PREFILL_WORKER, Attr.ROUTE_DECODE_WORKER,
                                       Attr.GEN_AI_USAGE_OUTPUT_TOKENS)} == {
        Attr.ROUTE_PREFILL_WORKER: "p-0", Attr.ROUTE_DECODE_WORKER: "d-0", Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 3}
    assert attributes[Attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)


async def test_a_prompt_no_decode_worker_can_ever_hold_is_invalid_argument() -> None:
    options = {"d-0": dict(num_blocks=8, free_blocks=8), "d-1": dict(num_blocks=12, free_blocks=12)}
    async with scheduler("p-0", "d-0", "d-1", **options) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [e async for e in mesh.submit("huge", prompt_tokens=192)]  # 193 tokens: 13 blocks
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details() == (
            "token_ids: request huge: a prompt of 192 tokens needs 13 KV blocks of 16 tokens (with the first "
            "generated token); the largest decode worker holds 12; shorten the prompt")
        assert mesh.workers["d-0"].calls == mesh.workers["d-1"].calls == mesh.workers["p-0"].calls == []
        placement = await completes(mesh.submit("fits", prompt_tokens=191))  # 192 tokens: 12 blocks
        assert placement.route.decode_worker_id == "d-1"


# -- aborts and deadlines ------------------------------------------------------------------------------

async def test_cancelling_submit_aborts_the_request_on_both_workers() -> None:
    async with scheduler("p-0", "d-0", **{"p-0": dict(hold_prefill=True)}) as mesh:
        call = mesh.submit("r1")
        await eventually(lambda: mesh.workers["p-0"].called("Prefill"), 'mesh.workers["p-0"].called("Prefill")')
        call.cancel()
        await eventually(lambda: mesh.workers["p-0"].called("Abort") and mesh.workers["d-0"].called("Abort"), 'mesh.workers["p-0"].called("Abort") and mesh.workers["d-0"].called("Abort")')
        assert mesh.workers["d-0"].called("Abort")[0].request_ids == ["r1"]
        stats = await mesh.idle()
        assert stats.aborted == 1


async def test_abort_rpc_ends_the_call_and_aborts_the_request_on_its_workers() -> None:
    async with scheduler("p-0", "d-0", **{"d-0": dict(hold=True)}) as mesh:
        call = mesh.submit("r1")
        await placed(call)
        response = await mesh.stub.Abort(common_pb2.AbortRequest(request_ids=["r1", "unknown"]),
                                         metadata=CLIENT_METADATA)
        assert list(response.aborted_ids) == ["r1"]
        assert await rest(call) == []
        await eventually(lambda: mesh.workers["d-0"].called("Abort"), 'mesh.workers["d-0"].called("Abort")')
        assert (await mesh.idle()).aborted == 1


async def test_a_request_past_its_deadline_fails_and_is_aborted_on_its_workers() -> None:
    async with scheduler("p-0", "d-0", **{"d-0": dict(hold=True)}) as mesh:
        call = mesh.submit("r1", deadline_unix_ms=int(time.time() * 1000) + 2000)  # time to be placed, loaded
        await placed(call)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest(call)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: mesh.workers["d-0"].called("Abort"), 'mesh.workers["d-0"].called("Abort")')
        assert mesh.workers["d-0"].called("Abort")[0].reason == "deadline passed"


async def test_a_worker_error_event_becomes_the_submit_status_with_its_detail_on_the_span() -> None:
    spans = InMemorySpanExporter()
    async with scheduler("p-0", "d-0", spans=spans, **{"d-0": dict(hold=True)}) as mesh:
        call = mesh.submit("r1")
        await call.read()
        mesh.workers["d-0"].report(scheduler_pb2.TokenEvent(
            request_id="r1", output_offset=2, finish_reason=common_pb2.FINISH_REASON_ERROR,
            error=common_pb2.RequestError(code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="bad KV")))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest(call)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.value.details() == "request r1: a worker failed it with FAILED_PRECONDITION; its trace has the detail"
        assert (await mesh.idle()).failed == 1
        (submit,) = [s for s in spans.get_finished_spans() if s.name == SpanName.SCHEDULER_SUBMIT]
        assert [dict(e.attributes) for e in submit.events if e.name == "exception"] == [
            {"exception.type": "FAILED_PRECONDITION",
             "exception.message": "worker d-0 failed the request: FAILED_PRECONDITION: bad KV"}]


async def test_a_cancelled_error_the_request_did_not_ask_for_is_unavailable(monkeypatch) -> None:
    async def cut(*args):
        raise asyncio.CancelledError  # as an awaited call whose channel closed under it raises

    monkeypatch.setattr(dispatcher_module, "plan_route", cut)
    async with scheduler("p-0", "d-0") as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [e async for e in mesh.submit("r1")]
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error.value.details() == "request r1: a call it needed was cut; retry the request"
        assert (await mesh.idle()).failed == 1


async def test_an_unexpected_exception_is_internal_with_a_stable_message(monkeypatch) -> None:
    async def broken(*args):
        raise RuntimeError("store answered garbage at 10.0.0.7:6379")

    monkeypatch.setattr(dispatcher_module, "plan_route", broken)
    async with scheduler("p-0", "d-0") as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [e async for e in mesh.submit("r1")]
        assert error.value.code() == grpc.StatusCode.INTERNAL
        assert error.value.details() == "request r1: the scheduler failed it (internal error); its log has the detail"
        assert (await mesh.idle()).failed == 1


# -- worker loss ---------------------------------------------------------------------------------------

async def test_a_broken_token_stream_without_migration_ends_the_attempt_at_once_and_no_continuation_moves() -> None:
    options = {"d-0": dict(hold=True, free_blocks=100), "d-1": dict(free_blocks=50)}
    async with scheduler("p-0", "d-0", "d-1", ttl=3600.0, migration=False, **options) as mesh:
        victim = mesh.workers["d-0"]
        lost = await lost_after_kill(mesh.submit("doomed"), victim)  # the TTL is an hour: the stream told
        assert (lost.worker_id, lost.reason) == ("d-0", "request doomed: a worker serving it was lost; retry the request")
        await refused_to_move(continuation(mesh, "doomed", [token(0), token(1)]), "doomed", 2, "migration is off")

        stats = await mesh.idle()
        assert [w.info.worker_id for w in stats.workers] == ["d-1", "p-0"]
        assert (stats.submitted, stats.failed, stats.migrated) == (1, 1, 0)
        assert await victim.heartbeat() is False  # it must register again
        assert (await completes(mesh.submit("next"))).route.decode_worker_id == "d-1"


async def test_a_lost_decode_workers_request_moves_on_as_the_continuation_the_gateway_submits() -> None:
    spans = InMemorySpanExporter()
    options = {"d-0": dict(hold=True, free_blocks=100), "d-1": dict(free_blocks=50)}
    async with scheduler("p-0", "d-0", "d-1", ttl=3600.0, spans=spans, **options) as mesh:
        call = mesh.submit("moved", max_tokens=6, seed=7, cache_salt="tenant")
        assert (await lost_after_kill(call, mesh.workers["d-0"])).worker_id == "d-0"
        placement = await completes(continuation(mesh, "moved", [token(0), token(1)], max_tokens=6, seed=7,
                                                 cache_salt="tenant"))

        assert (placement.attempt_id, placement.generator_worker_id, placement.seed) == ("moved#migrated-1", "d-1", 7)
        prefill = mesh.workers["p-0"].called("Prefill")
        assert [r.request_id for r in prefill] == ["moved", "moved#migrated-1"]
        assert list(prefill[1].token_ids) == list(range(200, 220)) + [token(0), token(1)]
        assert (prefill[1].sampling.max_tokens, prefill[1].seed, prefill[1].cache_salt) == (4, 7, "tenant")
        assert prefill[1].decode_worker_id == "d-1"
        assert [r.num_tokens for r in mesh.workers["d-1"].called("Reserve")] == [23]

        stats = await mesh.idle()
        assert (stats.submitted, stats.completed, stats.failed, stats.migrated) == (1, 1, 0, 1)
        assert [(r.request_id, r.decode_worker_id) for r in stats.recent_routes] == [("moved", "d-0"), ("moved", "d-1")]
        submits = [s for s in spans.get_finished_spans() if s.name == SpanName.SCHEDULER_SUBMIT]
        assert [[dict(e.attributes) for e in s.events if e.name == Event.MIGRATED] for s in submits] == [
            [{Attr.MIGRATION_FROM: "d-0"}], [{Attr.MIGRATION_OFFSET: 2}]]


async def test_a_continuation_arriving_before_the_lost_attempts_call_ended_takes_it_over() -> None:
    options = {"d-0": dict(hold=True, free_blocks=100), "d-1": dict(free_blocks=50)}
    async with scheduler("p-0", "d-0", "d-1", ttl=3600.0, **options) as mesh:
        call = mesh.submit("r1")
        assert (await placed(call)).generator_worker_id == "d-0"  # the gateway saw d-0's stream break before the scheduler did
        mesh.workers["d-0"].refuse = True
        placement = await completes(continuation(mesh, "r1", [token(0)]))
        assert (placement.attempt_id, placement.generator_worker_id) == ("r1#migrated-1", "d-1")
        assert await rest(call) == []
        await eventually(lambda: mesh.workers["d-0"].called("Abort"), 'mesh.workers["d-0"].called("Abort")')
        assert mesh.workers["d-0"].called("Abort")[0].reason == "the request moved to another worker"
        stats = await mesh.idle()
        assert (stats.submitted, stats.completed, stats.aborted, stats.migrated) == (1, 1, 0, 1)


async def test_a_lost_colocated_workers_request_moves_on_to_another_colocated_worker() -> None:
    async with scheduler("c-0", "c-1", ttl=3600.0, **{"c-0": dict(hold=True)}) as mesh:
        await lost_after_kill(mesh.submit("r1", max_tokens=4), mesh.workers["c-0"])
        placement = await completes(continuation(mesh, "r1", [token(0)]))
        assert (placement.generator_worker_id, placement.prefill_address) == ("c-1", "")
        (moved,) = mesh.workers["c-1"].called("Assign")
        assert (moved.request_id, list(moved.token_ids)) == ("r1#migrated-1", list(range(200, 220)) + [token(0)])
        assert moved.sampling.max_tokens == 3
        assert (await mesh.idle()).migrated == 1


async def test_a_colocated_worker_whose_assign_stream_breaks_fails_the_request_as_unavailable() -> None:
    async with scheduler("c-0", **{"c-0": dict(cut_assign=True)}) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest(mesh.submit("r1"))
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.UNAVAILABLE, "request r1: a colocated worker it needed stopped answering; retry the request")
        mesh.workers["c-0"].cut_assign = False
        await completes(mesh.submit("r2"))  # on a new stream
        assert [r.request_id for r in mesh.workers["c-0"].called("Assign")] == ["r1", "r2"]
        await eventually(lambda: mesh.workers["c-0"].called("Abort"), 'mesh.workers["c-0"].called("Abort")')
        assert [list(r.request_ids) for r in mesh.workers["c-0"].called("Abort")] == [["r1"]]
        stats = await mesh.idle()
        assert (stats.completed, stats.failed) == (1, 1)


async def test_a_continuation_keeps_its_min_tokens_and_its_default_max_tokens_apart() -> None:
    async with scheduler("p-0", "d-0", ttl=3600.0) as mesh:
        await completes(continuation(mesh, "r1", [token(0), token(1)], prompt_tokens=10, max_tokens=None,
                                     min_tokens=5))
        (moved,) = mesh.workers["p-0"].called("Prefill")
        assert (moved.sampling.max_tokens, moved.sampling.min_tokens) == (DEFAULT_MAX_TOKENS - 2, 3)


async def test_a_continuation_with_a_presence_penalty_and_tokens_delivered_is_refused() -> None:
    async with scheduler("p-0", "d-0", ttl=3600.0) as mesh:
        await refused_to_move(continuation(mesh, "r1", [token(0), token(1)], presence_penalty=0.5), "r1", 2,
                              "presence and frequency penalties count output tokens, which a continuation cannot "
                              "tell apart")
        await completes(continuation(mesh, "r2", [], presence_penalty=0.5))  # nothing delivered: it may move
        await refused_to_move(continuation(mesh, "r3", [token(0)], migration=4), "r3", 1, "it moved 3 times already")
        stats = await mesh.idle()
        assert (stats.failed, stats.migrated, stats.completed) == (2, 1, 1)
        assert [r.request_id for r in mesh.workers["p-0"].called("Prefill")] == ["r2#migrated-1"]


@pytest.mark.parametrize(("fields", "message"), [
    (dict(migration=-1), "migration: must be >= 0 (0: a new request), got -1"),
    (dict(migration=0, delivered_token_ids=[token(0)]),
     "delivered_token_ids: are for a continuation only (migration > 0)"),
    (dict(migration=1, delivered_token_ids=[token(i) for i in range(4)]),
     "delivered_token_ids: 4 token(s) delivered of max_tokens 4: nothing is left to generate"),
])
async def test_a_continuation_that_makes_no_sense_is_invalid_and_changes_nothing(fields, message) -> None:
    async with scheduler("p-0", "d-0") as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest(mesh.submit("r1", **fields))
        assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        stats = await mesh.idle()
        assert (stats.submitted, stats.failed) == (0, 0)
        assert mesh.workers["p-0"].calls == mesh.workers["d-0"].calls == []


async def test_a_continuation_with_no_worker_left_is_unavailable() -> None:
    async with scheduler("p-0", "d-0", ttl=3600.0, **{"d-0": dict(hold=True)}) as mesh:
        await lost_after_kill(mesh.submit("r1"), mesh.workers["d-0"])
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest(continuation(mesh, "r1", [token(0), token(1)]))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live decode worker serves model 'smol'" in error.value.details()
        stats = await mesh.idle()
        assert (stats.failed, stats.migrated) == (1, 0)


async def test_a_prefill_worker_lost_mid_transfer_frees_the_reservation_and_the_continuation_is_routed_again() -> None:
    async with scheduler("p-0", "p-1", "d-0", ttl=3600.0, **{"p-0": dict(hold_prefill=True)}) as mesh:
        call = mesh.submit("r1")
        assert (await placed(call)).prefill_worker_id == "p-0"
        await eventually(lambda: mesh.workers["p-0"].called("Prefill"), 'mesh.workers["p-0"].called("Prefill")')
        mesh.workers["p-0"].stream.cancel()  # heard first here; a Prefill cut first says "stopped answering"
        (lost,) = await asyncio.wait_for(rest(call), DEADLINE_S)
        await mesh.workers["p-0"].kill()
        assert lost.lost.reason == "request r1: a worker serving it was lost; retry the request"
        placement = await completes(continuation(mesh, "r1", []))
        assert placement.route.prefill_worker_id == "p-1"
        (moved,) = mesh.workers["p-1"].called("Prefill")
        assert (moved.request_id, list(moved.token_ids)) == ("r1#migrated-1", list(range(200, 220)))
        decode = mesh.workers["d-0"]
        assert [r.request_id for r in decode.called("Reserve")] == ["r1", "r1#migrated-1"]
        await eventually(lambda: decode.called("Abort"), 'decode.called("Abort")')
        assert [list(r.request_ids) for r in decode.called("Abort")] == [["r1"]]  # the first reservation
        stats = await mesh.idle()
        assert (stats.completed, stats.failed, stats.migrated) == (1, 0, 1)


async def test_a_lapsed_heartbeat_ends_the_attempt_and_drops_the_worker() -> None:
    async with scheduler("p-0", "d-0", **{"d-0": dict(hold=True)}) as mesh:
        call = mesh.submit("r1")
        await placed(call)
        mesh.clock.advance(mesh.ttl / 2)
        assert await mesh.workers["p-0"].heartbeat()  # d-0 sends none: it lapses first
        mesh.clock.advance(mesh.ttl / 2)
        (lost,) = await asyncio.wait_for(rest(call), DEADLINE_S)  # once the watcher looks
        assert (lost.lost.worker_id, lost.lost.reason) == ("d-0", "request r1: a worker serving it was lost; "
                                                                   "retry the request")
        stats = await mesh.idle()
        assert [w.info.worker_id for w in stats.workers] == ["p-0"]


async def test_a_reserve_cut_by_its_workers_loss_moves_on_to_the_next_decode_worker() -> None:
    options = {"d-0": dict(hold_reserve=True, free_blocks=100), "d-1": dict(free_blocks=50)}
    async with scheduler("p-0", "d-0", "d-1", ttl=30.0, **options) as mesh:
        call = mesh.submit("r1")
        await eventually(lambda: mesh.workers["d-0"].called("Reserve"), 'mesh.workers["d-0"].called("Reserve")')
        mesh.dispatcher.membership.lost("d-0", "its heartbeat lapsed")  # closes its channel: the Reserve is cut
        assert (await completes(call)).route.decode_worker_id == "d-1"
        stats = await mesh.idle()
        assert (stats.completed, stats.failed) == (1, 0)


async def test_a_reserve_cut_with_no_other_decode_worker_is_unavailable() -> None:
    async with scheduler("p-0", "d-0", ttl=30.0, **{"d-0": dict(hold_reserve=True)}) as mesh:
        call = mesh.submit("r1")
        await eventually(lambda: mesh.workers["d-0"].called("Reserve"), 'mesh.workers["d-0"].called("Reserve")')
        mesh.dispatcher.membership.lost("d-0", "its heartbeat lapsed")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rest(call)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error.value.details() == "request r1: a decode worker it needed stopped answering; retry the request"
        assert mesh.workers["p-0"].calls == []
        assert (await mesh.idle()).failed == 1


async def test_a_reserve_a_worker_never_answers_ends_within_the_heartbeat_ttl() -> None:
    async with scheduler("p-0", "d-0", ttl=1.0, **{"d-0": dict(hold_reserve=True)}) as mesh:
        # d-0 stays live (the mesh's clock stands still): the Reserve's own timeout, the TTL, ends it
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [e async for e in mesh.submit("r1")]
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error.value.details() == "request r1: a decode worker it needed stopped answering; retry the request"
        assert (await mesh.idle()).failed == 1


# -- the store -----------------------------------------------------------------------------------------

async def test_store_down_routes_degraded_from_the_last_known_state_and_recovers() -> None:
    store = FlakyStore()
    async with scheduler("p-0", "d-0", store=store) as mesh:
        store.down = True
        route = (await completes(mesh.submit("r1"))).route
        assert route.degraded and route.matched_prefix_blocks == 0
        stats = await mesh.stats()
        assert stats.degraded and stats.store == "redis"
        assert [w.info.worker_id for w in stats.workers] == ["d-0", "p-0"]

        store.down = False
        mesh.clock.advance(STORE_RETRY_S)  # the scheduler leaves a failed store alone that long
        await mesh.recovered()
        assert not (await completes(mesh.submit("r2"))).route.degraded


async def test_redis_going_away_and_coming_back_empty_keeps_serving(private_redis: RedisServer) -> None:
    store = RedisStore(private_redis.url, timeout=10.0)  # a killed Redis refuses at once; a slow one is no outage
    try:
        async with scheduler("p-0", "d-0", ttl=60.0, store=store) as mesh:  # Redis expires its keys in real time
            assert not (await mesh.stats()).degraded
            private_redis.stop()
            assert (await completes(mesh.submit("during"))).route.degraded
            assert (await mesh.stats()).degraded

            private_redis.start()  # no persistence: it comes back empty
            mesh.clock.advance(STORE_RETRY_S)
            stats = await mesh.recovered()
            assert [w.info.worker_id for w in stats.workers] == ["d-0", "p-0"]
            assert await store.list_workers() == []
            for worker in mesh.workers.values():  # their next heartbeats refill it
                assert await worker.heartbeat()
            assert sorted(r.info.worker_id for r in await store.list_workers()) == ["d-0", "p-0"]
            assert not (await completes(mesh.submit("after"))).route.degraded
    finally:
        await store.close()


# -- the command ---------------------------------------------------------------------------------------

def test_tandem_scheduler_serves_and_reports_serving(tmp_path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")} | {
        "TANDEM_RUN_DIR": str(tmp_path), "TANDEM_INTERNAL_TOKEN": TOKEN * 4}
    with open(tmp_path / "scheduler.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "tandem.cli", "scheduler", "--host", "127.0.0.1",
                                    "--port", str(port), "--metrics-port", "0"], env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(f"127.0.0.1:{port}", timeout=30)
        health = subprocess.run([sys.executable, "-m", "tandem.cli", "health", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=30)
        assert health.returncode == 0, health.stderr
        process.terminate()
        assert process.wait(timeout=15) == 0
    finally:
        process.kill()
        process.wait()
