"""The prefix-cache mirror of a worker holding several models: a hash is held while any model holds
it, and a model's eviction reports evicted only the blocks no other model holds; and when its
changes go to the scheduler (on a token batch, or alone after their wait)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.common.block_hash import BlockHash
from services.worker.block_reporter import BlockReporter
from services.worker.runtime import EVICTED_WAIT_S, STORED_WAIT_S, ModelPlan, WorkerIdentity, WorkerRuntime
from services.worker.transport import open_channel
from tandem.v1 import common_pb2, scheduler_pb2

A, B, C = (BlockHash(f"{i:032x}") for i in (1, 2, 3))


def _report(reporter: BlockReporter) -> tuple[list[str], list[str]]:
    request = reporter._take_request()
    return sorted(request.stored), sorted(request.evicted)


def test_a_dropped_model_evicts_only_the_blocks_no_other_model_holds():
    reporter = BlockReporter(None, "w")
    reporter.note("m1", [A, B], [])
    reporter.note("m2", [B, C], [])
    assert _report(reporter) == ([A, B, C], [])
    reporter.drop("m1")
    assert reporter.cached == {B, C} and reporter.num_cached == 2
    assert _report(reporter) == ([], [A])
    reporter.note("m2", [], [B])
    reporter.drop("m2")
    assert _report(reporter) == ([], [B, C])
    assert not reporter.pending and reporter.cached == set()


def test_a_hash_evicted_then_stored_before_a_report_cancels_out():
    reporter = BlockReporter(None, "w")
    reporter.note("m1", [A], [])
    _report(reporter)
    reporter.drop("m1")
    reporter.note("m2", [A], [])
    assert not reporter.pending
    reporter.note("m2", [A], [])  # stored again by the same model: still one holder
    reporter.drop("m2")
    assert _report(reporter) == ([], [A])


def test_pending_changes_ride_a_token_batch_unless_a_full_resend_is_due():
    reporter = BlockReporter(None, "w")
    reporter._stub = object()  # reports blocks (attach needs a scheduler; no call is made here)
    reporter.note("m1", [A, B], [])
    batch = scheduler_pb2.TokenBatch()
    assert reporter.attach(batch)
    assert (list(batch.stored_blocks), list(batch.evicted_blocks)) == ([A, B], []) and not reporter.pending
    assert not reporter.attach(scheduler_pb2.TokenBatch())  # nothing pending
    reporter.note("m1", [C], [A])
    reporter.stream_lost()  # what rode a broken stream may be lost: the whole cache goes by ReportBlocks
    later = scheduler_pb2.TokenBatch()
    assert not reporter.attach(later) and not later.stored_blocks and reporter.pending
    assert _report(reporter) == ([B, C], [])  # the reset: the whole cache


def test_changes_with_no_batch_to_ride_wait_their_time_before_going_alone():
    reporter = BlockReporter(None, "w")
    reporter._stub = object()
    reporter.note("m1", [A], [])
    alone = scheduler_pb2.TokenBatch()
    assert not reporter.attach(alone, min_wait_s=3600.0) and not alone.stored_blocks and reporter.pending
    assert reporter.attach(alone, min_wait_s=0.0) and list(alone.stored_blocks) == [A]


def test_an_eviction_goes_alone_sooner_than_a_store(monkeypatch):
    """Stored blocks wait `min_wait_s` for a batch to ride, an eviction only `evicted_wait_s`; once one is
    due, every pending change goes."""
    now = [100.0]
    monkeypatch.setattr("services.worker.block_reporter.time.monotonic", lambda: now[0])
    reporter = BlockReporter(None, "w")
    reporter._stub = object()
    reporter.note("m1", [A, B], [])
    now[0] = 104.9
    reporter.note("m1", [], [A])  # cancels A's store: only B is stored, nothing evicted
    alone = scheduler_pb2.TokenBatch()
    assert not reporter.attach(alone, min_wait_s=5.0, evicted_wait_s=0.5)
    now[0] = 105.0
    assert reporter.attach(alone, min_wait_s=5.0, evicted_wait_s=0.5)  # B waited its 5 s
    assert (list(alone.stored_blocks), list(alone.evicted_blocks)) == ([B], [])

    reporter.note("m1", [C], [])
    now[0] = 105.2
    reporter.note("m1", [], [B])
    later = scheduler_pb2.TokenBatch()
    now[0] = 105.6
    assert not reporter.attach(later, min_wait_s=5.0, evicted_wait_s=0.5)  # B's eviction 0.4 s old
    now[0] = 105.7
    assert reporter.attach(later, min_wait_s=5.0, evicted_wait_s=0.5)  # it waited 0.5 s: C goes with it
    assert (list(later.stored_blocks), list(later.evicted_blocks)) == ([C], [B]) and not reporter.pending


async def test_a_worker_s_stored_blocks_wait_for_a_batch_longer_than_its_evictions(monkeypatch) -> None:
    """WorkerRuntime._report's defaults: a stored block rides the next batch with events (a request's
    decode-filled blocks, its final one) or goes alone after STORED_WAIT_S; an eviction after EVICTED_WAIT_S."""
    now = [0.0]
    monkeypatch.setattr("services.worker.block_reporter.time.monotonic", lambda: now[0])
    channel = open_channel("127.0.0.1:1")
    runtime = WorkerRuntime(WorkerIdentity("w", common_pb2.WORKER_ROLE_COLOCATED, "127.0.0.1:3", "m", "cpu"),
                            ModelPlan({"m": 1}, 1), make_engine=None, schedulers=[channel])
    try:
        sent: list[scheduler_pb2.TokenBatch] = []
        runtime.reporters = [SimpleNamespace(send=sent.append, connected=asyncio.Event())]
        runtime.reporters[0].connected.set()
        runtime.registrations = [SimpleNamespace(response=scheduler_pb2.RegisterWorkerResponse(scheduler_id="a"))]

        def at(seconds: float, batch: scheduler_pb2.TokenBatch | None = None) -> list[tuple[list[str], list[str]]]:
            now[0] = seconds
            runtime._report(batch, ("a",) if batch is not None else ())
            taken = [(list(b.stored_blocks), list(b.evicted_blocks)) for b in sent]
            sent.clear()
            return taken

        runtime.blocks.note("m", [A], [])
        assert at(STORED_WAIT_S - 0.1) == []
        assert at(STORED_WAIT_S) == [([A], [])]  # alone, once it waited STORED_WAIT_S
        runtime.blocks.note("m", [B], [])
        final = scheduler_pb2.TokenBatch(events=[scheduler_pb2.TokenEvent(request_id="r", finish_reason=1)])
        assert at(STORED_WAIT_S + 0.1, final) == [([B], [])]  # on the final event's batch
        runtime.blocks.note("m", [], [A])
        now_s = STORED_WAIT_S + 0.1
        assert at(now_s + EVICTED_WAIT_S - 0.1) == []
        assert at(now_s + EVICTED_WAIT_S) == [([], [A])]
    finally:
        await channel.close()
