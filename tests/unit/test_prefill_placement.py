"""Conditional disaggregation: the local-or-remote decision from a decode worker's step-cost model and
the ITL target (or the prompt-length rule without them), and the planner's exact plans with a hybrid
decode worker: a one-worker assignment plan when it prefills locally, the disaggregated plan otherwise."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from services.common.block_hash import hash_chain
from services.common.errors import InvalidRequest, Unavailable
from services.common.step_cost import HYBRID_STEP_HEADROOM, StepCost, aimed_step_ms
from services.common.store import EmbeddedStore, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from services.scheduler.convert import info_from_pb
from services.scheduler.deadline import Deadline
from services.scheduler.ending import Ending
from services.scheduler.inflight import InflightTable, Placement, RequestState
from services.scheduler.planner import plan_route
from services.scheduler.prefill_placement import (
    PlacementPolicy,
    PrefillDecision,
    PrefillInputs,
    PrefillPlacement,
    PrefillSite,
    Reason,
)
from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import Score
from tandem.v1 import common_pb2, scheduler_pb2

BLOCK = 16
COST = StepCost(fixed_ms=10.0, per_token_ms=0.1, per_context_token_ms=0.0)
ITL = PlacementPolicy(itl_ms=50.0, context_tokens=1024, local_tokens=256)


def inputs(uncached: int, queued: int = 0, running: int = 0, remote: bool = True, **more: int) -> PrefillInputs:
    return PrefillInputs(uncached_tokens=uncached, queued_tokens=queued, running=running, remote_available=remote,
                         **more)


# -- the decision -----------------------------------------------------------------------------

def test_a_prefill_whose_next_step_fits_the_step_the_worker_aims_at_is_local() -> None:
    # 10 + 0.1 * (4 running + 190 prompt tokens) = 29.4 ms <= 30 ms, the 50 ms target less a hybrid decode
    # worker's headroom (40%), as the worker sizes its steps
    assert ITL.aimed_step_ms == 30.0 == aimed_step_ms(50.0, HYBRID_STEP_HEADROOM)
    assert ITL.decide(inputs(190, running=4), COST) == PrefillDecision(
        PrefillSite.LOCAL, Reason.WITHIN_ITL, inputs(190, running=4), step_ms=pytest.approx(29.4))


def test_a_step_within_the_itl_target_but_past_the_aimed_step_is_not_within_it() -> None:
    # 10 + 0.1 * 304 = 40.4 ms: within 50 ms, but the worker sizes its steps to 30 ms and would chunk it
    decision = ITL.decide(inputs(300, running=4), COST)
    assert (decision.site, decision.reason, decision.step_ms) == (PrefillSite.REMOTE, Reason.OVER_ITL,
                                                                   pytest.approx(40.4))


def test_a_prefill_that_would_stretch_the_next_step_past_the_itl_target_is_remote() -> None:
    decision = ITL.decide(inputs(400, running=4), COST)  # 10 + 0.1 * 404 = 50.4 ms
    assert (decision.site, decision.reason, decision.step_ms) == (PrefillSite.REMOTE, Reason.OVER_ITL,
                                                                   pytest.approx(50.4))


def test_prompt_tokens_queued_on_the_decode_worker_join_the_same_step() -> None:
    decision = ITL.decide(inputs(300, queued=100, running=4), COST)  # 10 + 0.1 * 404
    assert (decision.site, decision.reason) == (PrefillSite.REMOTE, Reason.OVER_ITL)


def test_the_decodes_read_their_contexts_at_the_decode_rate_and_the_prefill_its_triangle_at_the_prompt_rate() -> None:
    cost = StepCost(fixed_ms=10.0, per_token_ms=0.1, per_context_token_ms=0.001, per_decode_context_ms=0.01)
    # 10 + 0.1 * 102 + 0.01 * 2 * 1024 + 0.001 * 100 * 101 / 2 = 10 + 10.2 + 20.48 + 5.05
    assert ITL.next_step_ms(cost, inputs(100, running=2)) == pytest.approx(45.73)


TTFT = PlacementPolicy(itl_ms=50.0, context_tokens=1024, local_tokens=256, ttft_ms=1000.0)


def test_over_the_itl_target_in_one_step_a_prefill_chunked_locally_that_meets_the_ttft_target_sooner_is_local() -> None:
    # one step with it: 10 + 0.1 * 4 + 0.1 * 600 = 70.4 ms > 30 (the step aimed at under 50); chunked into the
    # 30 - 10 - 0.4 = 19.6 ms the decodes leave a step: ceil(60 / 19.6) = 4 steps of 30 ms; remote: 10 + 0.1 *
    # (20,000 queued + 600)
    deep = inputs(600, running=4, remote_tokens=600, remote_queued_tokens=20_000)
    assert TTFT.decide(deep, COST) == PrefillDecision(PrefillSite.LOCAL, Reason.LOCAL_SOONER, deep, step_ms=pytest.approx(70.4),
                                                      local_ttft_ms=120.0, remote_ttft_ms=pytest.approx(2070.0))


def test_a_prefill_worker_whose_first_token_comes_no_later_takes_the_prompt() -> None:
    idle = inputs(600, running=4, remote_tokens=600)  # remote: 10 + 60 = 70 ms against 120 ms locally
    decision = TTFT.decide(idle, COST)
    assert (decision.site, decision.reason, decision.remote_ttft_ms) == (PrefillSite.REMOTE, Reason.REMOTE_SOONER,
                                                                         pytest.approx(70.0))


def test_a_prompt_that_misses_the_ttft_target_on_both_sites_goes_remote_and_leaves_the_decode_steps_short() -> None:
    strict = PlacementPolicy(itl_ms=50.0, ttft_ms=119.0)  # local 120 ms, remote 2,070 ms: both late
    decision = strict.decide(inputs(600, running=4, remote_tokens=600, remote_queued_tokens=20_000), COST)
    assert (decision.site, decision.reason) == (PrefillSite.REMOTE, Reason.OVER_TTFT)


def test_decodes_that_fill_the_itl_target_leave_a_local_prefill_no_room() -> None:
    full = inputs(600, running=400, remote_tokens=600, remote_queued_tokens=20_000)  # 10 + 400 * 0.1 = 50 > 30 ms
    decision = TTFT.decide(full, COST)
    assert (decision.site, decision.local_ttft_ms) == (PrefillSite.REMOTE, float("inf"))
    assert decision.span_attributes()["tandem.prefill.local_ttft_ms"] == -1.0


def test_both_queues_count_their_tokens_and_the_kv_their_chunks_read_and_the_prefill_worker_its_own_rates() -> None:
    local_cost = StepCost(fixed_ms=10.0, per_token_ms=0.1, per_context_token_ms=0.001)
    remote_cost = StepCost(fixed_ms=20.0, per_token_ms=0.2, per_context_token_ms=0.002)
    queued = inputs(100, queued=50, running=4, queued_reads=1_000, remote_tokens=100, remote_queued_tokens=300,
                    remote_queued_reads=5_000)
    # local work: 0.1 * 150 + 0.001 * (1,000 + 5,050) = 21.05 ms in 30 - 10 - 0.4 = 19.6 ms a step: 2 steps of 30 ms
    assert TTFT.local_ttft_ms(local_cost, queued) == 60.0
    # remote: 20 + 0.2 * 400 + 0.002 * (5,000 + 5,050)
    assert TTFT.remote_ttft_ms(remote_cost, queued) == pytest.approx(120.1)
    placement = PrefillPlacement(TTFT)
    placement.observe("d-0", StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.0))
    placement.observe("p-0", StepCost(fixed_ms=20.0, per_token_ms=2.0, per_context_token_ms=0.0))
    long = inputs(100, running=4, remote_tokens=100)  # remote 20 + 200 ms by p-0's model, 10 + 100 ms by d-0's
    assert placement.decide("d-0", long, "p-0").remote_ttft_ms == 220.0
    assert placement.decide("d-0", long).remote_ttft_ms == 110.0  # no prefill worker's model: the decode worker's


def test_the_decodes_read_the_contexts_the_scheduler_counted_when_it_has_them() -> None:
    cost = StepCost(fixed_ms=10.0, per_token_ms=0.1, per_context_token_ms=0.0, per_decode_context_ms=0.01)
    # 10 + 0.1 * 2 + 0.01 * 300 + 0.1 * 100 (against 0.01 * 2 * 1,024 without the count)
    assert ITL.next_step_ms(cost, inputs(100, running=2, running_context=300)) == pytest.approx(23.2)


def test_before_a_cost_model_with_a_ttft_target_a_short_prompt_joins_the_shorter_queue() -> None:
    assert TTFT.decide(inputs(200, queued=57, remote_queued_tokens=57), None) == PrefillDecision(
        PrefillSite.LOCAL, Reason.SHORT_PROMPT, inputs(200, queued=57, remote_queued_tokens=57))
    assert TTFT.decide(inputs(200, queued=57, remote_queued_tokens=56), None).reason is Reason.LONG_PROMPT
    assert TTFT.decide(inputs(257, remote_queued_tokens=5000), None).reason is Reason.LONG_PROMPT  # not short itself
    assert ITL.decide(inputs(200, queued=57, remote_queued_tokens=5000), None).reason is Reason.LONG_PROMPT  # no TTFT


def test_without_a_cost_model_or_an_itl_target_the_prompt_length_rule_decides() -> None:
    assert ITL.decide(inputs(256), None).reason is Reason.SHORT_PROMPT
    assert ITL.decide(inputs(257), None).reason is Reason.LONG_PROMPT
    assert ITL.decide(inputs(200, queued=57), None).site is PrefillSite.REMOTE
    no_target = PlacementPolicy(itl_ms=0.0, local_tokens=256)
    assert no_target.decide(inputs(10, running=1000), COST) == PrefillDecision(
        PrefillSite.LOCAL, Reason.SHORT_PROMPT, inputs(10, running=1000))


def test_with_no_prefill_worker_every_prompt_prefills_locally() -> None:
    assert ITL.decide(inputs(10_000, running=64, remote=False), COST) == PrefillDecision(
        PrefillSite.LOCAL, Reason.NO_PREFILL_WORKER, inputs(10_000, running=64, remote=False))


def test_the_decision_goes_on_the_span_with_its_inputs() -> None:
    assert ITL.decide(inputs(190, queued=2, running=4), COST).span_attributes() == {
        "tandem.prefill.placement": "local", "tandem.prefill.placement_reason": "within_itl",
        "tandem.prefill.uncached_tokens": 190, "tandem.prefill.queued_tokens": 2,
        "tandem.prefill.decode_running": 4, "tandem.prefill.predicted_step_ms": 29.6}


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="local_tokens >= 0"):
        PlacementPolicy(local_tokens=-1)


def test_only_a_decode_worker_may_register_to_prefill_locally() -> None:
    info = scheduler_pb2.WorkerInfo(worker_id="p-0", role=common_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:1",
                                    model="smol", num_blocks=8, block_size=BLOCK, local_prefill=True)
    with pytest.raises(InvalidRequest, match="only a decode worker prefills locally"):
        info_from_pb(info)
    info.role = common_pb2.WORKER_ROLE_DECODE
    assert info_from_pb(info).local_prefill


# -- through the planner --------------------------------------------------------------------------

def record(worker_id: str, role: WorkerRole, local_prefill: bool = False, free_blocks: int = 1000) -> WorkerRecord:
    info = WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{hash(worker_id) % 1000 + 41000}",
                      model="smol", num_blocks=1000, block_size=BLOCK, local_prefill=local_prefill)
    return WorkerRecord(info, WorkerLoad(free_blocks=free_blocks))


PREFILL, HYBRID = record("p-0", WorkerRole.PREFILL), record("d-0", WorkerRole.DECODE, local_prefill=True)


async def registry_with(*records: WorkerRecord) -> WorkerRegistry:
    registry = WorkerRegistry(EmbeddedStore(), ttl=5.0)
    for r in records:
        await registry.register(r.info, r.load)
    return registry


def submit(tokens: list[int]) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="r", model="smol", token_ids=tokens)


def short_rule(tokens: int = 32) -> PrefillPlacement:
    return PrefillPlacement(PlacementPolicy(local_tokens=tokens))


async def test_a_short_prompt_runs_on_the_hybrid_decode_worker_a_long_one_on_the_prefill_worker() -> None:
    registry = await registry_with(PREFILL, HYBRID)
    local = await plan_route(registry, InflightTable(), submit([7] * 32), short_rule())
    assert local.colocated and local.prefill == [Score("d-0", 32.0, free_blocks=1000)]
    assert (local.placement.site, local.placement.reason) == (PrefillSite.LOCAL, Reason.SHORT_PROMPT)
    route = local.route_info("r", decode_worker_id="", reserved_blocks=0)
    assert (route.prefill_worker_id, route.decode_worker_id) == ("d-0", "d-0")

    remote = await plan_route(registry, InflightTable(), submit([7] * 33), short_rule())
    assert not remote.colocated and remote.prefill == [Score("p-0", 33.0)]
    assert [s.worker_id for s in remote.decode] == ["d-0"]
    assert (remote.placement.site, remote.placement.reason) == (PrefillSite.REMOTE, Reason.LONG_PROMPT)


async def test_the_decode_workers_prefix_hit_shortens_the_prompt_it_would_prefill() -> None:
    registry = await registry_with(PREFILL, HYBRID)
    prompt = list(range(500, 500 + 5 * BLOCK + 3))  # 83 tokens: too long for the rule without a hit
    await registry.report_blocks("d-0", hash_chain(prompt, BLOCK, model="smol")[:4], [])
    plan = await plan_route(registry, InflightTable(), submit(prompt), short_rule())
    assert plan.colocated and plan.prefill == [Score("d-0", 19.0, cached_blocks=4, free_blocks=1000)]
    assert plan.placement.inputs == inputs(19, running_context=0, remote_tokens=83)  # p-0 caches none of it


async def test_the_cost_model_and_the_decode_workers_queue_and_running_requests_decide() -> None:
    registry = await registry_with(PREFILL, HYBRID)
    placement = PrefillPlacement(PlacementPolicy(itl_ms=50.0, local_tokens=0))
    placement.observe("d-0", StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.0))
    plan = await plan_route(registry, InflightTable(), submit([7] * 20), placement)  # 10 + 20 = 30 ms
    assert plan.colocated and (plan.placement.reason, plan.placement.step_ms) == (Reason.WITHIN_ITL, 30.0)

    inflight = InflightTable()  # one request prefilling locally on d-0: 15 queued tokens, 1 running
    queued = Placement(submit([1] * 15), colocated=True, prefill=HYBRID, uncached_tokens=15)
    inflight.add(RequestState(queued.request, Deadline(), trace.INVALID_SPAN, Ending("q"), queued))
    plan = await plan_route(registry, inflight, submit([7] * 20), placement)  # 10 + 1 + 15 + 20 = 46 ms
    assert not plan.colocated and plan.prefill[0].worker_id == "p-0"
    assert (plan.placement.reason, plan.placement.step_ms) == (Reason.OVER_ITL, 46.0)
    assert plan.placement.inputs == inputs(20, queued=15, running=1, running_context=15, queued_reads=15 * 16 // 2,
                                           remote_tokens=20)

    placement.observe("d-0", None)  # the worker lost its model (restarted): the prompt-length rule again
    plan = await plan_route(registry, InflightTable(), submit([7] * 30), placement)
    assert plan.placement.reason is Reason.LONG_PROMPT


async def test_the_prefill_workers_queue_weighs_against_a_local_prefill_in_chunks() -> None:
    registry = await registry_with(PREFILL, HYBRID)
    placement = PrefillPlacement(PlacementPolicy(itl_ms=50.0, local_tokens=0, ttft_ms=1000.0))
    placement.observe("d-0", StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.001))
    inflight = InflightTable()  # a 900-token prompt (16 of its tokens cached there) prefilling on p-0
    queued = Placement(submit([1] * 900), prefill=PREFILL, uncached_tokens=884)
    inflight.add(RequestState(queued.request, Deadline(), trace.INVALID_SPAN, Ending("q"), queued))
    plan = await plan_route(registry, inflight, submit([7] * 60), placement)
    reads = 884 * 16 + 884 * 885 // 2  # its chunks' tokens from position 16 on
    assert plan.placement.inputs == inputs(60, running_context=0, remote_tokens=60, remote_queued_tokens=884,
                                           remote_queued_reads=reads)
    # locally: 60 + 0.001 * 1,830 ms of prompt work in steps of 20 ms room (30 aimed, less 10 fixed): 4 steps of
    # 30 ms; remotely: 10 + 944 + 0.001 * (reads + 1,830)
    assert plan.colocated and plan.placement.reason is Reason.LOCAL_SOONER
    assert (plan.placement.local_ttft_ms, plan.placement.remote_ttft_ms) == (120.0, pytest.approx(10 + 944 + 0.001 * (reads + 1830)))
    assert plan.prefill == [Score("d-0", 60.0, free_blocks=1000)]


async def test_a_decode_worker_without_hybrid_keeps_the_disaggregated_plan_undecided() -> None:
    registry = await registry_with(PREFILL, record("d-1", WorkerRole.DECODE))
    plan = await plan_route(registry, InflightTable(), submit([7] * 4), short_rule())
    assert not plan.colocated and plan.placement is None and plan.prefill == [Score("p-0", 4.0)]


async def test_without_a_prefill_worker_the_hybrid_decode_worker_prefills_everything() -> None:
    roomier = record("d-1", WorkerRole.DECODE, free_blocks=1000)
    registry = await registry_with(roomier, record("d-2", WorkerRole.DECODE, local_prefill=True, free_blocks=500))
    plan = await plan_route(registry, InflightTable(), submit([7] * 900), short_rule())
    assert plan.colocated and [s.worker_id for s in plan.prefill] == ["d-2"]
    assert plan.placement.reason is Reason.NO_PREFILL_WORKER

    with pytest.raises(Unavailable, match="no live prefill \\(or colocated\\) worker serves model 'smol'"):
        await plan_route(await registry_with(record("d-1", WorkerRole.DECODE)), InflightTable(), submit([7]))


async def test_heartbeats_bring_each_workers_step_cost_model_to_the_decision() -> None:
    from tests.unit.test_scheduler_service import CLIENT_METADATA, scheduler

    async with scheduler("d-0") as mesh:
        worker = mesh.workers["d-0"]
        mesh.dispatcher.placement = PrefillPlacement(PlacementPolicy(itl_ms=50.0))
        model = scheduler_pb2.StepCostModel(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.0)
        request = scheduler_pb2.HeartbeatRequest(worker_id="d-0", load=scheduler_pb2.WorkerLoad(step_cost=model))
        assert (await worker.stub.Heartbeat(request, metadata=CLIENT_METADATA)).known
        assert mesh.dispatcher.placement.decide("d-0", inputs(30)).step_ms == 40.0

        assert await worker.heartbeat()  # a load without a model (the worker restarted): the rule again
        assert mesh.dispatcher.placement.decide("d-0", inputs(30)).reason is Reason.SHORT_PROMPT
