"""Many requests' token streams on one call (TokenStreamService.Follow): on the worker
(token_streams.follow_many), each message carries every event ready, of any request, and the ends
of the streams that ended; a leave, or the call's end, gives a request up. In the gateway
(follow.py) over a real server with the internal token: each request's consumer is handed its own
events and end, a cancel leaves it on the worker, an idle call is closed and the next request opens
another, a consumer that fails is left alone, and a call that breaks ends every stream on it with
its status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.common.grpc_server import INTERNAL_TOKEN_KEY, create_server
from services.gateway.follow import FollowedStream, WorkerFollow
from services.worker.token_streams import RequestStreams, follow_many
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc

LENGTH = common_pb2.FINISH_REASON_LENGTH
TOKEN = "s3cret"
DEADLINE_S = 10.0


def event(request_id: str, offset: int, token: int, finish: int = 0) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id=request_id, output_offset=offset, token_ids=[token],
                                    finish_reason=finish, worker_id="w")


def attach(request_id: str) -> worker_pb2.FollowControl:
    return worker_pb2.FollowControl(attach=worker_pb2.StreamRequest(request_id=request_id))


async def until(condition: Callable[[], bool]) -> None:
    """Wait for the condition, at most DEADLINE_S."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), DEADLINE_S)


class Controls:
    """The gateway's side of a Follow call's controls, handed in by the test."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[worker_pb2.FollowControl | None] = asyncio.Queue()

    def send(self, *controls: worker_pb2.FollowControl | None) -> None:
        for control in controls:
            self._queue.put_nowait(control)

    async def __aiter__(self) -> AsyncIterator[worker_pb2.FollowControl]:
        while (control := await self._queue.get()) is not None:
            yield control


def summary(batch: worker_pb2.FollowBatch) -> tuple[list[tuple[str, list[int]]], list[tuple[str, int]]]:
    return ([(e.request_id, list(e.token_ids)) for e in batch.events], [(e.request_id, e.code) for e in batch.ends])


def followed(*request_ids: str, abandoned: list[str] | None = None,
             ) -> tuple[RequestStreams, Controls, AsyncIterator[worker_pb2.FollowBatch]]:
    """A worker's streams with `request_ids` opened (`abandoned` records what it gives up), and a
    Follow call on them that has attached them all (the test sends its further controls)."""
    streams = RequestStreams(abandoned.append if abandoned is not None else lambda r: None)
    controls = Controls()
    for rid in request_ids:
        streams.open(rid)
    controls.send(*(attach(rid) for rid in request_ids))
    return streams, controls, aiter(follow_many(aiter(controls), streams.follow))


async def test_one_message_carries_every_ready_event_and_the_ends_after_them() -> None:
    streams, controls, batches = followed("a", "b")
    streams.push(event("a", 0, 10))
    streams.push(event("b", 0, 20))
    assert summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) == ([("a", [10]), ("b", [20])], [])
    streams.push(event("a", 1, 11, finish=LENGTH))
    streams.push(event("b", 1, 21))
    assert summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) == ([("a", [11]), ("b", [21])], [("a", 0)])
    controls.send(None)  # the gateway is done attaching: the call ends with b's stream
    streams.push(event("b", 2, 22, finish=LENGTH))
    assert summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) == ([("b", [22])], [("b", 0)])
    with pytest.raises(StopAsyncIteration):
        await anext(batches)


async def test_a_leave_gives_up_that_request_only_and_a_drop_ends_it_with_its_status() -> None:
    abandoned: list[str] = []
    streams, controls, batches = followed("a", "b", "c", abandoned=abandoned)
    streams.push(event("a", 0, 10))
    assert summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) == ([("a", [10])], [])
    controls.send(worker_pb2.FollowControl(leave="a"))
    await until(lambda: abandoned == ["a"])
    streams.drop("b", "aborted")
    batch = await asyncio.wait_for(anext(batches), DEADLINE_S)
    assert summary(batch) == ([], [("b", grpc.StatusCode.UNAVAILABLE.value[0])])
    assert batch.ends[0].message == "request b was dropped by this worker: aborted"
    streams.push(event("c", 0, 30, finish=LENGTH))
    assert summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) == ([("c", [30])], [("c", 0)])
    assert abandoned == ["a"]
    await batches.aclose()


async def test_a_bad_attach_ends_with_invalid_argument_and_the_calls_end_gives_up_the_rest() -> None:
    abandoned: list[str] = []
    streams = RequestStreams(abandoned.append)
    controls = Controls()
    batches = aiter(follow_many(aiter(controls), streams.follow))
    streams.open("a")
    controls.send(attach(""), attach("a"), attach("a"))
    batch = await asyncio.wait_for(anext(batches), DEADLINE_S)
    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert summary(batch) == ([], [("", code), ("a", code)])
    assert [end.message for end in batch.ends] == [
        "attach.request_id: is empty; pass the attempt id of the scheduler's Placement",
        "attach.request_id: 'a' is already followed on this call"]
    await batches.aclose()  # the call ended (the gateway went away): every stream on it is given up
    await until(lambda: abandoned == ["a"])


async def test_a_request_left_by_its_reader_is_given_up_as_left_one_whose_call_ended_as_abandoned() -> None:
    abandoned: list[str] = []
    left: list[str] = []
    streams = RequestStreams(abandoned.append, on_left=left.append)
    controls = Controls()
    batches = aiter(follow_many(aiter(controls), streams.follow, streams.leave))
    streams.open("a")
    streams.open("b")
    controls.send(attach("a"), attach("b"))
    streams.push(event("a", 0, 10))
    assert summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) == ([("a", [10])], [])
    controls.send(worker_pb2.FollowControl(leave="a"))  # the gateway gave it up: it ends its Submit call itself
    await until(lambda: left == ["a"])
    await batches.aclose()  # the call ended under b: nobody tells the scheduler unless the worker does
    await until(lambda: abandoned == ["b"])
    assert left == ["a"]


class Worker(worker_pb2_grpc.TokenStreamServiceServicer):
    def __init__(self) -> None:
        self.abandoned: list[str] = []
        self.streams = RequestStreams(self.abandoned.append)
        self.calls = 0
        self.open_calls = 0

    async def Follow(self, request_iterator, context):
        self.calls += 1
        self.open_calls += 1
        try:
            async for batch in follow_many(request_iterator, self.streams.follow):
                yield batch
        finally:
            self.open_calls -= 1


class Recorder:
    """A request's consumer on the gateway's side (attempt.py's part): keeps what it is handed."""

    def __init__(self, stream: FollowedStream) -> None:
        self.tokens: list[int] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = asyncio.get_running_loop().create_future()
        stream.listen(self)

    def on_event(self, event: scheduler_pb2.TokenEvent) -> None:
        assert not self.ended.done(), "no event after the end"
        self.tokens.extend(event.token_ids)

    def on_end(self, error: grpc.aio.AioRpcError | None) -> None:
        self.error = error
        self.ended.set_result(None)


async def read_all(recorder: Recorder) -> list[int]:
    """The stream's tokens once it ended OK; raises the status it ended with."""
    await asyncio.wait_for(asyncio.shield(recorder.ended), DEADLINE_S)
    if recorder.error is not None:
        raise recorder.error
    return recorder.tokens


def attached(follow: WorkerFollow, request_id: str, metadata: tuple[tuple[str, str], ...]) -> Recorder:
    return Recorder(follow.attach(worker_pb2.StreamRequest(request_id=request_id), metadata))


@pytest.fixture
async def served() -> AsyncIterator[tuple[Worker, WorkerFollow, grpc.aio.Server]]:
    worker = Worker()
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)
    server.add_service("tandem.v1.TokenStreamService", worker_pb2_grpc.add_TokenStreamServiceServicer_to_server,
                       worker)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    follow = WorkerFollow(worker_pb2_grpc.TokenStreamServiceStub(channel))
    try:
        yield worker, follow, server
    finally:
        follow.close()
        await channel.close()
        await server.stop(0)


