"""One attempt of a request in the gateway (attempt.py): the scheduler's Submit status and the
worker's token stream are separate calls whose messages may reach the gateway in either order;
which tokens the client gets before the status must not depend on that order."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import TandemError, Unavailable
from services.gateway.attempt import Attempt
from services.gateway.follow import StreamConsumer
from services.gateway.relay import Interrupted, Relay
from tandem.v1 import common_pb2, scheduler_pb2, worker_pb2

GENERATOR = "127.0.0.1:1"


class FakeCall:
    """A server-streaming call whose messages, and then its end, the test hands it in order."""

    def __init__(self) -> None:
        self._items: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = False

    def give(self, *items: object) -> None:
        """Messages, then `grpc.aio.EOF` or an AioRpcError to end the call."""
        for item in items:
            self._items.put_nowait(item)

    async def read(self) -> object:
        item = await self._items.get()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> object:
        item = await self.read()
        if item is grpc.aio.EOF:
            raise StopAsyncIteration
        return item

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeStream:
    """A worker's token stream as the Follow call hands it over (follow.py): the test gives its
    events, then its end (`grpc.aio.EOF`: OK, or an AioRpcError)."""

    def __init__(self) -> None:
        self._consumer: StreamConsumer | None = None
        self.cancelled = False

    def listen(self, consumer: StreamConsumer) -> None:
        self._consumer = consumer

    def give(self, *items: object) -> None:
        assert self._consumer is not None, "the attempt listens as it starts"
        for item in items:
            if item is grpc.aio.EOF:
                self._consumer.on_end(None)
            elif isinstance(item, grpc.aio.AioRpcError):
                self._consumer.on_end(item)
            else:
                self._consumer.on_event(item)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def token(offset: int, finish: int = common_pb2.FINISH_REASON_UNSPECIFIED) -> scheduler_pb2.TokenEvent:
    return scheduler_pb2.TokenEvent(request_id="r", output_offset=offset, token_ids=[100 + offset],
                                    finish_reason=finish, worker_id="w")


def started(relay: Relay) -> tuple[FakeCall, FakeStream, Attempt]:
    submit, stream = FakeCall(), FakeStream()
    attempt = Attempt(submit, scheduler_pb2.Placement(attempt_id="r", generator_address=GENERATOR), relay)
    attempt.start(lambda address, request: stream)
    return submit, stream, attempt


async def read_all(relay: Relay) -> tuple[list[int], BaseException | None]:
    tokens: list[int] = []
    try:
        async for event in relay.events(lambda: 10.0):
            tokens.extend(event.token_ids)
    except TandemError as error:
        return tokens, error
    return tokens, None


async def test_a_failure_status_that_comes_first_still_lets_the_streamed_tokens_through() -> None:
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    submit.give(status(grpc.StatusCode.INTERNAL, "worker w failed the request"))
    await asyncio.sleep(0)  # the status is read first
    error_event = scheduler_pb2.TokenEvent(request_id="r", output_offset=3,
                                           finish_reason=common_pb2.FINISH_REASON_ERROR, worker_id="w")
    stream.give(token(0), token(1), token(2), error_event, grpc.aio.EOF)
    tokens, error = await read_all(relay)
    assert tokens == [100, 101, 102]
    assert isinstance(error, TandemError) and error.message == "worker w failed the request"
    attempt.close()


async def test_a_failure_status_waits_at_most_the_grace_for_a_stream_that_never_ends(monkeypatch) -> None:
    monkeypatch.setattr("services.gateway.attempt.STREAMS_GRACE_S", 0.05)
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    stream.give(token(0))
    submit.give(status(grpc.StatusCode.INTERNAL, "the scheduler failed it"))
    tokens, error = await read_all(relay)
    assert tokens == [100]
    assert isinstance(error, TandemError) and error.message == "the scheduler failed it"
    attempt.close()
    assert stream.cancelled and submit.cancelled


async def test_a_break_before_the_generators_first_event_arrived_streams_on() -> None:
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    submit.give(status(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    await asyncio.sleep(0)  # the break is read before the worker's first event
    stream.give(token(0), token(1, common_pb2.FINISH_REASON_LENGTH), grpc.aio.EOF)
    assert await read_all(relay) == ([100, 101], None)
    attempt.close()


async def test_a_break_followed_by_a_stream_cut_short_fails_after_the_tokens_streamed() -> None:
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    submit.give(status(grpc.StatusCode.UNAVAILABLE, "decode worker decode-0 was lost"))
    await asyncio.sleep(0)
    stream.give(token(0), token(1), token(2), grpc.aio.EOF)
    tokens, error = await read_all(relay)
    assert tokens == [100, 101, 102]
    assert isinstance(error, Unavailable) and "ended before the request did" in error.message
    attempt.close()


@pytest.mark.parametrize("order", ["submit first", "stream first"])
async def test_a_submit_ended_ok_with_the_generators_stream_cut_short_fails_unavailable_not_at_the_deadline(
        order) -> None:
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    dropped = status(grpc.StatusCode.UNAVAILABLE, "request r was dropped by this worker: aborted")
    if order == "submit first":
        submit.give(grpc.aio.EOF)  # the scheduler counted the request ended (its final report, or an abort)
        await asyncio.sleep(0)
        stream.give(token(0), token(1), dropped)
    else:
        stream.give(token(0), token(1), dropped)
        submit.give(grpc.aio.EOF)
    tokens, error = await read_all(relay)
    assert tokens == [100, 101]
    assert isinstance(error, Unavailable) and error.message == (
        "request r: its token streams ended before the request did; retry the request")
    attempt.close()


async def test_a_submit_ended_ok_lets_a_final_event_that_comes_after_it_end_the_request() -> None:
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    submit.give(grpc.aio.EOF)
    await asyncio.sleep(0)
    stream.give(token(0), token(1, common_pb2.FINISH_REASON_LENGTH), grpc.aio.EOF)
    assert await read_all(relay) == ([100, 101], None)
    attempt.close()


async def test_a_first_token_that_ends_the_request_on_the_prefill_stream_ends_it_though_the_decode_stream_was_dropped(
        ) -> None:
    relay = Relay("r")
    submit, decode, prefill = FakeCall(), FakeStream(), FakeStream()
    placement = scheduler_pb2.Placement(attempt_id="r", generator_address=GENERATOR, prefill_address="127.0.0.1:2")
    attempt = Attempt(submit, placement, relay)
    attempt.start(lambda address, request: decode if address == GENERATOR else prefill)
    submit.give(grpc.aio.EOF)  # max_tokens 1: the scheduler counted it finished from the Prefill call
    await asyncio.sleep(0)
    decode.give(status(grpc.StatusCode.UNAVAILABLE, "request r was dropped by this worker: aborted"))  # released
    prefill.give(token(0, common_pb2.FINISH_REASON_LENGTH), grpc.aio.EOF)
    assert await read_all(relay) == ([100], None)
    attempt.close()


@pytest.mark.parametrize("stream_end", [grpc.aio.EOF, None])
async def test_a_break_while_the_generator_never_started_hands_the_request_over(monkeypatch, stream_end) -> None:
    """The scheduler was lost before the worker started the request: the relay is interrupted with
    nothing delivered, and the attempt says its scheduler was lost (the next one takes it over)."""
    monkeypatch.setattr("services.gateway.attempt.STREAMS_GRACE_S", 0.05)
    relay = Relay("r")
    submit, stream, attempt = started(relay)
    if stream_end is not None:
        stream.give(stream_end)  # ended without an event; else silent past the grace
    submit.give(status(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    with pytest.raises(Interrupted) as interrupted:
        await read_all(relay)
    assert interrupted.value.offset == 0 and interrupted.value.error.message == (
        f"request r: its scheduler was lost before {GENERATOR} started it")
    assert attempt.scheduler_lost
    attempt.close()


async def test_the_stream_request_names_the_attempt() -> None:
    opened: list[tuple[str, worker_pb2.StreamRequest]] = []
    submit = FakeCall()
    attempt = Attempt(submit, scheduler_pb2.Placement(attempt_id="r.1", generator_address=GENERATOR,
                                                      prefill_address="127.0.0.1:2"), Relay("r"))
    attempt.start(lambda address, request: opened.append((address, request)) or FakeStream())
    assert [(a, r.request_id) for a, r in opened] == [(GENERATOR, "r.1"), ("127.0.0.1:2", "r.1")]
    attempt.close()


async def test_the_upstream_asks_the_workers_for_its_stream_interval() -> None:
    from services.gateway.upstream import Upstream

    with pytest.raises(ValueError, match="stream_interval is 0; give 1"):
        Upstream([object()], stream_interval=0)
    channel = grpc.aio.insecure_channel("127.0.0.1:1")
    upstream = Upstream([channel], lambda address: channel, stream_interval=4)
    request = worker_pb2.StreamRequest(request_id="r")
    call = upstream.stream("127.0.0.1:1", request, metadata=())
    assert request.min_tokens_per_message == 4
    call.cancel()
    await upstream.close()
