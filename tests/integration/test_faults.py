"""Faults on a real mesh. Frozen workers (SIGSTOP): no request hangs. A request sent while a decode
worker is frozen, or whose prefill or decode worker freezes under it (before, during its prefill,
with its KV on the way to a frozen decode worker, or mid-stream), gets an answer (its tokens, or a
status) from the mesh while the worker is still frozen, long before the client's own deadline (the
heartbeat TTL finds the worker; the wait is bounded, not timed: a loaded machine only adds time),
and once the worker is thawed (SIGCONT) the mesh serves the next request with exactly the tokens it
gave before the freeze, and leaves nothing behind.
Full decode memory: requests wait in the queue for room, none is refused. Last, the scheduler is
killed (SIGKILL) under load: every request in flight ends with UNAVAILABLE or its whole reference,
`tandem up` restarts it, the workers register again and new requests are token-exact.

One mesh for the module: 1 prefill and 2 decode workers of 40 MiB KV each, a 4 s heartbeat TTL,
migration off (TANDEM_MIGRATION=0), so a worker lost under a started request fails it with
UNAVAILABLE (tests/integration/test_migration.py moves it instead).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import grpc
import pytest

from tandem.v1 import common_pb2, gateway_pb2
from tests.mesh import Endpoint, Mesh, collect, greedy_request
from tests.e2e.api import prompt_of
from tests.waiting import DEADLINE_S, wait_until

API_KEY = "faults-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
TTL_S = 4.0
FRESH_HEARTBEAT_MS = 150.0  # a worker is frozen only this soon after a heartbeat: it stays routable ~TTL_S
ANSWER_S = DEADLINE_S  # the bound on a request's answer once a worker it needs froze (found within the TTL)
CLIENT_TIMEOUT_S = 120  # far beyond ANSWER_S: the answer must not be the client's own deadline
ENV = {"TANDEM_API_KEYS": API_KEY, "TANDEM_KV_MEMORY": "40MiB", "TANDEM_THREADS": "1",
       "TANDEM_HEARTBEAT_TTL": str(TTL_S), "TANDEM_MIGRATION": "0"}
MAX_TOKENS = 6
BLOCK = 16
# 51 of a decode worker's 56 blocks, about 37 MiB of KV: more than loopback buffers hold (a push to a
# frozen decode worker stalls mid-transfer); one prompt per test, so no prefix-cache hit shortens the
# second one's prefill.
LONG_PROMPTS = {"decode": prompt_of(800, 5), "prefill": prompt_of(800, 6)}
# The bound on a silence in an in-flight request's stream once the scheduler is killed: a request the
# kill left hanging goes silent until its client deadline, while one that streams on from its worker
# gives a token about every second even at load 14 (whose 47 tokens, four requests at once, took 42 s).
SCHEDULER_LOSS_SILENCE_S = 30.0


PROMPT = prompt_of(24, 0)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir) -> Iterator[Mesh]:
    started = Mesh.start("--prefill", "1", "--decode", "2", "--model", str(default_model_dir),
                         env=ENV, run_dir=tmp_path_factory.mktemp("faults"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


@pytest.fixture(scope="module")
def reference(mesh) -> list[int]:
    """The greedy tokens of the probe request on the healthy mesh, before any freeze."""
    tokens, _ = collect(mesh.gateway().Generate(probe("reference"), metadata=AUTH, timeout=CLIENT_TIMEOUT_S))
    assert len(tokens) == MAX_TOKENS
    mesh.wait_idle(DEADLINE_S)
    return tokens


def probe(request_id: str) -> gateway_pb2.GenerateRequest:
    request = greedy_request(PROMPT, MAX_TOKENS, request_id=request_id)
    request.sampling.ignore_eos = True
    return request


def send(mesh: Mesh, pool: ThreadPoolExecutor, request: gateway_pb2.GenerateRequest) -> Future:
    """The request's outcome, in the background: its tokens, or the grpc.RpcError it ended with."""
    def outcome() -> list[int] | grpc.RpcError:
        try:
            return collect(mesh.gateway().Generate(request, metadata=AUTH, timeout=CLIENT_TIMEOUT_S))[0]
        except grpc.RpcError as error:
            return error

    return pool.submit(outcome)