METADATA = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), (INTERNAL_TOKEN_KEY, TOKEN))


async def test_the_gateways_requests_share_one_call_and_each_reads_its_own_events(served) -> None:
    worker, follow, _ = served
    a, b = attached(follow, "a", METADATA), attached(follow, "b", METADATA)
    for rid, base in (("a", 10), ("b", 20)):
        worker.streams.open(rid)
        worker.streams.push(event(rid, 0, base))
        worker.streams.push(event(rid, 1, base + 1, finish=LENGTH))
    assert await read_all(a) == [10, 11] and await read_all(b) == [20, 21]
    assert worker.calls == 1
    await until(lambda: worker.open_calls == 0)  # no request left: the call was closed
    c = attached(follow, "c", METADATA)  # and the next opens another
    worker.streams.open("c")
    worker.streams.push(event("c", 0, 30, finish=LENGTH))
    assert await read_all(c) == [30] and worker.calls == 2
    assert worker.abandoned == []


async def test_a_cancelled_stream_is_given_up_on_the_worker_and_a_dropped_one_fails(served) -> None:
    worker, follow, _ = served
    streams = {rid: follow.attach(worker_pb2.StreamRequest(request_id=rid), METADATA) for rid in ("a", "b", "keep")}
    a, b, keep = (Recorder(stream) for stream in streams.values())
    for rid in streams:
        worker.streams.open(rid)
    worker.streams.push(event("a", 0, 10))
    await until(lambda: a.tokens == [10])
    assert streams["a"].cancel() is True
    await until(lambda: worker.abandoned == ["a"])
    worker.streams.drop("b", "aborted")
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await read_all(b)
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    assert failure.value.details() == "request b was dropped by this worker: aborted"
    assert streams["b"].cancel() is False  # it had ended: nothing to leave
    worker.streams.push(event("keep", 0, 7, finish=LENGTH))
    assert await read_all(keep) == [7] and worker.abandoned == ["a"] and worker.calls == 1
    assert not a.ended.done()  # a left stream hears nothing more, its end included


