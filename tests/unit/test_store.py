"""The Store contract, run against EmbeddedStore (fake clock) and RedisStore (a real redis-server).

TTL tests advance the fake clock for the embedded store and really wait for Redis.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import redis.asyncio.connection as redis_connection

from services.common.block_hash import hash_chain
from services.common.redis_store import RedisStore
from services.common.store import (
    EmbeddedStore, Store, StoreUnavailable, WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole, open_store,
)
from tandem.cli.ports import free_port
from tests.redis_fixture import RedisServer, private_redis, redis_server  # noqa: F401 (fixtures)

BLOCK = 4
H = hash_chain(list(range(5 * BLOCK)), BLOCK)  # five chained block hashes h0..h4


def info(worker_id: str, role: WorkerRole = WorkerRole.PREFILL) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{50000 + len(worker_id)}",
                      model="smol", num_blocks=128, block_size=BLOCK, max_model_len=2048,
                      kv_block_bytes=4096, device="cpu")


@dataclass
class Harness:
    store: Store
    advance: Callable[[float], Awaitable[None]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    async def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(params=["embedded", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    if request.param == "embedded":
        clock = FakeClock()
        yield Harness(EmbeddedStore(clock=clock), clock.advance)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    store = RedisStore(server.url, namespace=f"test-{uuid.uuid4().hex[:8]}")
    try:
        yield Harness(store, asyncio.sleep)
    finally:
        await store.close()


async def test_register_and_list_exact_records(harness: Harness) -> None:
    store = harness.store
    load = WorkerLoad(free_blocks=100, cached_blocks=3, running=2, waiting=1, queued_prefill_tokens=40)
    await store.register_worker(info("w2", WorkerRole.DECODE), ttl=30, load=load)
    await store.register_worker(info("w1"), ttl=30)
    assert await store.list_workers() == [
        WorkerRecord(info("w1"), WorkerLoad()),
        WorkerRecord(info("w2", WorkerRole.DECODE), load),
    ]


async def test_heartbeat_updates_load_and_unknown_worker_is_refused(harness: Harness) -> None:
    store = harness.store
    await store.register_worker(info("w1"), ttl=30)
    new_load = WorkerLoad(free_blocks=7, running=5, reserved_blocks=2)
    assert await store.heartbeat("w1", new_load, ttl=30) is True
    assert await store.heartbeat("nobody", new_load, ttl=30) is False
    assert await store.list_workers() == [WorkerRecord(info("w1"), new_load)]


async def test_heartbeats_keep_a_worker_alive_and_a_lapsed_one_leaves(harness: Harness) -> None:
    # Redis keeps wall-clock time: a TTL four times each step leaves 3 s for a loaded machine to stall
    # between a heartbeat and the check that the worker is still listed.
    store, ttl, step = harness.store, 4.0, 1.0
    await store.register_worker(info("w1"), ttl=ttl)
    await store.add_blocks("w1", H[:2])
    await harness.advance(step)
    assert await store.heartbeat("w1", WorkerLoad(running=1), ttl=ttl) is True
    await harness.advance(step)  # 2 s after registering, 1 s after the heartbeat
    assert [r.info.worker_id for r in await store.list_workers()] == ["w1"]
    await harness.advance(ttl + 0.5 - step)  # past the heartbeat's TTL
    assert await store.list_workers() == []
    assert await store.heartbeat("w1", WorkerLoad(), ttl=ttl) is False
    assert await store.match_prefix(H) == {}, "an expired worker's blocks leave the index"


async def test_match_prefix_counts_unbroken_leading_runs(harness: Harness) -> None:
    store = harness.store
    await store.add_blocks("a", H[:3])
    await store.add_blocks("b", [H[0], H[2]])  # lacks h1: only h0 is usable
    await store.add_blocks("c", H[1:3])  # lacks h0: nothing is usable
    assert await store.match_prefix(H) == {"a": 3, "b": 1}
    assert await store.match_prefix(H[:1]) == {"a": 1, "b": 1}
    assert await store.match_prefix(H[1:3]) == {"a": 2, "c": 2}
    assert await store.match_prefix(H[3:]) == {}
    assert await store.match_prefix([]) == {}
    salted = hash_chain(list(range(5 * BLOCK)), BLOCK, salt="tenant-b")
    assert await store.match_prefix(salted) == {}


async def test_remove_blocks_breaks_the_run_at_the_evicted_block(harness: Harness) -> None:
    store = harness.store
    await store.add_blocks("a", H)
    await store.add_blocks("b", H[:2])
    await store.remove_blocks("a", [H[2]])
    assert await store.match_prefix(H) == {"a": 2, "b": 2}
    await store.remove_blocks("b", H[:1])
    await store.remove_blocks("b", [])
    assert await store.match_prefix(H) == {"a": 2}


async def test_update_blocks_applies_reset_then_stored_then_evicted(harness: Harness) -> None:
    store = harness.store
    await store.add_blocks("a", H[:2])
    await store.add_blocks("b", H[:3])
    await store.update_blocks("b", stored=H[3:], evicted=[H[2], H[4]])  # h4 stored and evicted: not cached
    assert await store.match_prefix(H) == {"a": 2, "b": 2}
    await store.update_blocks("a", stored=H[:4], evicted=[H[3]], reset=True)
    assert await store.match_prefix(H) == {"a": 3, "b": 2}
    await store.update_blocks("a", reset=True)  # a whole cache that is empty
    assert await store.match_prefix(H) == {"b": 2}
    await store.update_blocks("b")
    assert await store.match_prefix(H[:1]) == {"b": 1}


async def test_a_report_of_thousands_of_blocks_is_applied_whole(harness: Harness) -> None:
    # The bench fills the index 2,000 blocks a report; Redis applies them in runs of 1,000 arguments.
    store, chain = harness.store, hash_chain(list(range(2_500 * BLOCK)), BLOCK)
    await store.update_blocks("a", stored=chain)
    assert await store.match_prefix(chain) == {"a": 2_500}
    await store.update_blocks("a", evicted=chain[1_199:2_400])
    assert await store.match_prefix(chain) == {"a": 1_199}
    await store.update_blocks("a", reset=True, stored=chain[:3])
    assert await store.match_prefix(chain) == {"a": 3}


async def test_drop_worker_blocks_forgets_only_that_worker(harness: Harness) -> None:
    store = harness.store
    await store.register_worker(info("a"), ttl=30)
    await store.add_blocks("a", H)
    await store.add_blocks("b", H[:2])
    await store.drop_worker_blocks("a")
    assert await store.match_prefix(H) == {"b": 2}
    assert [r.info.worker_id for r in await store.list_workers()] == ["a"], "the registration stays"
    await store.add_blocks("a", H[:1])
    assert await store.match_prefix(H) == {"a": 1, "b": 2}


async def test_reregistering_starts_with_an_empty_index(harness: Harness) -> None:
    store = harness.store
    await store.register_worker(info("a"), ttl=30)
    await store.add_blocks("a", H)
    await store.register_worker(info("a"), ttl=30, load=WorkerLoad(free_blocks=1))
    assert await store.match_prefix(H) == {}
    assert await store.list_workers() == [WorkerRecord(info("a"), WorkerLoad(free_blocks=1))]


async def test_remove_worker_forgets_registration_and_blocks(harness: Harness) -> None:
    store = harness.store
    await store.register_worker(info("a"), ttl=30)
    await store.register_worker(info("b"), ttl=30)
    await store.add_blocks("a", H)
    await store.add_blocks("b", H[:1])
    await store.remove_worker("a")
    await store.remove_worker("never-registered")
    assert [r.info.worker_id for r in await store.list_workers()] == ["b"]
    assert await store.match_prefix(H) == {"b": 1}


async def test_a_claim_has_one_owner_until_its_owner_releases_it(harness: Harness) -> None:
    store = harness.store
    assert await store.claim("copy:chat", "a", ttl=30) is True
    assert [await store.claim("copy:chat", owner, ttl=30) for owner in ("b", "a")] == [False, False]
    assert await store.claim("copy:code", "b", ttl=30) is True, "each key is a claim of its own"
    await store.release("copy:chat", "b")  # not b's: it stays a's
    assert await store.claim("copy:chat", "b", ttl=30) is False
    await store.release("copy:chat", "a")
    assert await store.claim("copy:chat", "b", ttl=30) is True


async def test_of_owners_claiming_at_once_exactly_one_wins(harness: Harness) -> None:
    owners = [f"replica-{i}" for i in range(8)]
    won = await asyncio.gather(*(harness.store.claim("copy:chat", owner, ttl=30) for owner in owners))
    assert sorted(won) == [False] * 7 + [True]


async def test_a_lapsed_claim_may_be_taken_and_its_old_owner_cannot_release_the_new_one(harness: Harness) -> None:
    store, ttl = harness.store, 0.2
    assert await store.claim("copy:chat", "dead", ttl=ttl) is True
    await harness.advance(ttl + 0.1)
    assert await store.claim("copy:chat", "b", ttl=30) is True
    await store.release("copy:chat", "dead")
    assert await store.claim("copy:chat", "c", ttl=30) is False



async def test_redis_replicas_share_state(redis_server: RedisServer) -> None:
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    first, second = RedisStore(redis_server.url, namespace=namespace), RedisStore(redis_server.url, namespace=namespace)
    other = RedisStore(redis_server.url, namespace=namespace + "-other")
    try:
        await first.register_worker(info("a"), ttl=30)
        await first.add_blocks("a", H[:2])
        assert [r.info.worker_id for r in await second.list_workers()] == ["a"]
        assert await second.match_prefix(H) == {"a": 2}
        assert (await other.list_workers(), await other.match_prefix(H)) == ([], {})
        assert (await first.claim("copy:chat", "first", 30), await second.claim("copy:chat", "second", 30)) == (
            True, False)
        assert await other.claim("copy:chat", "other", 30) is True, "claims are namespaced"
    finally:
        for store in (first, second, other):
            await store.close()


async def test_redis_listing_decodes_a_record_again_only_when_it_changed(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url, namespace=f"test-{uuid.uuid4().hex[:8]}")
    try:
        await store.register_worker(info("a"), ttl=30, load=WorkerLoad(free_blocks=5))
        await store.register_worker(info("b"), ttl=30, load=WorkerLoad(free_blocks=6))
        a, b = await store.list_workers()
        assert await store.heartbeat("b", WorkerLoad(free_blocks=7), ttl=30)
        again_a, again_b = await store.list_workers()
        assert again_a is a  # unchanged: the same record, not decoded again
        assert again_b == WorkerRecord(info("b"), WorkerLoad(free_blocks=7))
        await store.remove_worker("a")
        assert await store.list_workers() == [again_b]
    finally:
        await store.close()


async def test_redis_each_call_of_a_routed_request_is_one_round_trip(redis_server: RedisServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A listing, a prefix match and a batch's block report each cost the scheduler one command sent
    # (a Lua script), not one per worker or per block; each reply as the commands it replaced gave.
    store = RedisStore(redis_server.url, namespace=f"test-{uuid.uuid4().hex[:8]}")
    sent: list[int] = []
    send = redis_connection.AbstractConnection.send_packed_command

    async def counted(connection, command, check_health=True):
        sent.append(1)
        return await send(connection, command, check_health)

    try:
        for worker_id in ("a", "b", "c"):
            await store.register_worker(info(worker_id), ttl=30, load=WorkerLoad(free_blocks=len(worker_id)))
        await store.update_blocks("b", stored=H[:1])  # loads each script once
        await store.match_prefix(H)
        await store.list_workers()
        monkeypatch.setattr(redis_connection.AbstractConnection, "send_packed_command", counted)
        calls = {
            "update_blocks": lambda: store.update_blocks("a", stored=H[:3], evicted=[H[2]], reset=True),
            "match_prefix": lambda: store.match_prefix(H),
            "list_workers": store.list_workers,
        }
        results = {}
        for name, call in calls.items():
            sent.clear()
            results[name] = await call()
            assert len(sent) == 1, f"{name} sent {len(sent)} commands"
        assert results["match_prefix"] == {"a": 2, "b": 1}
        assert [r.info.worker_id for r in results["list_workers"]] == ["a", "b", "c"]
    finally:
        await store.close()


async def test_redis_more_concurrent_calls_than_pooled_connections_wait_for_one(redis_server: RedisServer) -> None:
    # 100 workers deregistering at once sent a scheduler 100+ concurrent commands; the pool refused
    # those past its 100th connection ("Too many connections") instead of queueing them.
    store = RedisStore(redis_server.url, namespace=f"test-{uuid.uuid4().hex[:8]}", max_connections=4)
    try:
        await asyncio.gather(*(store.register_worker(info(f"w{i:03d}"), ttl=30) for i in range(40)))
        await asyncio.gather(*(store.add_blocks(f"w{i:03d}", H[:1]) for i in range(40)))
        assert [r.info.worker_id for r in await store.list_workers()] == [f"w{i:03d}" for i in range(40)]
        assert await store.match_prefix(H) == {f"w{i:03d}": 1 for i in range(40)}
        await asyncio.gather(*(store.remove_worker(f"w{i:03d}") for i in range(40)))
        assert (await store.list_workers(), await store.match_prefix(H)) == ([], {})
    finally:
        await store.close()


async def test_redis_down_raises_store_unavailable_and_recovers(private_redis: RedisServer) -> None:
    store = RedisStore(private_redis.url, timeout=10.0)  # a killed Redis refuses at once; a slow one is no outage
    try:
        await store.register_worker(info("a"), ttl=30)
        await asyncio.gather(*(store.list_workers() for _ in range(4)))  # four pooled connections
        private_redis.stop()
        calls = [
            store.ping(), store.list_workers(), store.heartbeat("a", WorkerLoad(), 30),
            store.register_worker(info("b"), 30), store.remove_worker("a"), store.add_blocks("a", H),
            store.remove_blocks("a", H), store.update_blocks("a", H, reset=True), store.match_prefix(H),
            store.drop_worker_blocks("a"),
            store.claim("copy:chat", "a", 30), store.release("copy:chat", "a"),
        ]
        for call in calls:
            with pytest.raises(StoreUnavailable, match=f"redis at {private_redis.url} unavailable"):
                await call
        private_redis.start()
        # each connection the restart closed tries once more, on a fresh one: no call after it fails
        assert await asyncio.gather(*(store.list_workers() for _ in range(4))) == [[]] * 4
        await store.register_worker(info("b"), ttl=30)
        assert [r.info.worker_id for r in await store.list_workers()] == ["b"], "a restarted Redis starts empty"
    finally:
        await store.close()


async def test_open_store_picks_the_implementation() -> None:
    assert isinstance(open_store(None), EmbeddedStore)
    assert isinstance(open_store(""), EmbeddedStore)
    store = open_store(f"redis://127.0.0.1:{free_port()}/0")
    assert isinstance(store, RedisStore) and store.name == "redis"
    with pytest.raises(StoreUnavailable):
        await store.ping()
    await store.close()
