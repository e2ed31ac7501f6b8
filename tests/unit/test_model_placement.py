"""Model placement rules (services/scheduler/model_placement.py) over fake worker records: which
workers can serve a model, the routing map, the bin-packing choice of a loader, holders first in
routing, latency placement's refusal of an unprovisioned model, and cost placement's copies."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition
from services.common.store import ModelResidency, ModelState, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from services.scheduler.model_placement import (
    Action, ActionKind, ModelPlacement, ReplicaRule, can_serve, cold_start, coldest_idle_ms, loader_order,
    holding, holds, prefer_holders, provisioned, rebalance, routing_map, serving,
)

COST, LATENCY = ModelPlacement.COST, ModelPlacement.LATENCY
GIB = 1 << 30
CATALOGUE = ("a", "b", "c", "d")


def resident(name: str, *, pinned: bool = False, active: int = 0, idle_ms: int = 0,
             state: ModelState = ModelState.RESIDENT) -> ModelResidency:
    return ModelResidency(name, state=state, pinned=pinned, weight_bytes=GIB, active_requests=active, idle_ms=idle_ms)


def worker(worker_id: str, *models: ModelResidency, role: WorkerRole = WorkerRole.COLOCATED,
           catalogue: tuple[str, ...] = CATALOGUE, free_gib: int = 0, running: int = 0,
           waiting: int = 0) -> WorkerRecord:
    info = WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{6000 + len(worker_id)}", model="a",
                      num_blocks=64, block_size=16, catalogue=catalogue, model_memory_bytes=8 * GIB)
    load = WorkerLoad(running=running, waiting=waiting, models=models, free_model_memory_bytes=free_gib * GIB)
    return WorkerRecord(info, load)


def one_model(worker_id: str, model: str) -> WorkerRecord:
    """A worker from before catalogues: no catalogue, no residency reported."""
    info = WorkerInfo(worker_id=worker_id, role=WorkerRole.COLOCATED, address="127.0.0.1:7000", model=model,
                      num_blocks=64, block_size=16)
    return WorkerRecord(info, WorkerLoad())


def ids(records: list[WorkerRecord]) -> list[str]:
    return [r.info.worker_id for r in records]


def test_a_worker_serves_its_catalogue_or_its_one_model() -> None:
    assert can_serve(worker("w", catalogue=("a", "b")), "b")
    assert not can_serve(worker("w", catalogue=("a", "b")), "c")
    assert can_serve(one_model("old", "smol"), "smol") and not can_serve(one_model("old", "smol"), "a")


def test_holds_says_what_holding_finds_for_every_kind_of_worker() -> None:
    one_model_loaded = WorkerRecord(one_model("old", "smol").info, WorkerLoad(models=(resident("tiny"),)))
    records = [worker("w0", resident("a"), resident("b", state=ModelState.LOADING)), worker("w1"),
               one_model("w2", "smol"), one_model_loaded]
    answers = {(r.info.worker_id, m): holds(r, m) for r in records for m in ("a", "b", "smol", "tiny")}
    assert answers == {(r.info.worker_id, m): holding(r, m) is not None for r in records
                       for m in ("a", "b", "smol", "tiny")}
    assert [key for key, held in answers.items() if held] == [("w0", "a"), ("w0", "b"), ("w2", "smol"),
                                                               ("old", "tiny")]


def test_the_routing_map_lists_resident_and_loading_copies_and_one_model_workers() -> None:
    records = [worker("w0", resident("a"), resident("b", state=ModelState.LOADING)),
               worker("w1", resident("b")), worker("w2"), one_model("w3", "smol")]
    assert routing_map(records) == {"a": ["w0"], "b": ["w0", "w1"], "smol": ["w3"]}


def test_the_loader_is_the_least_loaded_then_most_free_memory_then_coldest_eviction_then_id() -> None:
    records = [
        worker("busy", running=3, free_gib=8),                      # loaded: last whatever its memory
        worker("tight", resident("a", idle_ms=900_000), free_gib=1),  # less free memory
        worker("warm", resident("a", idle_ms=5_000), free_gib=4),
        worker("cold", resident("b", idle_ms=60_000), free_gib=4),    # evicts the coldest model
        worker("pinned", resident("c", pinned=True, idle_ms=10**7), free_gib=4),  # nothing evictable
        worker("alpha", resident("a", idle_ms=60_000), free_gib=4),   # ties with cold: id decides
    ]
    assert ids(loader_order(records)) == ["alpha", "cold", "warm", "pinned", "tight", "busy"]


def test_waiting_requests_count_as_load_for_the_loader() -> None:
    assert ids(loader_order([worker("queued", waiting=2, free_gib=8), worker("idle", running=1, free_gib=1)])) == \
        ["idle", "queued"]


def test_coldest_idle_ms_counts_only_resident_unpinned_idle_models() -> None:
    record = worker("w", resident("a", idle_ms=50), resident("b", pinned=True, idle_ms=900),
                    resident("c", active=1, idle_ms=0), resident("d", state=ModelState.LOADING, idle_ms=800))
    assert coldest_idle_ms(record) == 50
    assert coldest_idle_ms(worker("w", resident("b", pinned=True))) == -1


def test_routing_prefers_holders_in_the_routers_order_while_one_has_room() -> None:
    records = {r.info.worker_id: r for r in (worker("w0"), worker("w1", resident("b")), worker("w2", free_gib=8),
                                              worker("w3", resident("b")))}
    ranked = ["w0", "w3", "w2", "w1"]  # the router's order: prefix hits and load
    assert prefer_holders(ranked, records, "b", room=["w1"], policy=COST) == ["w3", "w1", "w2", "w0"]


def test_only_when_no_holder_has_room_does_a_loader_go_first() -> None:
    records = {r.info.worker_id: r for r in (worker("w0", free_gib=1), worker("w1", resident("b")),
                                              worker("w2", free_gib=8))}
    assert prefer_holders(["w1", "w0", "w2"], records, "b", room=["w0", "w2"], policy=COST) == ["w2", "w0", "w1"]


def test_while_a_copy_is_loading_no_holder_with_room_sends_the_request_to_it_not_to_another_loader() -> None:
    records = {r.info.worker_id: r for r in (worker("w0", free_gib=8), worker("w1", resident("b")),
                                              worker("w2", resident("b", state=ModelState.LOADING)))}
    assert prefer_holders(["w0", "w1", "w2"], records, "b", room=["w0"], policy=COST) == ["w1", "w2", "w0"]
    resident_only = {w: r for w, r in records.items() if w != "w2"}
    assert prefer_holders(["w0", "w1"], resident_only, "b", room=["w0"], policy=COST) == ["w0", "w1"]


def test_a_cold_start_is_a_request_for_a_model_not_resident_on_the_worker() -> None:
    record = worker("w", resident("a"), resident("b", state=ModelState.LOADING))
    assert [cold_start(record, m) for m in ("a", "", "b", "c")] == [False, False, True, True]  # "": the primary a
    assert not cold_start(one_model("old", "smol"), "smol")


def test_latency_placement_routes_only_to_holders_even_when_they_are_full() -> None:
    records = {r.info.worker_id: r for r in (worker("w0", free_gib=8), worker("w1", resident("b", pinned=True)))}
    assert prefer_holders(["w0", "w1"], records, "b", room=["w0"], policy=LATENCY) == ["w1"]


def test_a_request_without_a_model_name_keeps_the_routers_order() -> None:
    records = {r.info.worker_id: r for r in (worker("w0"), worker("w1", resident("b")))}
    assert prefer_holders(["w0", "w1"], records, "", room=[], policy=COST) == ["w0", "w1"]


def test_cost_placement_serves_every_catalogue_holder() -> None:
    records = [worker("w0", resident("a")), worker("w1", catalogue=("a",)), worker("w2")]
    assert ids(serving(records, "b", COST)) == ["w0", "w2"]
    assert ids(serving(records, "", COST)) == ["w0", "w1", "w2"]


def test_latency_placement_refuses_a_model_never_provisioned() -> None:
    records = [worker("w0", resident("a")), worker("w1", resident("b"))]  # b resident, not pinned: on demand
    with pytest.raises(FailedPrecondition) as refused:
        serving(records, "b", LATENCY)
    assert refused.value.message == (
        "model 'b' is not provisioned: --placement latency serves only provisioned models and never loads one "
        "for a request; provision it first: tandem models provision b --replicas N")


def test_latency_placement_serves_a_provisioned_model_from_its_holders_only() -> None:
    records = [worker("w0", resident("b", pinned=True)), worker("w1", resident("b")), worker("w2")]
    assert provisioned(records, "b")
    assert ids(serving(records, "b", LATENCY)) == ["w0", "w1"]
    assert ids(serving([one_model("old", "smol")], "smol", LATENCY)) == ["old"]  # a one-model worker pins its model


def test_latency_placement_serves_a_workers_primary_model_unpinned_from_the_workers_holding_it() -> None:
    # Every worker of these loads "a" at start (WorkerInfo.model): its holders are its group, w1 evicted it.
    records = [worker("w0", resident("a")), worker("w1", resident("b", pinned=True)), worker("w2", resident("a"))]
    assert provisioned(records, "a")
    assert ids(serving(records, "a", LATENCY)) == ["w0", "w2"]
    with pytest.raises(FailedPrecondition, match="^model 'c' is not provisioned"):
        serving([worker("w0", resident("a"), resident("c"))], "c", LATENCY)  # resident, but neither primary nor pinned


def test_latency_placement_leaves_a_model_no_catalogue_holds_to_routing() -> None:
    assert serving([worker("w0", resident("a", pinned=True))], "zzz", LATENCY) == []


RULE = ReplicaRule(hot_active=4, cold_idle_ms=60_000)


def test_a_model_whose_every_copy_is_busy_is_copied_onto_the_best_loader() -> None:
    records = [worker("w0", resident("a", active=5)), worker("w1", resident("a", active=4), resident("b")),
               worker("w2", running=1, free_gib=8), worker("w3", free_gib=2), worker("w4", catalogue=("b",))]
    assert rebalance(records, RULE) == [Action(ActionKind.LOAD, "a", "w3")]


def test_no_copy_while_one_copy_has_headroom_or_another_is_loading() -> None:
    assert rebalance([worker("w0", resident("a", active=9)), worker("w1", resident("a", active=3)),
                      worker("w2")], RULE) == []
    assert rebalance([worker("w0", resident("a", active=9)),
                      worker("w1", resident("a", state=ModelState.LOADING)), worker("w2")], RULE) == []


TTFT_RULE = ReplicaRule(hot_active=4, cold_idle_ms=60_000, hot_ttft_ms=500.0)


def test_a_model_whose_recent_ttft_passed_the_threshold_is_copied_though_no_copy_is_busy() -> None:
    records = [worker("w0", resident("a", active=1)), worker("w1", resident("b")), worker("w2", free_gib=3)]
    assert rebalance(records, TTFT_RULE, {"a": 500.0, "b": 499.9}) == [Action(ActionKind.LOAD, "a", "w2")]
    assert rebalance(records, TTFT_RULE, {"a": 499.9}) == []
    assert rebalance(records, TTFT_RULE) == []  # no TTFT observed yet
    assert rebalance(records, RULE, {"a": 10_000.0}) == []  # --replicate-ttft-ms 0: off


def test_the_ttft_trigger_copies_onto_workers_that_make_first_tokens_not_onto_decode_workers() -> None:
    records = [worker("p0", resident("a"), role=WorkerRole.PREFILL), worker("p1", role=WorkerRole.PREFILL),
               worker("d0", resident("a"), role=WorkerRole.DECODE), worker("d1", role=WorkerRole.DECODE)]
    assert rebalance(records, TTFT_RULE, {"a": 900.0}) == [Action(ActionKind.LOAD, "a", "p1")]


def test_a_hot_model_gets_one_extra_load_at_a_time_whatever_made_it_hot() -> None:
    records = [worker("w0", resident("a", active=9)), worker("w1", resident("a", state=ModelState.LOADING)),
               worker("w2"), worker("w3")]
    assert rebalance(records, TTFT_RULE, {"a": 900.0}) == []
    records[1] = worker("w1", resident("a", active=9))  # the copy is in: the next one may start
    assert rebalance(records, TTFT_RULE, {"a": 900.0}) == [Action(ActionKind.LOAD, "a", "w2")]


def test_copies_stay_within_the_role_of_the_busy_copies() -> None:
    records = [worker("d0", resident("a", active=6), role=WorkerRole.DECODE),
               worker("p0", resident("a"), role=WorkerRole.PREFILL),
               worker("p1", role=WorkerRole.PREFILL), worker("d1", role=WorkerRole.DECODE)]
    assert rebalance(records, RULE) == [Action(ActionKind.LOAD, "a", "d1")]


def test_the_coldest_unpinned_idle_copy_is_dropped_while_another_copy_stays() -> None:
    records = [worker("w0", resident("a", idle_ms=70_000)), worker("w1", resident("a", idle_ms=90_000)),
               worker("w2", resident("a", idle_ms=200_000, pinned=True)), worker("w3", resident("b", idle_ms=10**6))]
    assert rebalance(records, RULE) == [Action(ActionKind.UNLOAD, "a", "w1")]


def test_the_last_copy_a_busy_copy_or_a_recent_one_is_never_dropped() -> None:
    assert rebalance([worker("w0", resident("a", idle_ms=10**6))], RULE) == []
    assert rebalance([worker("w0", resident("a", active=1)), worker("w1", resident("a", idle_ms=59_999))], RULE) == []


def test_the_replica_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="--replicate-active must be >= 1 request per copy, got 0"):
        ReplicaRule(hot_active=0)
    with pytest.raises(ValueError, match="--drop-idle-s must be >= 0, got -1"):
        ReplicaRule(cold_idle_ms=-1000)
    with pytest.raises(ValueError, match=r"--replicate-ttft-ms must be >= 0 \(0: off\), got -5"):
        ReplicaRule(hot_ttft_ms=-5)
