"""Routing: exact prefill costs and choices on crafted loads and prefix matches, tenant salts and
models kept apart through the block-hash chain, decode choice by free blocks (minus fresh reservations) then
running requests, and degraded routing without prefix hits."""

from __future__ import annotations

import json

from opentelemetry import trace

from services.common.block_hash import hash_chain
from services.common.store import EmbeddedStore, ModelResidency, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from services.scheduler.model_placement import ModelPlacement
from services.scheduler.deadline import Deadline
from services.scheduler.inflight import InflightTable, Placement, RequestState, Status
from services.scheduler.planner import RECORDED_SCORES, RoutePlan, plan_route
from services.scheduler.registry import WorkerRegistry
from services.scheduler.ending import Ending
from services.scheduler.router import Candidate, Score, cached_tokens, prefill_cost, rank_decode, rank_prefill
from tandem.v1 import scheduler_pb2
from tests.flaky_store import FlakyStore

BLOCK = 16


def test_prefill_cost_is_uncached_prompt_plus_queued_tokens() -> None:
    assert prefill_cost(prompt_tokens=100, cached=64, queued_prefill_tokens=30) == 66
    assert cached_tokens(cached_blocks=4, block_size=16, prompt_tokens=100) == 64
    # The last prompt token is always computed: a full hit still costs one token.
    assert cached_tokens(cached_blocks=4, block_size=16, prompt_tokens=64) == 63
    assert cached_tokens(cached_blocks=0, block_size=16, prompt_tokens=1) == 0


def test_prefill_prefers_the_cached_prefix_until_its_queue_outweighs_it() -> None:
    warm = Candidate("p-warm", BLOCK, cached_blocks=6, queued_prefill_tokens=90)
    cold = Candidate("p-cold", BLOCK, queued_prefill_tokens=0)
    # 100-token prompt: warm = (100 - 96) + 90 = 94, cold = 100.
    assert rank_prefill([cold, warm], 100) == [
        Score("p-warm", 94.0, cached_blocks=6, queued_prefill_tokens=90),
        Score("p-cold", 100.0),
    ]
    busier = Candidate("p-warm", BLOCK, cached_blocks=6, queued_prefill_tokens=97)
    assert [s.worker_id for s in rank_prefill([busier, cold], 100)] == ["p-cold", "p-warm"]


def test_prefill_ties_go_to_fewer_running_then_lower_id() -> None:
    ranked = rank_prefill([Candidate("c", BLOCK, running=2), Candidate("b", BLOCK, running=1),
                           Candidate("a", BLOCK, running=2)], 10)
    assert [(s.worker_id, s.cost, s.running) for s in ranked] == [("b", 10.0, 1), ("a", 10.0, 2), ("c", 10.0, 2)]


def test_degraded_prefill_ignores_prefix_hits_and_takes_the_least_loaded() -> None:
    warm = Candidate("p-warm", BLOCK, cached_blocks=6, queued_prefill_tokens=50)
    cold = Candidate("p-cold", BLOCK, queued_prefill_tokens=10)
    assert rank_prefill([warm, cold], 100, use_prefix=False) == [
        Score("p-cold", 110.0, queued_prefill_tokens=10),
        Score("p-warm", 150.0, queued_prefill_tokens=50),
    ]


def test_decode_ranks_by_free_blocks_then_running_and_puts_too_small_ones_last() -> None:
    candidates = [
        Candidate("d-a", BLOCK, free_blocks=100, running=3),
        Candidate("d-b", BLOCK, free_blocks=100, running=1),
        Candidate("d-c", BLOCK, free_blocks=40, running=0),
        Candidate("d-tiny", BLOCK, free_blocks=1, running=0),
    ]
    # 17 tokens need 2 blocks: d-tiny cannot take them.
    assert rank_decode(candidates, 17) == [
        Score("d-b", -100.0, free_blocks=100, running=1),
        Score("d-a", -100.0, free_blocks=100, running=3),
        Score("d-c", -40.0, free_blocks=40),
        Score("d-tiny", -1.0, free_blocks=1),
    ]


# -- the planner: registry + prefix index + this scheduler's in-flight requests ---------------------

def record(worker_id: str, role: WorkerRole, free_blocks: int = 1000, model: str = "smol") -> WorkerRecord:
    info = WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{hash(worker_id) % 1000 + 40000}",
                      model=model, num_blocks=1000, block_size=BLOCK)
    return WorkerRecord(info, WorkerLoad(free_blocks=free_blocks))