async def test_a_second_attach_of_a_followed_request_ends_at_once_with_invalid_argument(served) -> None:
    worker, follow, _ = served
    first = attached(follow, "a", METADATA)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await read_all(attached(follow, "a", METADATA))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.value.details() == "request 'a' is already followed on this worker's call"
    worker.streams.open("a")
    worker.streams.push(event("a", 0, 10, finish=LENGTH))
    assert await read_all(first) == [10]


class Failing(Recorder):
    def on_event(self, event: scheduler_pb2.TokenEvent) -> None:
        raise RuntimeError("a bug in the consumer")


async def test_a_consumer_that_raises_is_left_and_the_others_on_the_call_go_on(served) -> None:
    worker, follow, _ = served
    bad = Failing(follow.attach(worker_pb2.StreamRequest(request_id="bad"), METADATA))
    good = attached(follow, "good", METADATA)
    for rid in ("bad", "good"):
        worker.streams.open(rid)
    worker.streams.push(event("bad", 0, 1))
    await until(lambda: worker.abandoned == ["bad"])
    worker.streams.push(event("good", 0, 2, finish=LENGTH))
    assert await read_all(good) == [2] and not bad.ended.done()


async def test_a_call_that_breaks_ends_every_stream_on_it_with_its_status(served) -> None:
    worker, follow, server = served
    recorders = [attached(follow, rid, METADATA) for rid in ("a", "b")]
    await until(lambda: worker.open_calls == 1)
    await server.stop(0)
    for recorder in recorders:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await read_all(recorder)
        assert failure.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


async def test_a_call_without_the_internal_token_is_refused(served) -> None:
    worker, follow, server = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        bare = worker_pb2_grpc.TokenStreamServiceStub(channel).Follow(metadata=METADATA[:1], timeout=DEADLINE_S)
        assert await bare.code() == grpc.StatusCode.UNAUTHENTICATED  # nothing written: the refusal alone
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await read_all(attached(follow, "a", METADATA[:1]))
    # gRPC's aio client reports INTERNAL instead when its write of the attach loses the race with the
    # refusal (grpc/aio/_call.py: a failed send sets an internal error over the status on its way).
    assert failure.value.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
    assert worker.calls == 0


async def test_an_event_with_prompt_logprobs_goes_in_a_message_of_its_own() -> None:
    streams, _, batches = followed("a", "b", "c")
    streams.push(event("a", 0, 10))
    big = event("b", 0, 20)
    big.prompt_logprobs.add(token_id=5, logprob=-1.0)
    streams.push(big)
    streams.push(event("c", 0, 30))
    messages = [summary(await asyncio.wait_for(anext(batches), DEADLINE_S)) for _ in range(3)]
    assert messages == [([("a", [10])], []), ([("b", [20])], []), ([("c", [30])], [])]
    await batches.aclose()
