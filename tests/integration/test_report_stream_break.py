"""A worker's ReportTokens stream that breaks on one side only loses no final event, and applies none
twice. Real processes on loopback: a scheduler and a colocated sim worker that dials it through a
TCP relay (tests/tcp_proxy.py); the test plays the gateway (the scheduler's Submit call, the
worker's Follow call). The relay silences the worker's connection to the scheduler, the worker ends
a request into the silence, then the relay resets the worker's side only: the scheduler still
holds the old stream when the worker's new one arrives. The heartbeat TTL is long, so the scheduler
never expires the worker meanwhile: the request can end only by its final event (or its deadline,
which is the defect: a request that ends DEADLINE_EXCEEDED fails the test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.test_worker_drops import LONG, PROMPT, attached, end_of, submit
from tests.sim_cluster import SimCluster, SimSpec, sim_tokens
from tests.tcp_proxy import TcpProxy
from tests.waiting import wait_until

RESENT = "unacknowledged final event(s) resent"  # the worker's log line (services/worker/reporter.py)


@pytest.fixture
def relayed(tmp_path: Path, default_model_dir: Path) -> Iterator[tuple[SimCluster, TcpProxy]]:
    """A scheduler, and one colocated sim worker whose every call to it goes through the relay."""
    proxy = TcpProxy()
    try:
        cluster = SimCluster.start(tmp_path, [SimSpec(role="colocated", step_ms=20.0)], model=default_model_dir,
                                   scheduler_flags=("--heartbeat-ttl", "120"), dial=proxy.start)
        try:
            yield cluster, proxy
        finally:
            cluster.stop()
    finally:
        proxy.stop()


def holds_nothing(cluster: SimCluster, address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stats = worker_pb2_grpc.ColocatedServiceStub(channel).Stats(worker_pb2.WorkerStatsRequest(), timeout=10,
                                                                    metadata=cluster.metadata)
    return stats.running + stats.waiting == 0


def worker_log(cluster: SimCluster) -> str:
    return cluster.children["sim-0"].log_path.read_text(errors="replace")


def run_to_end(cluster: SimCluster, request_id: str, max_tokens: int) -> None:
    """A short request, read by its gateway to its end: OK, with every token."""
    channel, call = submit(cluster, request_id, max_tokens)
    try:
        placement, follower = attached(cluster, call)
        assert follower.tokens_until(placement.attempt_id, max_tokens) == sim_tokens(PROMPT, max_tokens)
        assert end_of(call) is None
        follower.close()
    finally:
        channel.close()


def test_a_final_event_sent_into_a_stream_only_the_worker_saw_break_still_ends_its_request(relayed):
    cluster, proxy = relayed
    channel, call = submit(cluster, "lost-final", LONG)
    try:
        placement, follower = attached(cluster, call)
        assert follower.tokens_until(placement.attempt_id, 3)[:3] == sim_tokens(PROMPT, 3)
        assert proxy.silence() >= 1  # the worker's connection to the scheduler goes silent both ways
        follower.close()  # the worker aborts the request (nobody reads it) and reports it into the silence
        wait_until(lambda: holds_nothing(cluster, placement.generator_address), "the worker dropping it")
        proxy.reset_clients()  # the worker sees its stream break; the scheduler still holds it

        error = end_of(call)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "lost-final" in error.details()
        stats = cluster.scheduler_stats()
        assert (stats.failed, stats.completed, stats.running) == (1, 0, 0)
    finally:
        call.cancel()
        channel.close()


def test_a_final_event_whose_ack_was_lost_is_resent_and_counted_once(relayed):
    cluster, proxy = relayed
    channel, call = submit(cluster, "lost-ack", LONG)
    try:
        placement, follower = attached(cluster, call)
        assert follower.tokens_until(placement.attempt_id, 3)[:3] == sim_tokens(PROMPT, 3)
        assert proxy.silence(to_upstream=False) >= 1  # the scheduler hears the worker; the worker, nothing
        follower.close()
        error = end_of(call)  # the final event arrived; its ack is lost in the silence
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        proxy.reset_clients()
        wait_until(lambda: RESENT in worker_log(cluster), "the worker resending the unacknowledged final event")
        run_to_end(cluster, "after-resend", 5)  # reported after the resend, on the same stream

        stats = cluster.scheduler_stats()
        assert (stats.failed, stats.completed, stats.running) == (1, 1, 0)
    finally:
        call.cancel()
        channel.close()
