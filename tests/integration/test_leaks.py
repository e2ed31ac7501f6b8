"""Nothing left behind on a real mesh (`tandem up`, an external redis-server, 1 prefill + 2 decode).

Two rounds of 500 mixed requests (greedy, seeded sampling, stop strings, cancelled mid-stream,
deadlines too short to finish), a decode worker SIGKILLed during the first: afterwards every
worker's blocks are free or cached, the scheduler holds no request, Redis holds only worker and
prefix-index keys, no decode worker still maps a KV segment of the same-host path while the prefill
worker keeps only its pool's idle ones, and no service's memory grows over the second round. Then Redis is stopped for
30 s while requests keep coming: every one is served token-exact from the scheduler's last known
state, and the scheduler leaves its degraded mode once Redis is back.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from services.runtime.kv_shm import MAX_IDLE_SEGMENTS, SEGMENT_NAME
from tests.mesh import Mesh, collect, greedy_request
from tandem.v1 import common_pb2, gateway_pb2
from tests.redis_fixture import RedisServer
from tests.waiting import DEADLINE_S, wait_until

pytestmark = pytest.mark.slow

ENV = {"TANDEM_KV_MEMORY": "64MiB", "TANDEM_THREADS": "1", "TANDEM_HEARTBEAT_TTL": "3"}
ROUND = 500
CONCURRENCY = 6
ANSWERS = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE"}  # never INTERNAL or UNKNOWN
RSS_GROWTH_LIMIT_MIB = 48  # over a whole second round, per service
REDIS_OUTAGE_S = 30
KEY = re.compile(r"^tandem:(workers|worker:.+|blocks:.+|block:.+)$")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("leak-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, default_model_dir, redis_server: RedisServer) -> Iterator[Mesh]:
    started = Mesh.start("--prefill", "1", "--decode", "2", "--model", str(default_model_dir),
                         "--redis-url", redis_server.url, env=ENV, run_dir=tmp_path_factory.mktemp("leak-mesh"))
    yield started
    started.stop()


def prompt_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(rng.randrange(4, 40))]


def mixed_request(mesh: Mesh, i: int) -> str:
    """One request of a kind chosen by its index; returns its outcome (a status name)."""
    rng = random.Random(i)
    kind = i % 5
    if kind == 3:  # stop strings on a text prompt
        request = gateway_pb2.GenerateRequest(prompt=f"Count: {i}, ", sampling=common_pb2.SamplingParams(
            max_tokens=rng.randrange(1, 9), temperature=0.0, stop=[",", " and"]))
    else:
        request = greedy_request(prompt_ids(rng), rng.randrange(1, 9))
        if kind == 1:  # seeded sampling
            request.sampling.temperature, request.sampling.seed = 0.9, i
    timeout = 0.05 + rng.random() * 0.3 if kind == 4 else DEADLINE_S * 4
    call = mesh.gateway().Generate(request, timeout=timeout)
    try:
        for _ in call:
            if kind == 2:  # the client leaves after the first message
                call.cancel()
        return "OK"
    except grpc.RpcError as error:
        return error.code().name


def run_round(mesh: Mesh, start: int, kill_at: int | None = None) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = []
        for i in range(start, start + ROUND):
            if i == kill_at:
                kill_a_busy_decode_worker(mesh)
            futures.append(pool.submit(mixed_request, mesh, i))
        for future in futures:
            outcomes[future.result(timeout=DEADLINE_S * 8)] += 1
    return outcomes


def victim(mesh: Mesh) -> str:
    return mesh.names("decode")[0]


def kill_a_busy_decode_worker(mesh: Mesh) -> None:
    name = victim(mesh)
    wait_until(lambda: mesh.worker_stats(name).running > 0, "a decode worker with running requests")
    os.kill(mesh.endpoint(name).pid, signal.SIGKILL)


def answers(mesh: Mesh, name: str) -> bool:
    try:
        mesh.worker_stats(name)
        return True
    except grpc.RpcError:
        return False


def surviving_pids(mesh: Mesh) -> dict[str, int]:
    """The services that were never killed, by name (a restarted one has a pid the mesh does not know)."""
    return {ep.name: ep.pid for ep in mesh.endpoints
            if ep.kind == "grpc" and ep.pid is not None and ep.name != victim(mesh)}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def assert_nothing_left(mesh: Mesh, redis_server: RedisServer) -> None:
    mesh.wait_idle(DEADLINE_S * 4)
    for name in mesh.names("prefill") + mesh.names("decode"):
        stats = mesh.worker_stats(name)
        assert (stats.referenced_blocks, stats.reserved_blocks) == (0, 0), name
        assert stats.free_blocks + stats.cached_blocks == stats.num_blocks, f"{name}: blocks neither free nor cached"
    keys = [key.decode() for key in redis.Redis.from_url(redis_server.url).keys("*")]
    assert [key for key in keys if not KEY.match(key)] == []
    assert_no_segment_left(mesh)


def assert_no_segment_left(mesh: Mesh) -> None:
    """The same-host KV path leaves nothing: a decode worker maps a sender's segment only during a
    Push, the prefill worker holds its pool's idle segments (at least one: the path was taken), and
    nothing of Tandem's lies in /dev/shm."""
    pids = surviving_pids(mesh)
    for name in mesh.names("decode"):
        if name in pids:
            maps = Path(f"/proc/{pids[name]}/maps").read_text()
            assert f"memfd:{SEGMENT_NAME}" not in maps, f"{name} still maps a KV segment"
    for name in mesh.names("prefill"):
        held = segments_held(pids[name])
        assert 1 <= held <= MAX_IDLE_SEGMENTS, f"{name} holds {held} KV segments"
    assert [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("tandem")] == []


