"""`tandem sim-worker` against a real scheduler and gateway: simulated workers register, serve a
request through the gateway with their deterministic tokens, report its prompt's blocks to the
prefix index (a repeat is routed to them with a prefix hit) and free every block afterwards; a
prefill and a decode sim worker hand the KV over and continue the same tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.sim_cluster import SimCluster, SimSpec, sim_tokens
from tests.sim_cluster import generate as sim_generate
from tests.waiting import wait_until
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

NUM_BLOCKS = 64
PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16
MAX_TOKENS = 7
# sim_token over the prompt's last token at positions 40..46, worked out once by hand.
EXPECTED = [18349, 17796, 19542, 16253, 27647, 20086, 18088]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[SimCluster]:
    spec = SimSpec(role="colocated", count=2, step_ms=2.0, kv_blocks=NUM_BLOCKS)
    cluster = SimCluster.start(tmp_path_factory.mktemp("sim"), [spec], model=default_model_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


def generate(cluster: SimCluster, prompt: list[int], max_tokens: int) -> list[int]:
    return sim_generate(cluster.gateway, prompt, max_tokens, timeout=30)


def worker_stats(cluster: SimCluster, address: str) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.ColocatedServiceStub(channel).Stats(
            worker_pb2.WorkerStatsRequest(), timeout=5, metadata=cluster.metadata)


def test_sim_workers_register_with_their_blocks(cluster: SimCluster) -> None:
    stats = cluster.scheduler_stats()
    registered = {w.info.worker_id: w.info for w in stats.workers}
    assert set(registered) == set(cluster.workers) and len(registered) == 2
    for worker_id, info in registered.items():
        assert info.role == common_pb2.WORKER_ROLE_COLOCATED
        assert info.address == cluster.workers[worker_id]
        assert (info.num_blocks, info.block_size, info.max_model_len) == (NUM_BLOCKS, 16, 8192)


def test_a_request_gets_deterministic_tokens_then_its_blocks_are_indexed_and_freed(cluster: SimCluster) -> None:
    assert sim_tokens(PROMPT, MAX_TOKENS) == EXPECTED

    assert generate(cluster, PROMPT, MAX_TOKENS) == EXPECTED
    route = cluster.scheduler_stats(recent_routes=1).recent_routes[-1]
    serving = route.prefill_worker_id
    assert serving in cluster.workers and route.matched_prefix_blocks == 0

    # 46 tokens have KV: 2 full blocks stay cached, none referenced; the scheduler hears of them.
    def idle_with_cache() -> worker_pb2.WorkerStats | None:
        stats = worker_stats(cluster, cluster.workers[serving])
        idle = not (stats.referenced_blocks or stats.reserved_blocks or stats.running or stats.waiting)
        return stats if idle and stats.cached_blocks == 2 else None

    stats = wait_until(idle_with_cache, "the serving sim worker idle with 2 cached blocks")
    assert stats.free_blocks == NUM_BLOCKS - 2  # the others are free

    def cached_as_scheduler_sees() -> int:
        return {w.info.worker_id: w.load.cached_blocks for w in cluster.scheduler_stats().workers}[serving]

    wait_until(lambda: cached_as_scheduler_sees() == 2, "the scheduler's view of the worker's 2 cached blocks")

    assert generate(cluster, PROMPT, MAX_TOKENS) == EXPECTED
    repeat = cluster.scheduler_stats(recent_routes=1).recent_routes[-1]
    assert (repeat.prefill_worker_id, repeat.matched_prefix_blocks) == (serving, 2)
    wait_until(lambda: idle_with_cache() is not None, "the serving sim worker idle again")


def test_prefill_and_decode_sim_workers_hand_over_and_continue_the_same_tokens(
        tmp_path: Path, default_model_dir: Path) -> None:
    specs = [SimSpec(role="prefill", step_ms=2.0, kv_blocks=NUM_BLOCKS),
             SimSpec(role="decode", step_ms=2.0, kv_blocks=NUM_BLOCKS)]
    disaggregated = SimCluster.start(tmp_path, specs, model=default_model_dir)
    try:
        assert generate(disaggregated, PROMPT, MAX_TOKENS) == EXPECTED
        route = disaggregated.scheduler_stats(recent_routes=1).recent_routes[-1]
        assert route.prefill_worker_id.startswith("prefill-") and route.decode_worker_id.startswith("decode-")
        assert route.reserved_blocks == 3  # 40 prompt tokens and the first token: 41 tokens of KV room
    finally:
        disaggregated.stop()
