"""The worker registry: TTL heartbeats (fake clock), dropped workers, and the degraded mode when
the store raises StoreUnavailable: last known workers, no prefix hits, recovery, refill; a worker id
held by a live worker refuses a registration with other info."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from services.common.block_hash import hash_chain
from services.common.errors import FailedPrecondition
from services.common.store import WorkerInfo, WorkerLoad, WorkerRecord, WorkerRole
from services.scheduler.registry import STORE_RETRY_S, WorkerRegistry
from tests.clock import FakeClock
from tests.flaky_store import FlakyStore

TTL = 5.0
BLOCK = 4


def info(worker_id: str, role: WorkerRole = WorkerRole.PREFILL) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{5000 + len(worker_id)}", model="smol",
                      num_blocks=64, block_size=BLOCK)


def setup() -> tuple[FakeClock, FlakyStore, WorkerRegistry]:
    clock = FakeClock()
    store = FlakyStore(clock)
    return clock, store, WorkerRegistry(store, TTL, clock)


async def ids(registry: WorkerRegistry) -> list[str]:
    return [r.info.worker_id for r in await registry.live_workers()]


async def test_a_worker_whose_heartbeat_lapses_leaves_and_must_register_again() -> None:
    clock, _, registry = setup()
    await registry.register(info("p-0"), WorkerLoad())
    await registry.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    clock.now += 4.0
    assert await registry.heartbeat("d-0", WorkerLoad(free_blocks=7))
    clock.now += 2.0  # p-0: 6 s since its registration, d-0: 2 s since its heartbeat
    records = await registry.live_workers()
    assert [(r.info.worker_id, r.load.free_blocks) for r in records] == [("d-0", 7)]
    assert await registry.heartbeat("p-0", WorkerLoad()) is False
    assert registry.heartbeat_age("d-0") == 2.0 and registry.heartbeat_age("p-0") is None


async def test_a_dropped_worker_is_not_routed_to_until_it_registers_again() -> None:
    _, _, registry = setup()
    await registry.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    registry.forget("d-0")
    await registry.unregister("d-0")
    assert await ids(registry) == []
    assert await registry.heartbeat("d-0", WorkerLoad()) is False
    await registry.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    assert await ids(registry) == ["d-0"]


async def test_store_down_keeps_the_last_known_workers_without_prefix_hits_then_recovers() -> None:
    clock, store, registry = setup()
    await registry.register(info("p-0"), WorkerLoad())
    await registry.register(info("p-1"), WorkerLoad())
    chain = hash_chain(list(range(3 * BLOCK)), BLOCK)
    await registry.report_blocks("p-1", chain, [])
    assert await registry.match_prefix(chain) == {"p-1": 3} and not registry.degraded

    store.down = True
    assert await ids(registry) == ["p-0", "p-1"] and registry.degraded
    assert await registry.match_prefix(chain) == {}
    clock.now += 3.0
    assert await registry.heartbeat("p-1", WorkerLoad(running=2)) is True  # known from the local mirror
    await registry.register(info("p-2"), WorkerLoad())  # joins while the store is down
    clock.now += 2.0  # p-0 never heartbeated: lapsed here too
    records = await registry.live_workers()
    assert [(r.info.worker_id, r.load.running) for r in records] == [("p-1", 2), ("p-2", 0)]

    store.down = False
    assert await registry.match_prefix(chain) == {}  # the store is left alone for a while after a failure
    clock.now += STORE_RETRY_S
    assert await registry.match_prefix(chain) == {"p-1": 3} and not registry.degraded
    # p-2 registered during the outage: the store never heard of it, its next heartbeat fills it in.
    assert await registry.heartbeat("p-2", WorkerLoad()) is True
    assert [r.info.worker_id for r in await store.list_workers()] == ["p-2"]
    assert await ids(registry) == ["p-1", "p-2"]


async def test_a_store_that_comes_back_empty_is_refilled_without_reregistration() -> None:
    clock, _, registry = setup()
    await registry.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    registry.store = FlakyStore(clock)  # Redis restarted with no data
    assert await registry.heartbeat("d-0", WorkerLoad(free_blocks=9)) is True
    records = await registry.store.list_workers()
    assert [(r.info.worker_id, r.load.free_blocks) for r in records] == [("d-0", 9)]


async def test_a_restarted_scheduler_adopts_the_stores_workers_at_their_heartbeats_and_keeps_them_through_an_outage():
    clock, store, before = setup()
    await before.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    await before.register(info("p-0"), WorkerLoad())
    registry = WorkerRegistry(store, TTL, clock)  # the scheduler restarted; the store kept its workers
    assert await ids(registry) == ["d-0", "p-0"]
    assert await registry.heartbeat("d-0", WorkerLoad(free_blocks=7)) is True  # known: no re-registration
    assert registry.last_seen("d-0") == clock.now and registry.last_seen("p-0") is None

    store.down = True
    records = await registry.live_workers()  # p-0 never heartbeated here: only the store knew it
    assert [(r.info.worker_id, r.info.role, r.load.free_blocks) for r in records] == [("d-0", WorkerRole.DECODE, 7)]


async def test_a_listed_worker_whose_store_entry_lapsed_while_the_scheduler_restarted_is_not_sent_away():
    clock, store, before = setup()
    await before.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    registry = WorkerRegistry(store, TTL, clock)  # restarted; routes to d-0 from the store's listing
    assert await ids(registry) == ["d-0"]
    await store.remove_worker("d-0")  # its entry lapsed before its heartbeat reached the new scheduler
    assert await registry.heartbeat("d-0", WorkerLoad(free_blocks=3)) is True  # not told to register again
    assert [(r.info.worker_id, r.load.free_blocks) for r in await store.list_workers()] == [("d-0", 3)]
    assert await registry.heartbeat("x-9", WorkerLoad()) is False  # one never listed must register


async def test_a_registration_under_a_live_workers_id_with_other_info_is_refused_and_changes_nothing() -> None:
    clock, store, registry = setup()
    real = info("d-0", WorkerRole.DECODE)
    await registry.register(real, WorkerLoad(free_blocks=5))
    impostor = dataclasses.replace(real, model="impostor")
    with pytest.raises(FailedPrecondition) as refused:
        await registry.register(impostor, WorkerLoad())
    assert str(refused.value) == (
        f"worker id 'd-0' belongs to a live decode worker at {real.address} serving 'smol'; give this worker "
        "another id, or stop that one and register again once its heartbeat lapses (5 s)")
    assert [(r.info, r.load.free_blocks) for r in await registry.live_workers()] == [(real, 5)]
    assert [r.info for r in await store.list_workers()] == [real]

    registry2 = WorkerRegistry(store, TTL, clock)  # a restarted scheduler asks the store
    with pytest.raises(FailedPrecondition):
        await registry2.register(dataclasses.replace(real, address="127.0.0.1:1"), WorkerLoad())


async def test_the_same_worker_may_register_again_while_live_and_another_once_the_id_is_free() -> None:
    clock, store, registry = setup()
    real = info("d-0", WorkerRole.DECODE)
    await registry.register(real, WorkerLoad(free_blocks=5))
    await registry.register(real, WorkerLoad(free_blocks=9))  # it restarted on its address
    assert [r.load.free_blocks for r in await registry.live_workers()] == [9]
    await WorkerRegistry(store, TTL, clock).register(real, WorkerLoad())  # after a scheduler restart

    moved = dataclasses.replace(real, address="127.0.0.1:7")
    clock.now += TTL  # its heartbeat lapsed: the id is free
    await registry.register(moved, WorkerLoad())
    registry.forget("d-0")  # lost or deregistered: free as well
    await registry.register(real, WorkerLoad())
    assert [r.info for r in await registry.live_workers()] == [real]


async def test_a_reused_listing_misses_other_schedulers_news_but_never_its_own() -> None:
    clock = FakeClock()
    store = FlakyStore(clock)
    registry = WorkerRegistry(store, TTL, clock, listing_reuse_s=3600.0)  # a listing serves every call here
    await registry.register(info("p-0"), WorkerLoad())
    assert await ids(registry) == ["p-0"]
    await store.register_worker(info("p-1"), TTL, WorkerLoad())  # another scheduler's worker
    assert await registry.heartbeat("p-0", WorkerLoad(free_blocks=9))
    records = await registry.live_workers()
    assert [(r.info.worker_id, r.load.free_blocks) for r in records] == [("p-0", 9)]  # its own heartbeat counts
    await registry.register(info("d-0", WorkerRole.DECODE), WorkerLoad())  # a registration lists the store again
    assert await ids(registry) == ["d-0", "p-0", "p-1"]
    registry.forget("p-1")
    assert await ids(registry) == ["d-0", "p-0"]
    assert await ids(WorkerRegistry(store, TTL, clock)) == ["d-0", "p-0", "p-1"]  # no reuse: every call lists



async def test_a_reused_listing_answers_with_the_latest_heartbeats_and_drops_until_a_worker_lapses() -> None:
    clock = FakeClock()
    store = FlakyStore(clock)
    registry = WorkerRegistry(store, TTL, clock, listing_reuse_s=3600.0)
    for worker_id in ("p-0", "p-1", "p-2"):
        await registry.register(info(worker_id), WorkerLoad())
    assert await ids(registry) == ["p-0", "p-1", "p-2"]
    clock.now += TTL - 1
    assert await registry.heartbeat("p-1", WorkerLoad(free_blocks=3))
    assert await registry.heartbeat("p-2", WorkerLoad(free_blocks=5))
    registry.forget("p-2")
    records = await registry.live_workers()
    assert [(r.info.worker_id, r.load.free_blocks) for r in records] == [("p-0", 0), ("p-1", 3)]
    clock.now += 1  # p-0 lapsed here; the reused listing still names it, until the store is listed again
    await registry.register(info("d-0", WorkerRole.DECODE), WorkerLoad())
    assert await ids(registry) == ["d-0", "p-1"]


class HeldListings(FlakyStore):
    """A store whose listings each read the workers at once, then wait until the test releases them."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.held: list[asyncio.Event] = []
        self.hold = False

    async def list_workers(self) -> list[WorkerRecord]:
        listed = await super().list_workers()
        if self.hold:
            release = asyncio.Event()
            self.held.append(release)
            await release.wait()
        return listed


