"""The SLO batching policy end to end between a worker's Registration and a real scheduler servicer:
the worker's heartbeats carry its step-cost model, the answers the policy, which reaches on_policy;
the policy as the worker's span attributes and /metrics gauges."""

from __future__ import annotations

import grpc

from services.common.grpc_server import create_server
from services.common.metrics import ServiceMetrics
from services.common.store import EmbeddedStore
from services.scheduler.batch_policy import SloPolicy
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.registry import WorkerRegistry
from services.scheduler.servicer import SERVICE_NAME, SchedulerServicer
from services.scheduler.worker_clients import WorkerClients
from services.worker.registration import Registration
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