async def registry_with(*records: WorkerRecord) -> WorkerRegistry:
    registry = WorkerRegistry(EmbeddedStore(), ttl=5.0)
    for r in records:
        await registry.register(r.info, r.load)
    return registry


def submit(tokens: list[int], salt: str = "", model: str = "smol") -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="r", model=model, token_ids=tokens, cache_salt=salt)


async def test_prefix_hits_route_to_the_caching_worker_and_salts_never_share() -> None:
    registry = await registry_with(record("p-0", WorkerRole.PREFILL), record("p-1", WorkerRole.PREFILL),
                                   record("d-0", WorkerRole.DECODE))
    prompt = list(range(300, 300 + 5 * BLOCK + 3))  # five full blocks and three tokens
    await registry.report_blocks("p-1", hash_chain(prompt, BLOCK, salt="tenant-a", model="smol")[:4], [])

    plan = await plan_route(registry, InflightTable(), submit(prompt, salt="tenant-a"))
    assert plan.prefill == [Score("p-1", 83.0 - 64, cached_blocks=4), Score("p-0", 83.0)]
    assert not plan.colocated and not plan.degraded

    for other_salt in ("tenant-b", ""):
        plan = await plan_route(registry, InflightTable(), submit(prompt, salt=other_salt))
        assert plan.prefill == [Score("p-0", 83.0), Score("p-1", 83.0)]


async def test_in_flight_requests_count_as_queued_prefill_and_reserved_blocks() -> None:
    prefill, decode_a, decode_b = (record("p-0", WorkerRole.PREFILL), record("d-a", WorkerRole.DECODE, 100),
                                   record("d-b", WorkerRole.DECODE, 98))
    registry = await registry_with(prefill, decode_a, decode_b)
    inflight = InflightTable()
    placement = Placement(submit([1] * 40), prefill=prefill, decode=decode_a, uncached_tokens=40, reserved_blocks=3,
                          reserved_at=registry.last_seen("d-a") + 1.0)
    busy = RequestState(placement.request, Deadline(), trace.INVALID_SPAN, Ending("busy"), placement)
    inflight.add(busy)
    plan = await plan_route(registry, inflight, submit([5] * 20))
    assert plan.prefill == [Score("p-0", 60.0, queued_prefill_tokens=40)]
    # d-a reported 100 free but 3 were reserved since: 97 < 98.
    assert plan.decode == [Score("d-b", -98.0, free_blocks=98), Score("d-a", -97.0, free_blocks=97, running=1)]

    inflight.advance(busy, Status.GENERATING)  # its first token arrived
    placement.reserved_at = registry.last_seen("d-a") - 1.0  # and d-a reported after the reservation
    plan = await plan_route(registry, inflight, submit([5] * 20))
    assert plan.prefill == [Score("p-0", 20.0)]
    assert [s.worker_id for s in plan.decode] == ["d-a", "d-b"]


async def test_colocated_workers_take_every_request_and_other_models_are_ignored() -> None:
    registry = await registry_with(record("c-0", WorkerRole.COLOCATED), record("p-0", WorkerRole.PREFILL),
                                   record("d-0", WorkerRole.DECODE), record("c-x", WorkerRole.COLOCATED, model="big"))
    plan = await plan_route(registry, InflightTable(), submit([1, 2, 3]))
    assert plan.colocated and plan.prefill == [Score("c-0", 3.0)] and plan.decode == []


async def test_degraded_store_routes_without_prefix_hits() -> None:
    registry = await registry_with(record("p-0", WorkerRole.PREFILL), record("p-1", WorkerRole.PREFILL),
                                   record("d-0", WorkerRole.DECODE))
    prompt = list(range(64))
    await registry.report_blocks("p-1", hash_chain(prompt, BLOCK, model="smol"), [])
    registry.store = FlakyStore(down=True)
    plan = await plan_route(registry, InflightTable(), submit(prompt))
    assert plan.degraded and registry.degraded
    assert plan.prefill == [Score("p-0", 64.0), Score("p-1", 64.0)]
    assert [s.worker_id for s in plan.decode] == ["d-0"]



