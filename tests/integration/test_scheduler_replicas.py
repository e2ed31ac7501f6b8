"""Two scheduler replicas sharing Redis, with simulated workers that register with and report to
both: a replica SIGKILLed while requests stream loses none of them (each completes token-exact from
its worker), and the requests after it are placed by the replica left; the requests queued on it,
and those it placed that no worker has started yet, move to the other one at once."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.common.health_cli import SERVING, check
from services.common.model_store import model_name
from services.common.spans import Attr, SpanName
from services.gateway.replica_choice import prefix_key, rendezvous_order
from tests.mesh import greedy_request
from tests.redis_fixture import RedisServer
from tests.sim_cluster import SimCluster, SimSpec, sim_tokens
from tests.sim_cluster import generate as sim_generate
from tests.waiting import wait_until
from tandem.v1 import common_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

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



def test_a_killed_scheduler_s_streaming_requests_stream_on_and_its_queued_ones_move_to_the_other(
        tmp_path: Path, redis_server: RedisServer, default_model_dir: Path) -> None:
    """Each replica runs at most 2 requests at once (--max-running 2 over one worker), so of the 4 each
    one gets (by their leading prefix, as the gateway ranks them) 2 run and 2 wait in its queue. The
    first replica is SIGKILLed once its 2 running requests have streamed a token: those stream on from
    the worker to their end (the other replica never sees them), and its 2 queued ones, whose
    Submissions stream broke, go to the other replica at once, as continuations with nothing delivered
    (migration 1: a new attempt id on the workers). All 8 complete token-exact, and the worker's block
    reports, which rode the first replica's stream, go to the other: a moved prompt sent again finds
    its block in the index."""
    spec = SimSpec(role="colocated", count=1, step_ms=40.0, kv_blocks=512)
    with killed_first_replica(tmp_path, redis_server, default_model_dir, spec, started=True) as run:
        assert run.placed_started == run.placed
    assert run.results == run.expected
    assert run.routes_after == sorted([*run.others, *(run.first - run.placed)])
    assert (run.after.submitted, run.after.migrated, run.after.completed) == (4, 2, 6)
    assert run.worker_ends == {**{r: "length" for r in run.others | run.placed},
                               **{f"{r}#migrated-1": "length" for r in run.first - run.placed}}
    assert run.matched_again == 1  # its 31-token prompt's one full block


def test_a_killed_scheduler_s_requests_not_started_yet_move_to_the_other_as_continuations(
        tmp_path: Path, redis_server: RedisServer, default_model_dir: Path) -> None:
    """As above, with a prefill of seconds (20 prompt tokens a second): the first replica is killed while
    the worker still prefills its 2 placed requests. The gateway hands them to the other replica as
    continuations with nothing delivered (attempt `ID#migrated-1`, so the worker's first copy cannot
    collide), as it does the 2 queued ones. The worker drops its first copies at once (no gateway reads
    them, and the replica that placed them is gone), so they end ABORT. All 8 complete token-exact."""
    spec = SimSpec(role="colocated", count=1, step_ms=40.0, kv_blocks=512, prefill_tokens_per_s=20.0)
    with killed_first_replica(tmp_path, redis_server, default_model_dir, spec, started=False) as run:
        assert run.placed_started == set()
    assert run.results == run.expected
    assert run.routes_after == sorted([*run.others, *run.first])
    assert (run.after.submitted, run.after.migrated, run.after.completed) == (4, 4, 8)
    assert run.worker_ends == {**{r: "length" for r in run.others}, **{r: "abort" for r in run.placed},
                               **{f"{r}#migrated-1": "length" for r in run.first}}
    assert run.matched_again == 1


@dataclass
class KilledReplicaRun:
    """What the first of two replicas held when it was killed, and how its requests ended."""

    first: set[str]  # the requests the gateway sent to the first replica
    others: set[str]  # ... to the second
    placed: set[str] = field(default_factory=set)  # the first replica's running ones when it was killed
    placed_started: set[str] = field(default_factory=set)  # those of them that had streamed a token then
    results: list[tuple[list[int], int]] = field(default_factory=list)  # (tokens, finish reason) of each
    expected: list[tuple[list[int], int]] = field(default_factory=list)
    routes_after: list[str] = field(default_factory=list)  # the second replica's routes, sorted
    after: scheduler_pb2.SchedulerStats | None = None  # the second replica's, once all ended
    worker_ends: dict[str, str] = field(default_factory=dict)  # attempt id -> how it ended on the worker
    matched_again: int = -1  # prefix blocks the second replica found for a moved request's prompt, sent again


@contextlib.contextmanager
def killed_first_replica(tmp_path: Path, redis_server: RedisServer, model: Path, spec: SimSpec,
                         started: bool, max_tokens: int = 40) -> Iterator[KilledReplicaRun]:
    """Two replicas of --max-running 2 over `spec`'s one worker, 4 requests to each; the first replica
    SIGKILLed once each has 2 running and 2 waiting (and, if `started`, its running ones have streamed
    a token). Yields the run after the kill (to check what held then), then completes it."""
    cluster = SimCluster.start(tmp_path, [spec], redis_url=redis_server.url, schedulers=2,
                               scheduler_flags=("--max-running", "2"), model=model)
    try:
        prompts = prompts_by_replica(model_name(model), per_replica=4)
        ids = [f"killed-{i}" for i in range(len(prompts))]
        run = KilledReplicaRun(first={ids[i] for i, (replica, _) in enumerate(prompts) if replica == 0},
                               others={ids[i] for i, (replica, _) in enumerate(prompts) if replica == 1})
        streamed: dict[str, list[int]] = {request_id: [] for request_id in ids}
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(generate_as, cluster, request_id, prompt, max_tokens, streamed[request_id])
                       for request_id, (_, prompt) in zip(ids, prompts)]

            def holding() -> set[str]:
                if [replica_stats(cluster, r).waiting for r in (0, 1)] != [2, 2]:
                    return set()
                placed = {route.request_id for route in replica_stats(cluster, 0, recent_routes=8).recent_routes}
                return placed if not started or all(streamed[r] for r in placed) else set()

            run.placed = wait_until(holding, "2 requests running on the first replica (streaming, if asked) "
                                             "and 2 waiting in each replica's queue")
            os.kill(cluster.pid("scheduler"), signal.SIGKILL)
            run.placed_started = {request_id for request_id in run.placed if streamed[request_id]}
            yield run
            run.results = [future.result(timeout=90) for future in futures]
        run.expected = [(sim_tokens(prompt, max_tokens), common_pb2.FINISH_REASON_LENGTH) for _, prompt in prompts]
        run.after = wait_until(lambda: (stats := replica_stats(cluster, 1, recent_routes=16)).running == 0 and stats,
                               "the second replica's requests all ended")
        run.routes_after = sorted(route.request_id for route in run.after.recent_routes)
        run.worker_ends = wait_until(lambda: len(ends := worker_ends(cluster)) == 8 + len(run.placed) * (not started)
                                     and ends, "the worker's span of every attempt ended")
        # Its prompt was computed after the kill: its blocks reached the index only if the worker's
        # block reports moved to the replica left.
        moved = ids.index(min(run.first - run.placed))
        generate_as(cluster, "again", prompts[moved][1], 1, [])
        (route,) = replica_stats(cluster, 1, recent_routes=1).recent_routes
        run.matched_again = route.matched_prefix_blocks if route.request_id == "again" else -1
        assert len(run.placed) == 2 and run.placed < run.first
    finally:
        cluster.stop()


def prompts_by_replica(model: str, per_replica: int) -> list[tuple[int, list[int]]]:
    """`per_replica` prompts the gateway sends to each of 2 replicas (the first in their prefix's
    ranking; too few for the bound on a replica's share to pass any over), as (replica, prompt)."""
    found: list[tuple[int, list[int]]] = []
    for head in itertools.count(800):
        prompt = [head, *range(900, 930)]
        replica = rendezvous_order(prefix_key(model, "", "", prompt), 2)[0]
        if sum(r == replica for r, _ in found) < per_replica:
            found.append((replica, prompt))
        if len(found) == 2 * per_replica:
            return found
    raise AssertionError("unreachable")


def generate_as(cluster: SimCluster, request_id: str, prompt: list[int], max_tokens: int,
                streamed: list[int]) -> tuple[list[int], int]:
    """One greedy request named `request_id`, its tokens appended to `streamed` as they come: its token
    ids and finish reason."""
    with grpc.insecure_channel(cluster.gateway) as channel:
        stream = gateway_pb2_grpc.GenerateServiceStub(channel).Generate(
            greedy_request(prompt, max_tokens, request_id=request_id), timeout=90)
        finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        for message in stream:
            streamed.extend(message.token_ids)
            finish_reason = message.finish_reason
    return list(streamed), finish_reason


def worker_ends(cluster: SimCluster) -> dict[str, str]:
    """How each attempt ended on the simulated worker (its span's finish reason), by attempt id."""
    ends = {}
    for line in (cluster.run_dir / "spans-sim-colocated.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("name") == SpanName.COLOCATED and "end_ns" in record:
            attributes = record["attributes"]
            ends[attributes[Attr.REQUEST_ID]] = attributes[Attr.GEN_AI_RESPONSE_FINISH_REASONS][0]
    return ends


def replica_stats(cluster: SimCluster, replica: int, recent_routes: int = 0) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(cluster.schedulers[replica]) as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(
            scheduler_pb2.SchedulerStatsRequest(recent_routes=recent_routes), timeout=10, metadata=cluster.metadata)
