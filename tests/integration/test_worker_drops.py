"""A worker that drops a request on its own tells the scheduler, so the request ends at once with a
status instead of waiting out its deadline. Real processes on loopback: a scheduler and a colocated
sim worker (`tandem sim-worker`, slow steps, so a long request is still running when the fault
comes), or a prefill and a decode sim worker with a slow prefill; the test plays the gateway (the scheduler's Submit call, the worker's Follow call) and
injects the fault as a gateway's broken connection would: its Follow call to the worker ends while
the Submit call stays open. The Submit deadline is far beyond the wait for the answer: a request
that ends by its deadline ends DEADLINE_EXCEEDED, which the tests refuse."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.sim_cluster import SimCluster, SimSpec, sim_tokens
from tests.waiting import wait_until

SUBMIT_DEADLINE_S = 120  # far beyond any answer the tests wait for: reaching it is the defect
PROMPT = list(range(300, 340))
LONG = 4000  # tokens: 80 s at the sim worker's 20 ms a step, longer than the waits below


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[SimCluster]:
    spec = SimSpec(role="colocated", step_ms=20.0, kv_blocks=1024)
    started = SimCluster.start(tmp_path_factory.mktemp("drops"), [spec], model=default_model_dir)
    try:
        yield started
    finally:
        started.stop()


def submit(cluster: SimCluster, request_id: str, max_tokens: int):
    """The scheduler's Submit call for a greedy request, as a gateway opens it."""
    channel = grpc.insecure_channel(cluster.scheduler)
    request = scheduler_pb2.SubmitRequest(request_id=request_id, token_ids=PROMPT,
                                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                             ignore_eos=True))
    call = scheduler_pb2_grpc.SchedulerServiceStub(channel).Submit(request, metadata=cluster.metadata,
                                                                   timeout=SUBMIT_DEADLINE_S)
    return channel, call


class Follower:
    """A gateway's Follow call to one worker: attach requests, read its batches, cancel it."""

    def __init__(self, cluster: SimCluster, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._controls: queue.Queue[worker_pb2.FollowControl | None] = queue.Queue()
        self.call = worker_pb2_grpc.TokenStreamServiceStub(self._channel).Follow(
            iter(self._controls.get, None), metadata=cluster.metadata, timeout=SUBMIT_DEADLINE_S)

    def attach(self, request_id: str) -> None:
        self._controls.put(worker_pb2.FollowControl(attach=worker_pb2.StreamRequest(request_id=request_id)))

    def tokens_until(self, request_id: str, count: int) -> list[int]:
        """The request's tokens from the call's batches, once at least `count` came."""
        tokens: list[int] = []
        while len(tokens) < count:
            batch = next(self.call)
            tokens += [t for e in batch.events if e.request_id == request_id for t in e.token_ids]
        return tokens

    def close(self) -> None:
        self._controls.put(None)
        self.call.cancel()
        self._channel.close()


def placement_of(call) -> scheduler_pb2.Placement:
    event = next(call)
    assert event.HasField("placement"), event
    return event.placement


def attached(cluster: SimCluster, call) -> tuple[scheduler_pb2.Placement, Follower]:
    """The request's placement (the Submit call's first event), and a Follower attached to its attempt
    on the worker that generates it (the gateway's part)."""
    placement = placement_of(call)
    follower = Follower(cluster, placement.generator_address)
    follower.attach(placement.attempt_id)
    return placement, follower


def end_of(call) -> grpc.RpcError | None:
    """How the Submit call ended: None when OK (every event read), else its error."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as error:
        return error
    return None


def test_a_request_whose_token_reader_leaves_the_worker_ends_unavailable_not_at_its_deadline(cluster):
    channel, call = submit(cluster, "reader-gone", LONG)
    try:
        placement, follower = attached(cluster, call)
        assert follower.tokens_until(placement.attempt_id, 3)[:3] == sim_tokens(PROMPT, 3)
        follower.close()  # the worker aborts the request: nobody reads its tokens any more

        error = end_of(call)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "reader-gone" in error.details()
    finally:
        call.cancel()
        channel.close()


def test_after_a_dropped_request_the_worker_serves_the_next_one_to_its_end(cluster):
    channel, call = submit(cluster, "after-drop", 5)
    try:
        placement, follower = attached(cluster, call)
        assert follower.tokens_until(placement.attempt_id, 5) == sim_tokens(PROMPT, 5)
        assert end_of(call) is None
        follower.close()
    finally:
        channel.close()


def test_a_request_whose_prefill_workers_reader_leaves_mid_prefill_ends_unavailable_not_at_its_deadline(
        tmp_path: Path, default_model_dir: Path) -> None:
    # A 40-token prompt at 4 tokens/s: its prefill takes 10 s, time enough to leave in the middle.
    specs = [SimSpec(role="prefill", step_ms=2.0, prefill_tokens_per_s=4.0), SimSpec(role="decode", step_ms=2.0)]
    disaggregated = SimCluster.start(tmp_path, specs, model=default_model_dir)
    channel, call = submit(disaggregated, "prefill-reader-gone", 5)
    try:
        placement = placement_of(call)
        assert placement.prefill_address and placement.prefill_address != placement.generator_address
        decode = Follower(disaggregated, placement.generator_address)
        decode.attach(placement.attempt_id)
        prefill = Follower(disaggregated, placement.prefill_address)
        prefill.attach(placement.attempt_id)
        wait_until(lambda: prefilling(disaggregated, placement.prefill_address), "the prefill worker holding it")
        prefill.close()  # the prefill worker aborts the request mid-prefill: nobody reads its token 0

        error = end_of(call)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "prefill-reader-gone" in error.details()
        decode.close()
    finally:
        call.cancel()
        channel.close()
        disaggregated.stop()


def prefilling(cluster: SimCluster, address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stats = worker_pb2_grpc.PrefillServiceStub(channel).Stats(worker_pb2.WorkerStatsRequest(), timeout=10,
                                                                  metadata=cluster.metadata)
    return stats.running + stats.waiting > 0
