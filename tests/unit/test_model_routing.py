"""Model-aware routing and placement through the scheduler's own objects, without processes: the
planner over a registry of multi-model workers (holders first, a loader only when no holder has
room, both disaggregated workers able to serve the model, latency placement's refusal), the routing
map seen by a second scheduler on the same store (embedded and Redis), and the loads the scheduler
orders (ProvisionModel, cost placement's copies, one of them when two replicas plan it at once)
against fake ModelService stubs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from services.common.errors import FailedPrecondition, InvalidRequest, NotFound, Overloaded
from services.common.redis_store import RedisStore
from services.common.store import (
    EmbeddedStore, ModelResidency, ModelState, Store, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole,
)
from services.gateway.client_errors import for_client
from services.scheduler.convert import residency_to_pb
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.inflight import InflightTable
from services.scheduler.model_loads import ModelLoads
from services.scheduler.model_placement import Action, ActionKind, ModelPlacement, ReplicaRule, routing_map
from services.scheduler.planner import Room, plan_route, room
from services.scheduler.registry import WorkerRegistry
from services.scheduler.servicer import SchedulerServicer
from tandem.v1 import scheduler_pb2, worker_pb2
from tests.redis_fixture import redis_server  # noqa: F401 (fixture)
from tests.flaky_store import FlakyStore
from tests.waiting import DEADLINE_S, eventually

BLOCK = 16
GIB = 1 << 30
CATALOGUE = ("smol", "chat", "code")


def resident(name: str, *, pinned: bool = False, active: int = 0, idle_ms: int = 0) -> ModelResidency:
    return ModelResidency(name, pinned=pinned, weight_bytes=GIB, active_requests=active, idle_ms=idle_ms)


def record(worker_id: str, *models: ModelResidency, role: WorkerRole = WorkerRole.COLOCATED, free_blocks: int = 64,
           catalogue: tuple[str, ...] = CATALOGUE, free_gib: int = 4, running: int = 0) -> WorkerRecord:
    info = WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{7000 + int(worker_id[-1])}",
                      model=catalogue[0], num_blocks=64, block_size=BLOCK, catalogue=catalogue,
                      model_memory_bytes=8 * GIB)
    return WorkerRecord(info, WorkerLoad(free_blocks=free_blocks, running=running, models=models,
                                         free_model_memory_bytes=free_gib * GIB))


async def registry_with(*records: WorkerRecord, store: Store | None = None,
                        placement: ModelPlacement = ModelPlacement.COST) -> WorkerRegistry:
    registry = WorkerRegistry(store or EmbeddedStore(), ttl=5.0, placement=placement)
    for r in records:
        await registry.register(r.info, r.load)
    return registry


def submit(model: str, prompt_tokens: int = 40) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="r-1", model=model, token_ids=list(range(1, prompt_tokens + 1)))


async def route(registry: WorkerRegistry, model: str) -> tuple[list[str], list[str]]:
    plan = await plan_route(registry, InflightTable(), submit(model))
    return [s.worker_id for s in plan.prefill], [s.worker_id for s in plan.decode]


async def test_a_request_goes_to_a_worker_holding_its_model_before_a_less_loaded_one() -> None:
    registry = await registry_with(record("c-0", resident("smol")), record("c-1", resident("chat"), running=3),
                                   record("c-2", resident("chat")), record("c-3", catalogue=("smol",)))
    plan = await plan_route(registry, InflightTable(), submit("chat"))
    assert plan.colocated and [s.worker_id for s in plan.prefill] == ["c-1", "c-2", "c-0"]  # c-3 cannot serve chat


async def test_a_worker_loads_the_model_only_when_no_holder_has_room() -> None:
    # c-1 holds chat but has 2 free blocks: a 40-token prompt needs 3. The loader: least loaded, then memory.
    registry = await registry_with(record("c-1", resident("chat"), free_blocks=2), record("c-2", free_gib=1),
                                   record("c-3", free_gib=6), record("c-4", free_gib=8, running=1))
    assert await route(registry, "chat") == (["c-3", "c-2", "c-4", "c-1"], [])


async def test_disaggregated_prefill_and_decode_workers_both_serve_the_model() -> None:
    registry = await registry_with(
        record("p-0", resident("smol"), role=WorkerRole.PREFILL), record("p-1", resident("code"), role=WorkerRole.PREFILL),
        record("p-2", role=WorkerRole.PREFILL, catalogue=("smol",)),
        record("d-0", resident("smol"), role=WorkerRole.DECODE), record("d-1", resident("code"), role=WorkerRole.DECODE,
                                                                        free_blocks=2),
        record("d-2", role=WorkerRole.DECODE, free_gib=8))
    # prefill: the holder p-1, then p-0 to load it (p-2 cannot); decode: the holder d-1 is full, so d-2 loads it first.
    assert await route(registry, "code") == (["p-1", "p-0"], ["d-2", "d-0", "d-1"])


async def test_latency_placement_refuses_an_unprovisioned_model_and_never_routes_to_a_loader() -> None:
    registry = await registry_with(record("c-0", resident("smol", pinned=True)), record("c-1", resident("chat")),
                                   record("c-2", resident("chat", pinned=True), free_blocks=1),
                                   placement=ModelPlacement.LATENCY)
    with pytest.raises(FailedPrecondition, match="^model 'code' is not provisioned: --placement latency serves only "
                                                 "provisioned models and never loads one for a request; provision it "
                                                 "first: tandem models provision code --replicas N$"):
        await plan_route(registry, InflightTable(), submit("code"))
    assert await route(registry, "chat") == (["c-1", "c-2"], [])  # the full holder c-2, never the idle c-0
    # Admission only asks whether the request may wait for room: it lets the refused one through, routing refuses it.
    assert room(registry, InflightTable(), submit("code")) is Room.NOW


@pytest.fixture(params=["embedded", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    yield EmbeddedStore() if request.param == "embedded" else RedisStore(
        request.getfixturevalue("redis_server").url, namespace=f"t-{request.node.name}")


async def test_a_second_scheduler_on_the_same_store_sees_the_same_routing_map(store: Store) -> None:
    first = await registry_with(record("c-0", resident("smol", pinned=True)), record("c-1"), store=store)
    assert await first.heartbeat("c-1", WorkerLoad(models=(resident("chat", active=2),
                                                           ModelResidency("code", state=ModelState.LOADING))))
    second = WorkerRegistry(store, ttl=5.0)  # restarted, or another replica
    records = await second.live_workers()
    assert routing_map(records) == {"smol": ["c-0"], "chat": ["c-1"], "code": ["c-1"]}
    assert records[1].load.models == (resident("chat", active=2), ModelResidency("code", state=ModelState.LOADING))
    assert records[1].info.catalogue == CATALOGUE and records[1].info.model_memory_bytes == 8 * GIB
    await store.close()


class FakeModelService:
    """A worker's ModelService: loads what it is told unless its id is in `refuse`."""

    def __init__(self, worker_id: str, calls: list[tuple[str, str, str, bool]], refuse: set[str]) -> None:
        self.worker_id, self.calls, self.refuse = worker_id, calls, refuse

    async def LoadModel(self, request: worker_pb2.LoadModelRequest, timeout: float,
                        metadata: tuple) -> worker_pb2.LoadModelResponse:
        self.calls.append(("load", self.worker_id, request.model, request.pin))
        if self.worker_id in self.refuse:
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="every model is busy or pinned")
        residency = resident(request.model, pinned=request.pin)
        return worker_pb2.LoadModelResponse(model=residency_to_pb(residency), evicted=["smol"])

    async def UnloadModel(self, request: worker_pb2.UnloadModelRequest, timeout: float,
                          metadata: tuple) -> worker_pb2.UnloadModelResponse:
        self.calls.append(("unload", self.worker_id, request.model, False))
        return worker_pb2.UnloadModelResponse(unloaded=True)