def segments_held(pid: int) -> int:
    """The KV segments a process holds open (its own descriptors and its mappings': count inodes)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith(f"/memfd:{SEGMENT_NAME}"):
                inodes.add(fd.stat().st_ino)
        except OSError:  # closed meanwhile
            continue
    return len(inodes)


def test_a_thousand_mixed_requests_leave_nothing_behind(mesh: Mesh, redis_server: RedisServer):
    first = run_round(mesh, 0, kill_at=ROUND // 2)
    assert set(first) <= ANSWERS, first
    assert first["OK"] >= ROUND // 2, first
    wait_until(lambda: answers(mesh, victim(mesh)), "the killed decode worker restarted", timeout=DEADLINE_S * 6)
    assert_nothing_left(mesh, redis_server)

    survivors = surviving_pids(mesh)
    before = {name: rss_mib(pid) for name, pid in survivors.items()}
    second = run_round(mesh, ROUND)
    assert set(second) <= ANSWERS - {"UNAVAILABLE"}, second  # no worker was lost this time
    assert_nothing_left(mesh, redis_server)
    growth = {name: round(rss_mib(pid) - before[name], 1) for name, pid in survivors.items()}
    assert all(mib < RSS_GROWTH_LIMIT_MIB for mib in growth.values()), growth


def test_redis_down_for_30_s_under_load_serves_every_request(mesh: Mesh, redis_server: RedisServer):
    prompt = [200 + i for i in range(40)]
    expected, _ = collect(mesh.gateway().Generate(greedy_request(prompt, 6), timeout=DEADLINE_S))
    redis_server.stop()
    try:
        wait_until(lambda: mesh.scheduler_stats().degraded, "the scheduler to notice Redis is gone")
        served = 0
        outage_ends = time.monotonic() + REDIS_OUTAGE_S
        while time.monotonic() < outage_ends:
            tokens, _ = collect(mesh.gateway().Generate(greedy_request(prompt, 6), timeout=DEADLINE_S))
            assert tokens == expected
            served += 1
        assert served > 0
    finally:
        redis_server.start()
    wait_until(lambda: not mesh.scheduler_stats().degraded, "the scheduler to leave its degraded mode",
               timeout=DEADLINE_S * 2)
    tokens, _ = collect(mesh.gateway().Generate(greedy_request(prompt, 6), timeout=DEADLINE_S))
    assert tokens == expected
    mesh.wait_idle(DEADLINE_S)