async def test_a_prefix_cached_by_one_model_earns_no_credit_for_another() -> None:
    """The default model under two names: c-0 cached the prompt as 'smol', c-1 as 'smol-b'. Each
    name credits only its own blocks; a request naming no model runs on the primary, 'smol'."""
    info = [WorkerInfo(worker_id=w, role=WorkerRole.COLOCATED, address=f"127.0.0.1:{port}", model="smol",
                       num_blocks=1000, block_size=BLOCK, catalogue=("smol", "smol-b"))
            for w, port in (("c-0", 40001), ("c-1", 40002))]
    both = (ModelResidency("smol"), ModelResidency("smol-b"))  # resident on both workers
    registry = await registry_with(*(WorkerRecord(i, WorkerLoad(free_blocks=1000, models=both)) for i in info))
    prompt = list(range(700, 700 + 4 * BLOCK + 3))  # four full blocks and three tokens
    await registry.report_blocks("c-0", hash_chain(prompt, BLOCK, model="smol"), [])
    await registry.report_blocks("c-1", hash_chain(prompt, BLOCK, model="smol-b"), [])

    for model in ("smol", ""):
        plan = await plan_route(registry, InflightTable(), submit(prompt, model=model))
        assert plan.prefill == [Score("c-0", 67.0 - 64, cached_blocks=4), Score("c-1", 67.0)]
    plan = await plan_route(registry, InflightTable(), submit(prompt, model="smol-b"))
    assert plan.prefill == [Score("c-1", 67.0 - 64, cached_blocks=4), Score("c-0", 67.0)]


def test_route_scores_json_is_the_best_breakdowns_as_json_dumps_writes_them() -> None:
    prefill = [Score(f"p-{i:02d}", float(i), cached_blocks=i % 3, queued_prefill_tokens=2 * i) for i in range(20)]
    # "h" is in both lists (a hybrid decode worker prefilling locally): once, in its first place, as decode.
    decode = [Score("d-\"quoted\"-é", -7.0, free_blocks=7, running=1), Score("h", -3.0, free_blocks=3, running=2)]
    plan = RoutePlan(colocated=False, prefill=[Score("h", 12.5, cached_blocks=1), *prefill], decode=decode,
                     workers={}, degraded=False)

    expected = {"h": {"cost": -3.0, "free_blocks": 3, "running": 2}}
    expected |= {s.worker_id: {"cost": s.cost, "cached_blocks": s.cached_blocks,
                               "queued_prefill_tokens": s.queued_prefill_tokens} for s in prefill[:RECORDED_SCORES - 1]}
    expected["d-\"quoted\"-é"] = {"cost": -7.0, "free_blocks": 7, "running": 1}
    assert plan.scores_json() == json.dumps(expected)
    assert list(json.loads(plan.scores_json()))[:3] == ["h", "p-00", "p-01"]


async def test_each_change_of_the_workers_shows_in_the_next_route() -> None:
    """Routing keeps what it derives from the workers' records between requests: a registration, a
    heartbeat (here, the models it holds) and a lost worker each show in the very next route."""
    registry = WorkerRegistry(EmbeddedStore(), ttl=5.0, placement=ModelPlacement.LATENCY)
    catalogued = WorkerInfo(worker_id="c-2", role=WorkerRole.COLOCATED, address="127.0.0.1:40002", model="big",
                            num_blocks=1000, block_size=BLOCK, catalogue=("big", "smol"))
    for worker in (record("c-1", WorkerRole.COLOCATED), record("c-3", WorkerRole.COLOCATED)):
        await registry.register(worker.info, worker.load)
    await registry.register(catalogued, WorkerLoad(free_blocks=1000))

    async def route() -> list[str]:
        return [s.worker_id for s in (await plan_route(registry, InflightTable(), submit([1, 2, 3]))).prefill]

    routed = [await route()]
    await registry.register(record("c-0", WorkerRole.COLOCATED).info, WorkerLoad(free_blocks=1000))
    routed.append(await route())
    await registry.heartbeat("c-2", WorkerLoad(free_blocks=1000, models=(ModelResidency("smol"),)))
    routed.append(await route())
    await registry.heartbeat("c-2", WorkerLoad(free_blocks=1000))
    routed.append(await route())
    registry.forget("c-1")
    routed.append(await route())

    # Latency placement routes only to the holders of a model (c-2 holds smol only while it says so);
    # ties go to the lower id.
    assert routed == [["c-1", "c-3"], ["c-0", "c-1", "c-3"], ["c-0", "c-1", "c-2", "c-3"], ["c-0", "c-1", "c-3"],
                      ["c-0", "c-3"]]