class FakeClients:
    def __init__(self, refuse: set[str] = frozenset()) -> None:
        self.calls: list[tuple[str, str, str, bool]] = []
        self.refuse = refuse

    def models(self, address: str) -> FakeModelService:
        return FakeModelService(f"c-{int(address.rsplit(':', 1)[1]) - 7000}", self.calls, self.refuse)

    def metadata(self, span) -> tuple:
        return ()


async def test_provisioning_pins_holders_first_then_the_bin_packing_choice_and_the_map_shows_it_at_once() -> None:
    registry = await registry_with(record("c-0", resident("chat", pinned=True)), record("c-1", resident("chat")),
                                   record("c-2", free_gib=2), record("c-3", resident("smol", idle_ms=9), free_gib=2),
                                   record("c-4", free_gib=1))
    clients = FakeClients()
    assert await ModelLoads(registry, clients).provision("chat", 4) == ["c-0", "c-1", "c-3", "c-2"]
    assert clients.calls == [("load", "c-1", "chat", True), ("load", "c-3", "chat", True),
                             ("load", "c-2", "chat", True)]
    records = await WorkerRegistry(registry.store, ttl=5.0).live_workers()  # another scheduler, before a heartbeat
    assert routing_map(records)["chat"] == ["c-0", "c-1", "c-2", "c-3"]
    assert [m.name for m in records[3].load.models] == ["chat"]  # smol was evicted for it


