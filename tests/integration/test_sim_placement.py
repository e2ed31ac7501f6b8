"""Model placement end to end on real processes without weights: a scheduler, a gateway and two
simulated colocated workers (`tandem sim-worker`) whose catalogue is the default model plus "chat"
and "code" (the same directory under $TANDEM_HOME/models), room for two models each, a load taking
300 ms. Cost placement loads a model on demand on one worker, the routing map shows it there, and
later requests for it stay on that worker. Latency placement serves the primary model the workers
loaded at start, refuses another model until ProvisionModel pins it, then serves it from the workers
holding it. A cold start that outlasts the scheduler's control-RPC timeout is waited for, and a
request whose deadline passes meanwhile leaves the load to finish; a model whose recent TTFT passes
--replicate-ttft-ms is copied onto the other worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.model_store import model_info
from tests.mesh import collect, greedy_request
from tests.sim_cluster import SimCluster, SimSpec, sim_tokens
from tests.waiting import wait_until
from tandem.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

PROMPT = list(range(200, 240))
MAX_TOKENS = 5
MODELS = ("chat", "code", "hot")
SLOW_LOAD_MS = 4500


@pytest.fixture(scope="module")
def catalogue_env(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[None]:
    """$TANDEM_HOME/models/{chat,code}: the default model under two more names; two models' weights
    of --model-memory; a 300 ms load."""
    home = tmp_path_factory.mktemp("home")
    (home / "models").mkdir()
    for name in MODELS:
        (home / "models" / name).symlink_to(default_model_dir, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_HOME", str(home))
        patch.setenv("TANDEM_MODEL_MEMORY", str(2 * model_info(default_model_dir).weight_bytes))
        patch.setenv("TANDEM_SIM_LOAD_MS", "300")
        yield


def start(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, *flags: str) -> SimCluster:
    spec = SimSpec(role="colocated", count=2, step_ms=2.0, kv_blocks=64)
    return SimCluster.start(tmp_path_factory.mktemp("sim"), [spec], model=model_dir, scheduler_flags=flags)


@pytest.fixture(scope="module")
def cost(catalogue_env: None, tmp_path_factory: pytest.TempPathFactory,
         default_model_dir: Path) -> Iterator[SimCluster]:
    cluster = start(tmp_path_factory, default_model_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def latency(catalogue_env: None, tmp_path_factory: pytest.TempPathFactory,
            default_model_dir: Path) -> Iterator[SimCluster]:
    cluster = start(tmp_path_factory, default_model_dir, "--placement", "latency")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def slow_load(catalogue_env: None, tmp_path_factory: pytest.TempPathFactory,
              default_model_dir: Path) -> Iterator[SimCluster]:
    """Cost placement whose loads outlast the scheduler's control-RPC timeout (the heartbeat TTL, 3 s),
    copying a model once the p90 TTFT of its last requests (8 at least) reaches 1 ms."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_SIM_LOAD_MS", str(SLOW_LOAD_MS))
        cluster = start(tmp_path_factory, default_model_dir, "--heartbeat-ttl", "3", "--replicate-ttft-ms", "1")
    try:
        yield cluster
    finally:
        cluster.stop()


def generate(cluster: SimCluster, model: str, timeout: float = 30) -> list[int]:
    with grpc.insecure_channel(cluster.gateway) as channel:
        stream = gateway_pb2_grpc.GenerateServiceStub(channel).Generate(
            greedy_request(PROMPT, MAX_TOKENS, model=model), timeout=timeout)
        token_ids, _ = collect(stream)
    return token_ids


def holders(cluster: SimCluster, model: str) -> dict[str, scheduler_pb2.ModelResidency]:
    """The routing map's entry for `model`, as the scheduler's Stats lists it: worker id -> residency."""
    return {w.info.worker_id: m for w in cluster.scheduler_stats().workers for m in w.load.models if m.name == model}


def loaded_holders(cluster: SimCluster, model: str) -> dict[str, scheduler_pb2.ModelResidency]:
    """holders(), once none of them is still loading the model (else empty)."""
    held = holders(cluster, model)
    return held if all(m.state == scheduler_pb2.MODEL_STATE_RESIDENT for m in held.values()) else {}


def routed_requests(cluster: SimCluster) -> set[str]:
    """The request ids of the scheduler's recent routes (its last 256)."""
    return {route.request_id for route in cluster.scheduler_stats(recent_routes=256).recent_routes}


def last_route(cluster: SimCluster) -> str:
    return cluster.scheduler_stats(recent_routes=1).recent_routes[-1].prefill_worker_id


def provision(cluster: SimCluster, model: str, replicas: int,
              metadata: tuple[tuple[str, str], ...] | None = None) -> list[str]:
    with grpc.insecure_channel(cluster.scheduler) as channel:
        response = scheduler_pb2_grpc.SchedulerServiceStub(channel).ProvisionModel(
            scheduler_pb2.ProvisionModelRequest(model=model, replicas=replicas), timeout=30,
            metadata=cluster.metadata if metadata is None else metadata)
    return list(response.worker_ids)


