"""A worker's request token streams: events wait for the gateway that reads them, whichever comes
first (the request or the reader); a prefill worker's stream ends at output token 0; a request
nobody reads within the bound, or whose reader leaves early, is given up; a dropped request ends
its reader with UNAVAILABLE; events waiting for the reader go out joined, never across a gap, a
worker or a drop."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import Unavailable
from services.worker.token_streams import RequestStreams
from tandem.v1 import common_pb2, scheduler_pb2

LENGTH = common_pb2.FINISH_REASON_LENGTH


def event(offset: int, token: int, finish: int = 0) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", output_offset=offset, token_ids=[token], finish_reason=finish)


async def read(streams: RequestStreams) -> list[tuple[int, list[int]]]:
    return [(e.output_offset, list(e.token_ids)) async for e in streams.follow("r")]


async def test_events_before_the_reader_attaches_wait_for_it_up_to_the_final_one() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append)
    streams.open("r")
    streams.push(event(0, 10))
    streams.push(event(1, 11, finish=LENGTH))
    assert await read(streams) == [(0, [10, 11])]  # waiting events go out joined
    assert "r" not in streams and abandoned == []


async def test_a_reader_may_attach_before_the_worker_takes_the_request() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append)
    reader = asyncio.ensure_future(read(streams))
    await asyncio.sleep(0)
    streams.push(event(0, 9))  # the reader made the stream, so it holds events before the request is opened
    streams.open("r")
    streams.push(event(1, 10, finish=LENGTH))
    assert await asyncio.wait_for(reader, 5) == [(0, [9, 10])]
    assert abandoned == []


async def test_a_prefill_workers_stream_ends_at_output_token_0() -> None:
    streams = RequestStreams(lambda r: None)
    streams.open("r", hands_on=True)
    streams.push(event(0, 7))
    assert await read(streams) == [(0, [7])]
    streams.push(event(1, 8))  # nothing is held any more
    assert "r" not in streams


async def test_a_request_nobody_reads_within_the_bound_is_given_up() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append, attach_s=0.05)
    streams.open("r")
    streams.push(event(0, 1))
    await asyncio.wait_for(_until(lambda: abandoned == ["r"]), 5)
    assert "r" not in streams


async def test_a_reader_that_leaves_before_the_last_event_gives_the_request_up() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append)
    streams.open("r")
    streams.push(event(0, 1))
    follow = streams.follow("r")
    assert (await anext(follow)).output_offset == 0
    await follow.aclose()
    assert abandoned == ["r"] and "r" not in streams


async def test_a_dropped_request_ends_its_reader_with_unavailable_after_the_events_before() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append)
    streams.open("r")
    streams.push(event(0, 1))
    streams.drop("r", "aborted")
    seen = []
    with pytest.raises(Unavailable, match="^request r was dropped by this worker: aborted$"):
        async for e in streams.follow("r"):
            seen.append(e.output_offset)
    assert seen == [0] and abandoned == []


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_request_dropped_before_its_reader_came_ends_the_reader_that_comes() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append, attach_s=0.05)
    streams.open("r")
    streams.drop("r", "shutting down")
    with pytest.raises(Unavailable, match="^request r was dropped by this worker: shutting down$"):
        await read(streams)
    streams.open("q")
    streams.drop("q", "aborted")
    await asyncio.wait_for(_until(lambda: "q" not in streams), 5)
    assert abandoned == []


async def test_attached_says_whether_a_gateway_reads_the_request_now():
    streams = RequestStreams(lambda request_id: None)
    streams.open("r1")
    assert not streams.attached("r1") and not streams.attached("unknown")
    reader = streams.follow("r1")
    streams.push(scheduler_pb2.TokenEvent(request_id="r1", output_offset=0, token_ids=[7]))
    assert (await anext(reader)).token_ids == [7]
    assert streams.attached("r1")
    await reader.aclose()
    assert not streams.attached("r1")


async def test_waiting_events_are_joined_up_to_the_last_but_never_across_a_gap_or_a_drop() -> None:
    streams = RequestStreams(lambda r: None)
    streams.open("r")
    first = event(0, 10)
    streams.push(first)
    streams.push(event(1, 11))
    streams.push(event(3, 13))  # a gap: its own message
    streams.push(event(4, 14, finish=LENGTH))
    streams.push(event(5, 15))  # after the final event: never read
    assert await read(streams) == [(0, [10, 11]), (3, [13, 14])]
    assert list(first.token_ids) == [10]  # the worker's own event is left as it was

    streams.open("r")
    streams.push(event(0, 20))
    streams.push(event(1, 21))
    streams.drop("r", "aborted")
    seen: list[tuple[int, list[int]]] = []
    with pytest.raises(Unavailable, match="request r was dropped by this worker: aborted"):
        async for e in streams.follow("r"):
            seen.append((e.output_offset, list(e.token_ids)))
    assert seen == [(0, [20, 21])]


async def test_a_joined_event_takes_the_final_events_reason_and_usage() -> None:
    streams = RequestStreams(lambda r: None)
    streams.open("r")
    streams.push(event(0, 10))
    final = event(1, 11, finish=LENGTH)
    final.usage.completion_tokens = 2
    streams.push(final)
    events = [e async for e in streams.follow("r")]
    assert len(events) == 1
    assert (events[0].output_offset, list(events[0].token_ids)) == (0, [10, 11])
    assert events[0].finish_reason == LENGTH and events[0].usage.completion_tokens == 2


async def test_a_reader_asking_for_several_tokens_per_message_gets_the_first_at_once_then_batches() -> None:
    streams = RequestStreams(lambda r: None)
    streams.open("r")
    messages = aiter(streams.follow("r", min_tokens=3))
    streams.push(event(0, 10))
    assert (await anext(messages)).token_ids == [10]  # the first token is not held back
    pending = asyncio.ensure_future(anext(messages))
    for offset in (1, 2):
        streams.push(event(offset, 10 + offset))
        await asyncio.sleep(0)
        assert not pending.done()  # waits for a third token
    streams.push(event(3, 13))
    assert list((await pending).token_ids) == [11, 12, 13]
    streams.push(event(4, 14))
    streams.push(event(5, 15, finish=LENGTH))  # the last event goes with what waits, however few
    last = await anext(messages)
    assert (last.output_offset, list(last.token_ids), last.finish_reason) == (4, [14, 15], LENGTH)
    with pytest.raises(StopAsyncIteration):
        await anext(messages)


async def test_a_batching_reader_gets_the_tokens_before_a_drop_then_unavailable() -> None:
    streams = RequestStreams(lambda r: None)
    streams.open("r")
    streams.push(event(0, 10))
    streams.push(event(1, 11))
    seen: list[tuple[int, list[int]]] = []
    with pytest.raises(Unavailable, match="request r was dropped by this worker: aborted"):
        async for e in streams.follow("r", min_tokens=4):
            seen.append((e.output_offset, list(e.token_ids)))
            if len(seen) == 1:
                streams.push(event(2, 12))
                streams.drop("r", "aborted")
    assert seen == [(0, [10, 11]), (2, [12])]