async def test_provisioning_tries_the_next_worker_after_a_refusal_and_says_when_too_few_could_take_it() -> None:
    registry = await registry_with(record("c-1", free_gib=3), record("c-2", free_gib=2), record("c-3", free_gib=1))
    clients = FakeClients(refuse={"c-1", "c-3"})
    assert await ModelLoads(registry, clients).provision("code", 1) == ["c-2"]
    with pytest.raises(Overloaded) as short:
        await ModelLoads(registry, FakeClients(refuse={"c-1", "c-3"})).provision("chat", 2)
    assert short.value.message == ("model 'chat' is pinned on c-2: only 1 of 2 colocated workers could take it; free "
                                   "model memory there (unpin or unload a model) or start more workers, then "
                                   "provision again")


async def test_provisioning_a_model_no_catalogue_holds_is_not_found() -> None:
    registry = await registry_with(record("c-1"))
    with pytest.raises(NotFound, match=r"^no live worker's catalogue holds model 'big'; add it to a worker's catalogue "
                                       r"\(\$TANDEM_HOME/models/big, or --model big=DIR\) and start the worker$"):
        await ModelLoads(registry, FakeClients()).provision("big", 1)


async def test_provisioning_a_disaggregated_model_pins_it_on_prefill_and_decode_workers() -> None:
    registry = await registry_with(record("p-1", role=WorkerRole.PREFILL), record("p-2", role=WorkerRole.PREFILL),
                                   record("d-3", role=WorkerRole.DECODE, free_gib=1),
                                   record("d-4", role=WorkerRole.DECODE, free_gib=5))
    clients = FakeClients()
    clients.models = lambda address: FakeModelService(
        {"7001": "p-1", "7002": "p-2", "7003": "d-3", "7004": "d-4"}[address.rsplit(":", 1)[1]], clients.calls, set())
    assert await ModelLoads(registry, clients).provision("code", 1) == ["p-1", "d-4"]


async def test_cost_placement_copies_a_hot_model_and_drops_a_cold_copy() -> None:
    registry = await registry_with(record("c-1", resident("chat", active=9)), record("c-2", free_gib=1),
                                   record("c-3", free_gib=6),
                                   record("c-4", resident("code", idle_ms=300_000), resident("smol")),
                                   record("c-5", resident("code", idle_ms=1_000)))
    clients = FakeClients()
    done = await ModelLoads(registry, clients).rebalance(ReplicaRule(hot_active=8, cold_idle_ms=120_000))
    assert done == [Action(ActionKind.LOAD, "chat", "c-3"), Action(ActionKind.UNLOAD, "code", "c-4")]
    assert clients.calls == [("load", "c-3", "chat", False), ("unload", "c-4", "code", False)]
    assert routing_map(await registry.live_workers()) == {"chat": ["c-1", "c-3"], "smol": ["c-4"], "code": ["c-5"]}


