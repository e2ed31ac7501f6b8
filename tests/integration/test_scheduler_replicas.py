"""Two scheduler replicas sharing Redis, with simulated workers that register with and report to
both: a replica SIGKILLed while requests stream loses none of them (each completes token-exact from
its worker), and the requests after it are placed by the replica left."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.common.health_cli import SERVING, check
from tests.redis_fixture import RedisServer
from tests.sim_cluster import SimCluster, SimSpec, sim_tokens
from tests.sim_cluster import generate as sim_generate
from tests.waiting import wait_until
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

MAX_TOKENS = 60
NUM_REQUESTS = 6


@pytest.fixture
def cluster(tmp_path: Path, redis_server: RedisServer, default_model_dir: Path) -> Iterator[SimCluster]:
    spec = SimSpec(role="colocated", count=2, step_ms=40.0, kv_blocks=256)
    cluster = SimCluster.start(tmp_path, [spec], redis_url=redis_server.url, schedulers=2, model=default_model_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


def generate(cluster: SimCluster, prompt: list[int], max_tokens: int) -> list[int]:
    return sim_generate(cluster.gateway, prompt, max_tokens, timeout=60)


def running(cluster: SimCluster) -> int:
    total = 0
    for address in cluster.workers.values():
        with grpc.insecure_channel(address) as channel:
            total += worker_pb2_grpc.ColocatedServiceStub(channel).Stats(
                worker_pb2.WorkerStatsRequest(), timeout=5, metadata=cluster.metadata).running
    return total


def test_a_scheduler_killed_under_load_loses_no_placed_request_and_the_other_takes_new_ones(
        cluster: SimCluster) -> None:
    prompts = [[200 + i, *range(300, 330)] for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(generate, cluster, prompt, MAX_TOKENS) for prompt in prompts]
        wait_until(lambda: running(cluster) == NUM_REQUESTS, "every request running on the sim workers")
        os.kill(cluster.pid("scheduler"), signal.SIGKILL)
        results = [future.result(timeout=90) for future in futures]
    assert results == [sim_tokens(prompt, MAX_TOKENS) for prompt in prompts]

    after = [[400 + i, *range(500, 520)] for i in range(4)]
    assert [generate(cluster, prompt, 5) for prompt in after] == [sim_tokens(p, 5) for p in after]
    with grpc.insecure_channel(cluster.schedulers[1]) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(
            scheduler_pb2.SchedulerStatsRequest(recent_routes=4), timeout=10, metadata=cluster.metadata)
    assert len(stats.recent_routes) == 4
    assert check(cluster.gateway) == SERVING  # while any scheduler serves
    assert "NOT_SERVING" not in (cluster.run_dir / "gateway.log").read_text()


def test_two_schedulers_never_over_reserve_one_small_decode_worker(tmp_path: Path, redis_server: RedisServer,
                                                                   default_model_dir: Path) -> None:
    """Each request needs 5 of the decode worker's 16 blocks (40 prompt + 30 output tokens): at most 3
    fit at once, and 8 arrive together through both replicas. The worker's Reserve is the authority,
    so every request completes token-exact and the blocks all come back."""
    specs = [SimSpec(role="prefill", step_ms=5.0), SimSpec(role="decode", step_ms=20.0, kv_blocks=16)]
    cluster = SimCluster.start(tmp_path, specs, redis_url=redis_server.url, schedulers=2, model=default_model_dir)
    try:
        decode = next(address for worker_id, address in cluster.workers.items() if worker_id.startswith("decode"))
        prompts = [[600 + i, *range(700, 739)] for i in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: generate(cluster, p, 30), prompts))
        assert results == [sim_tokens(prompt, 30) for prompt in prompts]

        def idle() -> worker_pb2.WorkerStats | None:
            with grpc.insecure_channel(decode) as channel:
                stats = worker_pb2_grpc.DecodeServiceStub(channel).Stats(
                    worker_pb2.WorkerStatsRequest(), timeout=5, metadata=cluster.metadata)
            return stats if not (stats.reserved_blocks or stats.referenced_blocks or stats.running) else None

        stats = wait_until(idle, "the decode worker idle with no block reserved")
        assert stats.free_blocks + stats.cached_blocks == 16
    finally:
        cluster.stop()
