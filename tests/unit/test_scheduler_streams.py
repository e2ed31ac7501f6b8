"""The scheduler's ReportTokens streams: a worker is lost when the last of its open streams ends,
so a stray stream naming a live worker's id can neither take its worker's requests down nor hide
the real stream's batches; a batch's prefix-cache changes are applied before its events, in order;
numbered batches are acknowledged once applied, cumulatively, only when one more was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.scheduler.streams import TokenStreams
from tandem.v1 import scheduler_pb2
from tests.waiting import eventually


class Stream:
    """A client's ReportTokens stream: batches put in, then end()."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[scheduler_pb2.TokenBatch | None] = asyncio.Queue()

    def send(self, worker_id: str, request_id: str = "", stored: tuple[str, ...] = (),
             evicted: tuple[str, ...] = (), sequence: int = 0) -> None:
        events = [scheduler_pb2.TokenEvent(request_id=request_id)] if request_id else []
        self._queue.put_nowait(scheduler_pb2.TokenBatch(worker_id=worker_id, events=events, stored_blocks=stored,
                                                        evicted_blocks=evicted, sequence=sequence))

    def end(self) -> None:
        self._queue.put_nowait(None)

    async def batches(self) -> AsyncIterator[scheduler_pb2.TokenBatch]:
        while (batch := await self._queue.get()) is not None:
            yield batch


class Recorder:
    def __init__(self) -> None:
        self.batches: list[tuple[str, str]] = []
        self.closed: list[tuple[str, str]] = []
        self.seen: list[tuple[str, ...]] = []  # ("blocks", worker, stored, evicted) and ("event", worker, id), in order
        self.streams = TokenStreams(self.on_batch, lambda worker_id, reason: self.closed.append((worker_id, reason)),
                                    self.on_blocks)

    def on_batch(self, worker_id: str, batch: scheduler_pb2.TokenBatch) -> None:
        self.batches += [(worker_id, e.request_id) for e in batch.events]
        self.seen += [("event", worker_id, e.request_id) for e in batch.events]

    async def on_blocks(self, worker_id: str, stored: list[str], evicted: list[str]) -> None:
        await asyncio.sleep(0)  # a store call: the stream waits for it before the batch's events
        self.seen.append(("blocks", worker_id, ",".join(stored), ",".join(evicted)))


async def test_a_stray_stream_naming_a_live_worker_ends_without_its_loss_and_the_real_one_still_counts() -> None:
    seen = Recorder()
    real, stray = Stream(), Stream()
    real_task = asyncio.create_task(seen.streams.consume(real.batches()))
    real.send("d-0")
    await eventually(lambda: seen.streams.is_open("d-0"), "the real stream is open")
    stray_task = asyncio.create_task(seen.streams.consume(stray.batches()))
    stray.send("d-0", "forged")
    stray.end()
    assert await stray_task == 1
    assert seen.closed == [] and seen.streams.is_open("d-0")

    real.send("d-0", "r1")
    await eventually(lambda: ("d-0", "r1") in seen.batches, "the real stream's batch arrived")
    real.end()
    assert await real_task == 2
    assert seen.batches == [("d-0", "forged"), ("d-0", "r1")]
    assert seen.closed == [("d-0", "its token stream closed")] and not seen.streams.is_open("d-0")


async def test_a_worker_that_reconnects_before_its_old_stream_ends_is_lost_only_when_both_ended() -> None:
    seen = Recorder()
    old, new = Stream(), Stream()
    old_task = asyncio.create_task(seen.streams.consume(old.batches()))
    old.send("d-0")
    new_task = asyncio.create_task(seen.streams.consume(new.batches()))
    new.send("d-0", "r1")
    await eventually(lambda: ("d-0", "r1") in seen.batches, "the new stream's batch arrived")
    old.end()
    await old_task
    assert seen.closed == []
    new.end()
    await new_task
    assert seen.closed == [("d-0", "its token stream closed")]


async def test_a_stream_that_never_names_a_worker_loses_nothing() -> None:
    seen = Recorder()
    anonymous = Stream()
    anonymous.send("")
    anonymous.end()
    assert await seen.streams.consume(anonymous.batches()) == 1
    assert seen.closed == [] and seen.batches == []


async def test_a_batchs_block_changes_are_applied_before_its_events_and_a_batch_may_carry_only_blocks() -> None:
    seen = Recorder()
    stream = Stream()
    stream.send("d-0")
    stream.send("d-0", "r1", stored=("a" * 32, "b" * 32))
    stream.send("d-0", stored=("c" * 32,), evicted=("a" * 32,))
    stream.send("d-0", "r2")
    stream.end()
    assert await seen.streams.consume(stream.batches()) == 4
    assert seen.seen == [("blocks", "d-0", f"{'a' * 32},{'b' * 32}", ""), ("event", "d-0", "r1"),
                         ("blocks", "d-0", "c" * 32, "a" * 32), ("event", "d-0", "r2")]


async def test_numbered_batches_are_acked_once_applied_and_a_resend_or_an_unnumbered_batch_is_not() -> None:
    seen = Recorder()
    stream = Stream()
    acks: list[tuple[int, int, list[tuple[str, str]]]] = []  # (batches, applied_through, what was applied then)

    async def write_ack(ack: scheduler_pb2.ReportAck) -> None:
        acks.append((ack.batches, ack.applied_through, list(seen.batches)))

    task = asyncio.create_task(seen.streams.consume(stream.batches(), write_ack))
    stream.send("d-0")
    stream.send("d-0", "r1", sequence=1)
    await eventually(lambda: acks, "the first ack")
    stream.send("d-0", "r2")  # unnumbered: nothing to ack
    stream.send("d-0", "r1", sequence=1)  # a resend the ack covered already
    stream.send("d-0", "r3", sequence=2)
    await eventually(lambda: ("d-0", "r3") in seen.batches, "the last batch applied")
    stream.end()  # the ack due for 2 is dropped with the stream: the worker resends 2 on its next one
    assert await task == 5
    assert acks == [(2, 1, [("d-0", "r1")])]


async def test_a_stream_whose_ack_write_hangs_still_ends_with_its_workers_loss() -> None:
    seen = Recorder()
    stream = Stream()
    writing, released = asyncio.Event(), asyncio.Event()

    async def write_ack(ack: scheduler_pb2.ReportAck) -> None:  # a write to a worker that is gone: it hangs,
        writing.set()
        while not released.is_set():
            try:
                await released.wait()
            except asyncio.CancelledError:
                continue  # and does not end when cancelled

    task = asyncio.create_task(seen.streams.consume(stream.batches(), write_ack))
    try:
        stream.send("d-0", "r1", sequence=1)
        await asyncio.wait_for(writing.wait(), 10)
        stream.end()
        assert await asyncio.wait_for(task, 10) == 1
        assert seen.closed == [("d-0", "its token stream closed")]
    finally:
        released.set()  # the writer may end now