class SlowModelService(FakeModelService):
    """A ModelService whose loads wait until `done` is set (a cold start in progress)."""

    def __init__(self, worker_id: str, calls: list[tuple[str, str, str, bool]], done: asyncio.Event) -> None:
        super().__init__(worker_id, calls, set())
        self.done = done

    async def LoadModel(self, request: worker_pb2.LoadModelRequest, timeout: float,
                        metadata: tuple) -> worker_pb2.LoadModelResponse:
        self.calls.append(("load", self.worker_id, request.model, request.pin))
        await self.done.wait()
        return worker_pb2.LoadModelResponse(model=residency_to_pb(resident(request.model)))


async def test_two_replicas_start_one_extra_load_of_a_hot_model_and_requests_wait_for_it(store: Store) -> None:
    hot = (record("c-1", resident("chat", active=9)), record("c-2", free_gib=6), record("c-3", free_gib=4))
    first = await registry_with(*hot, store=store)
    second = WorkerRegistry(store, ttl=5.0)  # another scheduler replica on the same store
    done, calls = asyncio.Event(), []
    clients = FakeClients()
    clients.models = lambda address: SlowModelService(f"c-{address[-1]}", calls, done)
    rule = ReplicaRule(hot_active=8, cold_idle_ms=120_000)
    copying = asyncio.create_task(ModelLoads(first, clients).rebalance(rule))
    await eventually(lambda: calls == [("load", "c-2", "chat", False)], "the copy's LoadModel sent")
    # Before c-2 reports: the routing map shows the copy LOADING, for this replica and the other.
    for registry in (first, second):
        records = await registry.live_workers()
        assert routing_map(records)["chat"] == ["c-1", "c-2"]
        assert records[1].load.models == (ModelResidency("chat", state=ModelState.LOADING),)
    assert await ModelLoads(second, clients).rebalance(rule) == []  # no second copy: c-3 stays free
    assert await ModelLoads(first, clients).rebalance(rule) == []
    # c-1 has no room left: a request stays with the holders (the router's order), c-3 does not start another load.
    await first.heartbeat("c-1", WorkerLoad(free_blocks=0, models=(resident("chat", active=9),)))
    assert await route(first, "chat") == (["c-1", "c-2", "c-3"], [])
    done.set()
    assert await copying == [Action(ActionKind.LOAD, "chat", "c-2")]
    assert calls == [("load", "c-2", "chat", False)]
    assert (await second.live_workers())[1].load.models == (resident("chat"),)
    await store.close()


def listing_together(registry: WorkerRegistry, barrier: asyncio.Barrier) -> None:
    """Make the registry's listings wait for the other party's: both replicas plan from the same state."""
    listed = registry.live_workers

    async def live_workers() -> list[WorkerRecord]:
        records = await listed()
        await asyncio.wait_for(barrier.wait(), DEADLINE_S)
        return records

    registry.live_workers = live_workers