async def until(condition: Callable[[], bool], passes: int = 100) -> None:
    """Let the event loop run until `condition` holds; fails after `passes` passes of the loop."""
    for _ in range(passes):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"still false after {passes} passes of the event loop")


async def registry_with_held_listings() -> tuple[HeldListings, WorkerRegistry]:
    """A registry of one worker, p-0, whose listings (reused for an hour) the test releases by hand from now."""
    clock = FakeClock()
    store = HeldListings(clock)
    registry = WorkerRegistry(store, TTL, clock, listing_reuse_s=3600.0)
    await registry.register(info("p-0"), WorkerLoad())
    store.hold = True
    return store, registry


async def test_callers_share_the_listing_under_way_and_one_cancelled_does_not_cancel_it() -> None:
    store, registry = await registry_with_held_listings()
    callers = [asyncio.create_task(ids(registry)) for _ in range(5)]
    await until(lambda: len(store.held) == 1)
    callers[0].cancel()
    store.held[0].set()
    assert await asyncio.gather(*callers[1:]) == [["p-0"]] * 4
    assert len(store.held) == 1, "one listing for the five callers"


async def test_a_listing_that_predates_a_change_made_here_is_not_reused() -> None:
    store, registry = await registry_with_held_listings()
    before = asyncio.create_task(ids(registry))
    await until(lambda: len(store.held) == 1)
    await store.register_worker(info("p-1"), TTL, WorkerLoad())  # another scheduler's worker
    await registry.record_models("p-0", gone=("smol",))  # a change made here: the next call lists again
    after = asyncio.create_task(ids(registry))
    await until(lambda: len(store.held) == 2)
    store.held[1].set()
    assert await after == ["p-0", "p-1"]
    store.held[0].set()
    assert await before == ["p-0"]
    store.hold = False
    assert await ids(registry) == ["p-0", "p-1"], "the later listing is the one reused"
    assert len(store.held) == 2