def test_workers_register_their_catalogue_and_hold_their_primary_model(cost: SimCluster,
                                                                      default_model_dir: Path) -> None:
    primary = default_model_dir.name
    for worker in cost.scheduler_stats().workers:
        assert list(worker.info.catalogue) == [primary, *MODELS]
        assert [(m.name, m.state) for m in worker.load.models] == [(primary, scheduler_pb2.MODEL_STATE_RESIDENT)]


def test_cost_placement_loads_a_model_on_one_worker_and_keeps_its_requests_there(cost: SimCluster) -> None:
    assert generate(cost, "code") == sim_tokens(PROMPT, MAX_TOKENS)
    loader = last_route(cost)
    # The map learns that the load finished at the loader's next heartbeat: until then it says LOADING.
    resident = wait_until(lambda: loaded_holders(cost, "code"), "code resident in the routing map")
    assert list(resident) == [loader]
    for _ in range(3):  # the other worker is as idle, but does not hold the model
        assert generate(cost, "code") == sim_tokens(PROMPT, MAX_TOKENS)
        assert last_route(cost) == loader
    assert list(holders(cost, "code")) == [loader]


def test_latency_placement_refuses_an_unprovisioned_model(latency: SimCluster) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(latency, "chat")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().endswith(
        "model 'chat' is not provisioned: --placement latency serves only provisioned models and never loads one for "
        "a request; provision it first: tandem models provision chat --replicas N")
    assert holders(latency, "chat") == {}  # nothing was loaded for it


def test_latency_placement_serves_the_primary_model_the_workers_loaded_at_start(latency: SimCluster,
                                                                              default_model_dir: Path) -> None:
    primary = default_model_dir.name
    assert generate(latency, primary) == sim_tokens(PROMPT, MAX_TOKENS)
    held = holders(latency, primary)
    assert sorted(held) == sorted(latency.workers) and not any(m.pinned for m in held.values())


def test_provisioning_pins_a_model_on_the_asked_workers_and_then_it_is_served(latency: SimCluster) -> None:
    chosen = provision(latency, "chat", 2)
    assert sorted(chosen) == sorted(latency.workers)
    pinned = holders(latency, "chat")  # at once, before any heartbeat
    assert sorted(pinned) == sorted(latency.workers)
    assert all(m.pinned and m.state == scheduler_pb2.MODEL_STATE_RESIDENT for m in pinned.values())
    assert generate(latency, "chat") == sim_tokens(PROMPT, MAX_TOKENS)
    assert provision(latency, "chat", 1) == [min(chosen)]  # already pinned: nothing to load, the first by id
    assert sorted(holders(latency, "chat")) == sorted(latency.workers)


def test_provisioning_refuses_an_unknown_model_too_many_replicas_and_a_caller_without_the_token(
        latency: SimCluster) -> None:
    with pytest.raises(grpc.RpcError) as unknown:
        provision(latency, "nope", 1)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no live worker's catalogue holds model 'nope'" in unknown.value.details()
    with pytest.raises(grpc.RpcError) as short:
        provision(latency, "code", 3)
    assert short.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "only 2 of 3 colocated workers could take it" in short.value.details()
    with pytest.raises(grpc.RpcError) as anonymous:
        provision(latency, "code", 1, metadata=())
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_cold_start_longer_than_the_control_timeout_is_waited_for(slow_load: SimCluster) -> None:
    assert generate(slow_load, "chat") == sim_tokens(PROMPT, MAX_TOKENS)
    resident = wait_until(lambda: loaded_holders(slow_load, "chat"), "chat resident in the routing map")
    assert list(resident) == [last_route(slow_load)]


def test_a_request_whose_deadline_passes_during_a_cold_start_ends_but_the_load_goes_on(slow_load: SimCluster) -> None:
    # The premise is a request routed before its deadline passes, so that its worker starts the load;
    # on a loaded machine the gateway and the queue may outlast the deadline before routing, and such a
    # request starts nothing: it is sent again (a new route in Stats tells which happened).
    routed_before = routed_requests(slow_load)
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as late:
            generate(slow_load, "code", timeout=SLOW_LOAD_MS / 1000 / 2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if routed_requests(slow_load) - routed_before:
            break
    else:
        pytest.fail("none of 5 requests was routed before its deadline")
    loader = wait_until(lambda: list(holders(slow_load, "code")), "code in the routing map")
    assert list(wait_until(lambda: loaded_holders(slow_load, "code"), "code resident in the routing map")) == loader
    assert generate(slow_load, "code") == sim_tokens(PROMPT, MAX_TOKENS)
    assert last_route(slow_load) == loader[0]


def test_a_model_whose_recent_ttft_passes_the_threshold_is_copied_onto_the_other_worker(slow_load: SimCluster) -> None:
    for _ in range(8):  # the first waits for the load: the p90 of the window is that wait
        assert generate(slow_load, "hot") == sim_tokens(PROMPT, MAX_TOKENS)
    copies = wait_until(lambda: len(loaded_holders(slow_load, "hot")) == 2 and loaded_holders(slow_load, "hot"),
                        "hot resident on both workers", timeout=60)
    assert sorted(copies) == sorted(slow_load.workers)