async def test_two_replicas_planning_the_same_copy_at_the_same_instant_send_one_load(store: Store) -> None:
    first = await registry_with(record("c-1", resident("chat", active=9)), record("c-2", free_gib=6), store=store)
    second = WorkerRegistry(store, ttl=5.0)  # another scheduler replica on the same store
    both_listed = asyncio.Barrier(2)
    for registry in (first, second):
        listing_together(registry, both_listed)  # neither sees the other's LOADING mark: only the claim tells
    done, calls = asyncio.Event(), []
    clients = FakeClients()
    clients.models = lambda address: SlowModelService(f"c-{address[-1]}", calls, done)
    rule = ReplicaRule(hot_active=8)
    rounds = asyncio.gather(ModelLoads(first, clients).rebalance(rule), ModelLoads(second, clients).rebalance(rule))
    await eventually(lambda: calls, "a LoadModel sent")
    assert await store.claim("copy:colocated:chat", "a third replica", ttl=30) is False, "claimed while loading"
    done.set()
    assert sorted(await rounds, key=len) == [[], [Action(ActionKind.LOAD, "chat", "c-2")]]
    assert calls == [("load", "c-2", "chat", False)]
    assert await store.claim("copy:colocated:chat", "a third replica", ttl=30) is True, "released when loaded"
    await store.close()


async def test_a_failed_copy_leaves_the_routing_map_so_the_next_round_may_try_again() -> None:
    registry = await registry_with(record("c-1", resident("chat", active=9)), record("c-2", free_gib=6))
    clients = FakeClients(refuse={"c-2"})
    assert await ModelLoads(registry, clients).rebalance(ReplicaRule(hot_active=8)) == []
    assert routing_map(await registry.live_workers()) == {"chat": ["c-1"]}
    assert await registry.store.claim("copy:colocated:chat", "another replica", ttl=30) is True, "released"


async def test_a_disaggregated_hot_model_is_copied_for_prefill_and_for_decode_in_one_round() -> None:
    registry = await registry_with(record("p-1", resident("chat", active=9), role=WorkerRole.PREFILL),
                                   record("p-2", role=WorkerRole.PREFILL),
                                   record("d-3", resident("chat", active=9), role=WorkerRole.DECODE),
                                   record("d-4", role=WorkerRole.DECODE))
    clients = FakeClients()
    clients.models = lambda address: FakeModelService(
        {"7001": "p-1", "7002": "p-2", "7003": "d-3", "7004": "d-4"}[address.rsplit(":", 1)[1]], clients.calls, set())
    done = await ModelLoads(registry, clients).rebalance(ReplicaRule(hot_active=8))
    assert done == [Action(ActionKind.LOAD, "chat", "p-2"), Action(ActionKind.LOAD, "chat", "d-4")]
    assert clients.calls == [("load", "p-2", "chat", False), ("load", "d-4", "chat", False)]


async def test_no_copy_goes_out_while_the_store_is_down_and_one_does_once_it_answers() -> None:
    store = FlakyStore()
    registry = await registry_with(record("c-1", resident("chat", active=9)), record("c-2", free_gib=6), store=store)
    clients, store.down = FakeClients(), True
    assert await ModelLoads(registry, clients).rebalance(ReplicaRule(hot_active=8)) == []
    assert clients.calls == [] and registry.degraded, "no replica could see the claim: none is taken"
    store.down = False
    copied = await ModelLoads(registry, clients).rebalance(ReplicaRule(hot_active=8))
    assert copied == [Action(ActionKind.LOAD, "chat", "c-2")]
    assert clients.calls == [("load", "c-2", "chat", False)]


async def test_provision_model_refuses_an_empty_name_or_negative_replicas() -> None:
    registry = await registry_with(record("c-1"))
    servicer = SchedulerServicer(Dispatcher(registry, FakeClients(), max_queue=1, max_running=1), "s")
    with pytest.raises(InvalidRequest, match="^model: must name a catalogue model$"):
        await servicer.ProvisionModel(scheduler_pb2.ProvisionModelRequest(replicas=1), None)
    with pytest.raises(InvalidRequest, match=r"^replicas: must be >= 0 \(0 means 1\), got -2$"):
        await servicer.ProvisionModel(scheduler_pb2.ProvisionModelRequest(model="chat", replicas=-2), None)


def test_the_gateway_tells_the_client_why_an_unprovisioned_model_is_refused() -> None:
    refusal = FailedPrecondition("model 'code' is not provisioned: ... tandem models provision code --replicas N")
    assert for_client(refusal, "r-1") is refusal