def answer(future: Future, since: float) -> list[int] | grpc.RpcError:
    """The outcome, which must arrive within ANSWER_S of `since` (the freeze, or the request if later)."""
    return future.result(timeout=max(0.0, since + ANSWER_S - time.monotonic()))


@contextmanager
def frozen(mesh: Mesh, *workers: Endpoint) -> Iterator[float]:
    """SIGSTOP the workers (yields when), SIGCONT them on leaving, whatever happened.

    Each is stopped just after the scheduler heard its heartbeat, so it stays registered for nearly a
    whole TTL: a request sent next is routed to it even when a loaded machine slows the request down."""
    for worker in workers:
        wait_until(lambda: heartbeat_age_ms(mesh, worker) < FRESH_HEARTBEAT_MS, f"a heartbeat from {worker.name}")
        os.kill(worker.pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        for worker in workers:
            os.kill(worker.pid, signal.SIGCONT)


def heartbeat_age_ms(mesh: Mesh, endpoint: Endpoint) -> float:
    return next(w.heartbeat_age_ms for w in mesh.scheduler_stats().workers if w.info.address == endpoint.address)


def workers(mesh: Mesh, role: int) -> list[Endpoint]:
    return [worker(mesh, w.info.worker_id) for w in mesh.scheduler_stats().workers if w.info.role == role]


def worker(mesh: Mesh, worker_id: str) -> Endpoint:
    address = next(w.info.address for w in mesh.scheduler_stats().workers if w.info.worker_id == worker_id)
    return next(ep for ep in mesh.endpoints if ep.kind == "grpc" and ep.address == address)


def first_ranked_decode(mesh: Mesh) -> str:
    """The decode worker an idle mesh routes to first: the most free blocks, then the lowest id; read once
    the scheduler's view of every decode worker's blocks is the worker's own (a heartbeat came after the
    last request ended), so the next heartbeats leave the ranking as it is."""
    def settled() -> list | None:
        decode = [w for w in mesh.scheduler_stats().workers if w.info.role == common_pb2.WORKER_ROLE_DECODE]
        own = [mesh.worker_stats(worker(mesh, w.info.worker_id).name) for w in decode]
        agree = all((w.load.free_blocks, w.load.cached_blocks) == (s.free_blocks + s.cached_blocks, s.cached_blocks)
                    for w, s in zip(decode, own))  # a load report counts cached blocks as free: they can be evicted
        return decode if agree else None

    decode = wait_until(settled, "the scheduler's view of the decode workers' blocks to catch up with them")
    return min(decode, key=lambda w: (-w.load.free_blocks, w.info.worker_id)).info.worker_id


def route_of(mesh: Mesh, request_id: str):
    return next(r for r in mesh.scheduler_stats().recent_routes if r.request_id == request_id)


def routed_to(mesh: Mesh, request_id: str) -> str:
    """The decode worker holding the request's reserved blocks; "" before it is routed."""
    return next((r.decode_worker_id for r in mesh.scheduler_stats().recent_routes if r.request_id == request_id), "")


def serves_again(mesh: Mesh, reference: list[int], request_id: str) -> None:
    """Once every worker is registered again, the probe gets its reference tokens and the mesh goes idle."""
    wait_until(lambda: len(mesh.scheduler_stats().workers) == 3, "the thawed workers to register again")
    tokens, _ = collect(mesh.gateway().Generate(probe(request_id), metadata=AUTH, timeout=CLIENT_TIMEOUT_S))
    assert tokens == reference
    mesh.wait_idle(DEADLINE_S)


def assert_unavailable(outcome: list[int] | grpc.RpcError, request_id: str) -> None:
    assert isinstance(outcome, grpc.RpcError), f"expected UNAVAILABLE, got tokens {outcome}"
    assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome
    assert request_id in outcome.details() and "127.0.0.1" not in outcome.details()


def test_a_request_sent_while_its_decode_worker_is_frozen_moves_on_to_the_other(mesh, pool, reference):
    first = first_ranked_decode(mesh)
    with frozen(mesh, worker(mesh, first)) as since:
        outcome = answer(send(mesh, pool, probe("during-decode-freeze")), since)
    assert outcome == reference
    route = route_of(mesh, "during-decode-freeze")
    assert route.decode_scores[0].worker_id == first and route.decode_worker_id != first
    serves_again(mesh, reference, "after-decode-freeze")


def test_a_request_sent_while_every_decode_worker_is_frozen_is_unavailable(mesh, pool, reference):
    decode = workers(mesh, common_pb2.WORKER_ROLE_DECODE)
    assert len(decode) == 2
    with frozen(mesh, *decode) as since:
        outcome = answer(send(mesh, pool, probe("during-full-freeze")), since)
    assert_unavailable(outcome, "during-full-freeze")
    serves_again(mesh, reference, "after-full-freeze")


def test_a_request_whose_prefill_worker_freezes_is_unavailable(mesh, pool, reference):
    (prefill,) = workers(mesh, common_pb2.WORKER_ROLE_PREFILL)
    with frozen(mesh, prefill) as since:
        outcome = answer(send(mesh, pool, probe("during-prefill-freeze")), since)
    assert_unavailable(outcome, "during-prefill-freeze")
    serves_again(mesh, reference, "after-prefill-freeze")


def test_a_request_whose_decode_worker_freezes_mid_stream_is_unavailable(mesh, reference):
    request = greedy_request(PROMPT[:20], 400, request_id="mid-stream")
    request.sampling.ignore_eos = True
    call = mesh.gateway().Generate(request, metadata=AUTH, timeout=CLIENT_TIMEOUT_S)
    next(call)
    next(call)  # a token from the decode worker
    with frozen(mesh, worker(mesh, route_of(mesh, "mid-stream").decode_worker_id)) as since:
        with pytest.raises(grpc.RpcError) as error:
            for _ in call:
                pass
        answered_at = time.monotonic()
    assert answered_at < since + ANSWER_S, f"no status within {ANSWER_S:g} s of the freeze"
    assert_unavailable(error.value, "mid-stream")
    serves_again(mesh, reference, "after-mid-stream-freeze")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_request_whose_worker_freezes_during_its_prefill_and_kv_transfer_is_unavailable(mesh, pool, reference,
                                                                                         role):
    """The request is sent to a frozen prefill worker, so it stops at its prefill with its blocks reserved
    on the decode worker (whatever the machine's load, it cannot finish before the test looks). Then
    either the prefill worker stays frozen (mid-prefill, before its push), or the decode worker is
    frozen and the prefill worker thawed (its push then stalls on the decode worker mid-transfer)."""
    (prefill,) = workers(mesh, common_pb2.WORKER_ROLE_PREFILL)
    request_id = f"kv-stage-{role}-freeze"
    request = greedy_request(LONG_PROMPTS[role], MAX_TOKENS, request_id=request_id)
    request.sampling.ignore_eos = True
    with ExitStack() as stopped:
        since = stopped.enter_context(frozen(mesh, prefill))
        outcome = send(mesh, pool, request)
        routed = wait_until(lambda: routed_to(mesh, request_id) or outcome.done(), "the request to be routed")
        assert not outcome.done(), f"the request ended before its KV transfer: {outcome.result()}"
        decode = worker(mesh, routed)  # routed: its blocks are reserved there (a route is recorded after that)
        if role == "decode":
            since = stopped.enter_context(frozen(mesh, decode))
            os.kill(prefill.pid, signal.SIGCONT)
        ended = answer(outcome, since)
    assert_unavailable(ended, request_id)
    serves_again(mesh, reference, f"after-kv-stage-{role}-freeze")


def long_request(prompt: list[int], request_id: str) -> gateway_pb2.GenerateRequest:
    request = greedy_request(prompt, 16, request_id=request_id)
    request.sampling.ignore_eos = True
    return request


def test_requests_beyond_the_decode_memory_wait_for_room_and_none_is_refused(mesh, reference):
    prompts = [prompt_of(150, seed) for seed in (11, 12, 13)]
    decode_blocks = sum(w.info.num_blocks for w in mesh.scheduler_stats().workers
                        if w.info.role == common_pb2.WORKER_ROLE_DECODE)
    assert 21 * -(-151 // BLOCK) > decode_blocks  # their prompts alone overflow the decode workers
    references = [collect(mesh.gateway().Generate(long_request(p, f"crowd-ref-{n}"), metadata=AUTH,
                                                  timeout=CLIENT_TIMEOUT_S))[0] for n, p in enumerate(prompts)]
    rejected = mesh.scheduler_stats().rejected

    def outcome(i: int) -> list[int] | str:
        try:
            call = mesh.gateway().Generate(long_request(prompts[i % 3], f"crowd-{i}"), metadata=AUTH,
                                           timeout=CLIENT_TIMEOUT_S)
            return collect(call)[0]
        except grpc.RpcError as error:
            return error.code().name

    with ThreadPoolExecutor(21) as crowd:
        outcomes = list(crowd.map(outcome, range(21)))
    assert outcomes == [references[i % 3] for i in range(21)]
    assert mesh.scheduler_stats().rejected == rejected
    mesh.wait_idle(DEADLINE_S)


def test_a_scheduler_killed_under_load_ends_every_request_restarts_and_serves_token_exact(mesh, reference):
    """Runs last: the restarted scheduler forgets the routes and counters the tests above read."""
    scheduler = mesh.endpoint("scheduler")
    prompts = [prompt_of(30, seed) for seed in (21, 22, 23, 24)]

    def request(n: int, request_id: str) -> gateway_pb2.GenerateRequest:
        longer = greedy_request(prompts[n], 48, request_id=request_id)
        longer.sampling.ignore_eos = True
        return longer

    references = [collect(mesh.gateway().Generate(request(n, f"sched-ref-{n}"), metadata=AUTH,
                                                  timeout=CLIENT_TIMEOUT_S))[0] for n in range(len(prompts))]
    calls = [mesh.gateway().Generate(request(n, f"sched-load-{n}"), metadata=AUTH, timeout=CLIENT_TIMEOUT_S)
             for n in range(len(prompts))]
    firsts = [list(next(call).token_ids) for call in calls]  # all four are generating

    heard = [0.0] * len(calls)  # when each call last gave a message (or the kill)

    def rest(n: int) -> list[int] | grpc.RpcError:
        tokens: list[int] = []
        try:
            for message in calls[n]:
                heard[n] = time.monotonic()
                tokens += message.token_ids
            return tokens
        except grpc.RpcError as error:
            return error

    since = len(mesh.log)
    os.kill(scheduler.pid, signal.SIGKILL)
    heard[:] = [time.monotonic()] * len(calls)
    with ThreadPoolExecutor(len(calls)) as readers:  # every stream read as it comes: a silence is the call's own
        outcomes = [readers.submit(rest, n) for n in range(len(calls))]
        for n in range(len(calls)):
            wait_until(lambda: outcomes[n].done() or time.monotonic() - heard[n] > SCHEDULER_LOSS_SILENCE_S,
                       f"request {n} to end", timeout=CLIENT_TIMEOUT_S)
            assert outcomes[n].done(), f"request {n} silent for {SCHEDULER_LOSS_SILENCE_S} s after the kill"
    for n, (first, outcome) in enumerate(zip(firsts, outcomes)):
        ended = outcome.result()
        if isinstance(ended, grpc.RpcError):
            assert ended.code() == grpc.StatusCode.UNAVAILABLE and ended.details(), ended
        else:
            assert first + ended == references[n], f"request {n} finished with other tokens than its reference"
    restarted = wait_until(lambda: next((line for line in mesh.log[since:]
                                         if line.startswith("tandem up: scheduler is ready again")), None),
                           "tandem up to restart the scheduler", timeout=CLIENT_TIMEOUT_S)
    scheduler.pid = int(restarted.rsplit("pid ", 1)[1].rstrip(")\n"))
    tries = itertools.count()

    def served() -> list[int] | None:
        """A new request's tokens; None while the workers find the new scheduler (a clear UNAVAILABLE)."""
        try:
            return collect(mesh.gateway().Generate(request(0, f"sched-after-{next(tries)}"), metadata=AUTH,
                                                   timeout=CLIENT_TIMEOUT_S))[0]
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE and error.details(), error
            return None

    assert wait_until(served, "a new request to be served after the restart", timeout=CLIENT_TIMEOUT_S,
                      poll=0.2) == references[0]
    serves_again(mesh, reference, "after-scheduler-kill")
