"""The SLO batching policy end to end between a worker's Registration and a real scheduler servicer:
the worker's heartbeats carry its step-cost model, the answers the policy, which reaches on_policy;
the policy as the worker's span attributes and /metrics gauges."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from services.common.grpc_server import create_server
from services.common.metrics import ServiceMetrics
from services.common.step_cost import StepCost, StepCostFit
from services.common.store import EmbeddedStore
from services.scheduler.batch_policy import SloPolicy
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.prefill_placement import PlacementPolicy
from services.scheduler.registry import WorkerRegistry
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer
from services.scheduler.worker_clients import WorkerClients
from services.runtime.engine import IterationWork
from services.worker.engine_loop import EngineSnapshot, StepResult
from services.worker.registration import Registration
from services.worker.runtime import (
    PREFILL_FIT_MIN_STEPS, PREFILL_FIT_WARMUP_STEPS, STEP_COST_REFIT_STEPS, ModelPlan, WorkerIdentity, WorkerRuntime,
)
from services.worker.stats import policy_attributes, record_policy
from services.worker.transport import internal_metadata
from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

TOKEN = "s3cret"
WORKER = scheduler_pb2.WorkerInfo(worker_id="colo-w", role=common_pb2.WORKER_ROLE_COLOCATED, address="127.0.0.1:1",
                                  model="smol", num_blocks=64, block_size=16)
POLICY = scheduler_pb2.BatchPolicy(max_num_batched_tokens=520, max_num_seqs=8, chunk_size=512, batch_window_ms=10,
                                   step_target_ms=50, min_prefill_tokens=52)
BEFORE_FIT = scheduler_pb2.BatchPolicy(step_target_ms=50, min_prefill_tokens=52)


async def test_heartbeats_bring_the_policy_once_the_worker_reports_a_cost_model() -> None:
    dispatcher = Dispatcher(WorkerRegistry(EmbeddedStore(), 5.0), WorkerClients(TOKEN), max_queue=4, max_running=8)
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)
    slo = SloPolicy(ttft_ms=1000, itl_ms=50, context_tokens=1024, max_seqs_cap=8)
    server.add_service(SERVICE_NAME, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                       SchedulerServicer(dispatcher, scheduler_id="s", slo=slo))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    load = scheduler_pb2.WorkerLoad()
    received: list[scheduler_pb2.BatchPolicy] = []

    async def on_policy(policy: scheduler_pb2.BatchPolicy) -> None:
        received.append(policy)

    registration = Registration(channel, WORKER, lambda: load, internal_metadata(TOKEN), on_policy=on_policy)
    try:
        first = await registration.register()
        assert await registration.heartbeat()
        assert received == []
        load.step_cost.CopyFrom(scheduler_pb2.StepCostModel(fixed_ms=10, per_token_ms=0.05,
                                                            per_context_token_ms=0.0001, per_decode_context_ms=0.001))
        assert await registration.heartbeat()
    finally:
        await registration.stop(deregister=False)
        await channel.close()
        await dispatcher.close()
        await server.stop(0)
    assert first.policy == BEFORE_FIT
    assert received == [POLICY]


def test_the_policy_on_spans_and_in_metrics() -> None:
    assert policy_attributes(POLICY) == {"tandem.batch.max_num_batched_tokens": 520, "tandem.batch.max_num_seqs": 8,
                                         "tandem.batch.chunk_size": 512, "tandem.batch.window_ms": 10,
                                         "tandem.batch.step_target_ms": 50, "tandem.batch.min_prefill_tokens": 52}
    metrics = ServiceMetrics("m", "colo-w")
    record_policy(metrics, POLICY)
    labels = {"model_name": "m", "worker": "colo-w"}
    assert metrics.registry.get_sample_value("tandem:batch_policy", {**labels, "field": "max_num_batched_tokens"}) == 520
    assert metrics.registry.get_sample_value("tandem:batch_policy", {**labels, "field": "window_ms"}) == 10
    assert metrics.registry.get_sample_value("tandem:batch_policy", {**labels, "field": "step_target_ms"}) == 50


def step(started_ms: float, ms: float, decodes: int, prompt_tokens: int) -> StepResult:
    """A step of `decodes` decodes at 100 entries each and one prompt chunk from position 0."""
    work = {f"d{i}": IterationWork(1, 0, 0, 100) for i in range(decodes)}
    work["p"] = IterationWork(prompt_tokens, 0, 0, prompt_tokens * (prompt_tokens + 1) // 2)
    return StepResult(outputs=[], batch_size=len(work), iteration=0, started_ns=int(started_ms * 1e6),
                      ended_ns=int((started_ms + ms) * 1e6), work=work, running_ids=frozenset(), stored=[],
                      evicted=[], snapshot=EngineSnapshot())


async def test_the_worker_sizes_steps_with_the_margin_its_steps_overran_by_and_refits_after_a_slow_one() -> None:
    truth = StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.01, per_decode_context_ms=0.1)
    metrics = ServiceMetrics("m", "colo-w")
    runtime = WorkerRuntime(WorkerIdentity("colo-w", common_pb2.WORKER_ROLE_COLOCATED, "127.0.0.1:1", "m", "cpu"),
                            ModelPlan({"m": 1}, 1), make_engine=None, schedulers=[], metrics=metrics)
    runtime.step_cost = StepCostFit(window=64, min_samples=16, warmup=0, recent=16)
    runtime.policy = scheduler_pb2.BatchPolicy(step_target_ms=50, min_prefill_tokens=4)
    scheduler = SimpleNamespace(target=None)
    served = SimpleNamespace(engine=SimpleNamespace(scheduler=scheduler))
    for i in range(STEP_COST_REFIT_STEPS):  # on the fit: no margin
        decodes, tokens = 1 + i % 4, 2 + i
        predicted = truth.step_ms(decodes + tokens, tokens * (tokens + 1) // 2, 100 * decodes)
        runtime._record_step_cost(step(100.0 * i, predicted, decodes, tokens), served)
    assert scheduler.target.cost.fixed_ms == pytest.approx(10.0)
    assert scheduler.target.margin_ms == pytest.approx(0.0, abs=1e-6)
    # A step 20 ms over its prediction and past the 40 ms steps are sized to (the 50 ms target less the
    # headroom), though within the target: the engine gets a new target at once, without waiting for
    # STEP_COST_REFIT_STEPS steps, its margin that step's overrun under the new fit (the whole 20 ms:
    # so far from the other steps, the fit leaves it out).
    assert 40.0 < truth.step_ms(1 + 2, 3, 100) + 20.0 < 50.0
    runtime._record_step_cost(step(2000.0, truth.step_ms(1 + 2, 3, 100) + 20.0, 1, 2), served)
    fit = runtime.step_cost.fit()
    assert fit.fixed_ms == pytest.approx(10.0) and fit.per_token_ms == pytest.approx(1.0)
    assert truth.step_ms(1 + 2, 3, 100) + 20.0 - fit.step_ms(1 + 2, 3, 100) == pytest.approx(20.0)
    assert scheduler.target.margin_ms == pytest.approx(runtime.step_cost.overrun_ms(fit)) and scheduler.target.margin_ms > 0
    assert scheduler.target.sizing_ms == pytest.approx(40.0 - scheduler.target.margin_ms)  # the headroom: 10 ms
    assert metrics.registry.get_sample_value("tandem:batch_policy", {"model_name": "m", "worker": "colo-w",
                                                                      "field": "step_margin_ms"}) == scheduler.target.margin_ms


def test_a_hybrid_decode_worker_sizes_its_steps_to_the_step_the_hybrid_placement_prices() -> None:
    def aimed(role: int, local_prefill: bool) -> float:
        runtime = WorkerRuntime(WorkerIdentity("w", role, "127.0.0.1:1", "m", "cpu", local_prefill=local_prefill),
                                ModelPlan({"m": 1}, 1), make_engine=None, schedulers=[])
        runtime.policy = scheduler_pb2.BatchPolicy(step_target_ms=50, min_prefill_tokens=4)
        return runtime._step_target().step_ms

    assert aimed(common_pb2.WORKER_ROLE_DECODE, local_prefill=True) == 30.0  # 40% headroom
    assert PlacementPolicy(itl_ms=50.0).aimed_step_ms == 30.0  # what the scheduler prices its local prefills with
    assert aimed(common_pb2.WORKER_ROLE_COLOCATED, local_prefill=False) == 40.0  # 20%
    assert aimed(common_pb2.WORKER_ROLE_DECODE, local_prefill=False) == 40.0


def test_a_prefill_worker_fits_its_one_chunk_steps_after_a_few_of_them() -> None:
    def fit_after(role: int, steps: int):
        runtime = WorkerRuntime(WorkerIdentity("w", role, "127.0.0.1:1", "m", "cpu"), ModelPlan({"m": 1}, 1),
                                make_engine=None, schedulers=[])
        for i in range(steps):
            reads = 512 * 512 * (i % 3) + 512 * 513 // 2  # the chunk from position 0, 512 or 1,024
            runtime.step_cost.record(512, reads, 512.0 + 0.004 * reads)
        return runtime.step_cost.fit()

    assert fit_after(common_pb2.WORKER_ROLE_PREFILL, PREFILL_FIT_WARMUP_STEPS + PREFILL_FIT_MIN_STEPS - 1) is None
    fit = fit_after(common_pb2.WORKER_ROLE_PREFILL, PREFILL_FIT_WARMUP_STEPS + PREFILL_FIT_MIN_STEPS)
    assert (fit.fixed_ms, fit.per_token_ms, fit.per_context_token_ms) == (0.0, pytest.approx(1.0), pytest.approx(0.004))
    assert fit_after(common_pb2.WORKER_ROLE_COLOCATED, 64) is None  # steps all alike: no model, as before
