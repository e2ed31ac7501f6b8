"""A worker's numbers as others read them: its snapshot as the WorkerStats message, and the growth
of its counters between two engine steps as Prometheus increments. The counters are one record
(services/runtime/counters.py); these are its two conversions.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.metrics import ServiceMetrics
from services.common.wire import FINISH_REASON_FROM_PROTO
from services.runtime.counters import EngineCounters
from services.worker.engine_loop import EngineSnapshot
from services.worker.residency import ModelRecord
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2


def worker_stats(snapshot: EngineSnapshot, reserved_blocks: int, pending: int) -> worker_pb2.WorkerStats:
    """The snapshot as WorkerStats; `pending`: requests held outside the engine's queues (KV in flight)."""
    counters = snapshot.counters
    sizes = counters.batch_sizes
    return worker_pb2.WorkerStats(
        num_blocks=snapshot.num_blocks,
        free_blocks=snapshot.allocatable_blocks - snapshot.cached_blocks,
        cached_blocks=snapshot.cached_blocks,
        referenced_blocks=snapshot.referenced_blocks,
        reserved_blocks=reserved_blocks,
        running=snapshot.running,
        waiting=snapshot.waiting + pending,
        iterations=counters.iterations,
        last_batch_size=counters.last_batch_size,
        max_batch_size=counters.max_batch_size,
        batch_size_histogram=[sizes.get(size, 0) for size in range(counters.max_batch_size + 1)],
        preemptions=counters.preemptions,
        prefix_cache_queried_tokens=counters.prefix_queried_tokens,
        prefix_cache_hit_tokens=counters.prefix_hit_tokens,
        kv_bytes_sent=counters.kv_bytes_sent,
        kv_bytes_received=counters.kv_bytes_received,
        generated_tokens=counters.generated_tokens,
    )


def update_metrics(metrics: ServiceMetrics, now: EngineSnapshot, grown: EngineCounters,
                   events: Iterable[scheduler_pb2.TokenEvent]) -> None:
    """Gauges from the worker's snapshot, counters by their growth (`grown`: one engine's since its
    previous step), latencies from the step's events."""
    for event in events:
        if event.output_offset == 0 and event.token_ids:
            metrics.time_to_first_token.observe(event.timings.time_to_first_token_ms / 1000)
        if event.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            metrics.request_success(FINISH_REASON_FROM_PROTO[event.finish_reason]).inc()
            metrics.prompt_tokens.inc(event.usage.prompt_tokens)
    metrics.num_requests_running.set(now.running)
    metrics.num_requests_waiting.set(now.waiting)
    metrics.kv_cache_usage.set(now.referenced_blocks / max(now.num_blocks, 1))
    metrics.num_preemptions.inc(grown.preemptions)
    metrics.prefix_cache_queries.inc(grown.prefix_queried_tokens)
    metrics.prefix_cache_hits.inc(grown.prefix_hit_tokens)
    metrics.generation_tokens.inc(grown.generated_tokens)
    metrics.kv_transfer_bytes.inc(grown.kv_bytes_sent)


def residency_to_pb(record: ModelRecord) -> scheduler_pb2.ModelResidency:
    return scheduler_pb2.ModelResidency(name=record.name, state=int(record.state), pinned=record.pinned,
                                        weight_bytes=record.weight_bytes, active_requests=record.active_requests,
                                        idle_ms=record.idle_ms)


def policy_attributes(policy: scheduler_pb2.BatchPolicy) -> dict[str, int]:
    """The batching policy as span attributes of the requests that run under it."""
    return {"tandem.batch.max_num_batched_tokens": policy.max_num_batched_tokens,
            "tandem.batch.max_num_seqs": policy.max_num_seqs, "tandem.batch.chunk_size": policy.chunk_size,
            "tandem.batch.window_ms": policy.batch_window_ms, "tandem.batch.step_target_ms": policy.step_target_ms,
            "tandem.batch.min_prefill_tokens": policy.min_prefill_tokens}


def record_policy(metrics: ServiceMetrics, policy: scheduler_pb2.BatchPolicy) -> None:
    """The batching policy in /metrics (tandem:batch_policy{field=...})."""
    for name, value in policy_attributes(policy).items():
        metrics.batch_policy(name.removeprefix("tandem.batch.")).set(value)
