"""The Assign stream between the scheduler (assign_stream.AssignStream) and a colocated worker
(assignments.serve_assignments), on loopback with the real error and auth interceptors: answers
pair by call_id whatever their order, a refusal raises the status a unary call would have, a request
with no answer in time fails alone, a broken stream fails the requests still unanswered on it with
its status and the next request opens a new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.colocated.assignments import serve_assignments
from services.common.errors import InvalidRequest, Overloaded, Unavailable
from services.common.grpc_server import INTERNAL_TOKEN_KEY, create_server
from services.scheduler.assign_stream import AssignStream
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.v1.errors import retry_after_hint
from tests.waiting import eventually

TOKEN = "a-token-of-sufficient-length"
METADATA = ((INTERNAL_TOKEN_KEY, TOKEN),)


class FakeColocated(worker_pb2_grpc.ColocatedServiceServicer):
    """Admits by the request id's prefix: `hold` never answers until released, `full` and `bad` are
    refused, `boom` fails unexpectedly, `cut` breaks the stream (UNAVAILABLE); others are queued."""

    def __init__(self) -> None:
        self.calls = 0  # Assign calls opened
        self.admitted: list[str] = []
        self.release = asyncio.Event()
        self.ended = 0  # Assign calls whose requests ended (the scheduler half-closed)

    async def Assign(self, requests: AsyncIterator[worker_pb2.RunRequest],
                     context) -> AsyncIterator[worker_pb2.RunResult]:
        self.calls += 1
        async for result in serve_assignments(requests, self._admit):
            if result.request_id == "cut":
                raise Unavailable("the worker is stopping")
            yield result
        self.ended += 1

    async def _admit(self, request: worker_pb2.RunRequest) -> int:
        kind = request.request_id.split("-")[0]
        if kind == "hold":
            await self.release.wait()
        elif kind == "full":
            raise Overloaded("no room for the model", retry_after=2.5)
        elif kind == "bad":
            raise InvalidRequest("sampling", "top_p must be in (0, 1]")
        elif kind == "boom":
            raise RuntimeError("a bug")
        self.admitted.append(request.request_id)
        return len(self.admitted) - 1


@pytest.fixture
async def worker() -> AsyncIterator[tuple[FakeColocated, worker_pb2_grpc.ColocatedServiceStub]]:
    servicer = FakeColocated()
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)
    server.add_service("tandem.v1.ColocatedService", worker_pb2_grpc.add_ColocatedServiceServicer_to_server,
                       servicer)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield servicer, worker_pb2_grpc.ColocatedServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=0)


def run(stream: AssignStream, request_id: str, timeout: float = 30.0) -> asyncio.Task[worker_pb2.RunResult]:
    request = worker_pb2.RunRequest(request_id=request_id, token_ids=[1, 2, 3])
    return asyncio.ensure_future(stream.run(request, timeout))


async def failure(task: asyncio.Task) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await task
    return error.value


async def test_answers_pair_by_call_id_in_any_order_on_one_call(worker) -> None:
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    try:
        held = run(stream, "hold-1")
        assert (await run(stream, "r-2")).queue_position == 0  # answered while hold-1 waits
        servicer.release.set()
        result = await held
        assert (result.request_id, result.call_id, result.queue_position) == ("hold-1", 1, 1)
        assert (await run(stream, "r-3")).call_id == 3
        assert servicer.calls == 1 and servicer.admitted == ["r-2", "hold-1", "r-3"]
    finally:
        stream.close()


async def test_a_refusal_raises_the_status_and_retry_hint_a_call_would(worker) -> None:
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    try:
        full = await failure(run(stream, "full-1"))
        assert (full.code(), full.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room for the model")
        assert retry_after_hint(tuple(full.trailing_metadata())) == 2.5
        bad = await failure(run(stream, "bad-1"))
        assert (bad.code(), bad.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling: top_p must be in (0, 1]")
        assert retry_after_hint(tuple(bad.trailing_metadata())) is None
        boom = await failure(run(stream, "boom-1"))
        assert (boom.code(), boom.details()) == (
            grpc.StatusCode.INTERNAL,
            "request 'boom-1': the worker failed to queue it (internal error: RuntimeError); its log has the detail")
        assert (await run(stream, "r-1")).request_id == "r-1"  # refusals leave the call open
        assert servicer.calls == 1
    finally:
        stream.close()


async def test_send_settles_a_plain_future_and_a_cancelled_one_leaves_the_call_open(worker) -> None:
    """No task per request: send() hands back the future the stream's reader settles (the result, or
    the refusal as a call's error); a caller that gives up on one leaves the call to the others."""
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    try:
        queued = stream.send(worker_pb2.RunRequest(request_id="r-1", token_ids=[1]), 30.0)
        assert not isinstance(queued, asyncio.Task)
        assert (await queued).call_id == 1
        full = await failure(stream.send(worker_pb2.RunRequest(request_id="full-2", token_ids=[1]), 30.0))
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held = stream.send(worker_pb2.RunRequest(request_id="hold-3", token_ids=[1]), 30.0)
        held.cancel()
        servicer.release.set()
        result = await stream.send(worker_pb2.RunRequest(request_id="r-4", token_ids=[1]), 30.0)
        assert (result.request_id, result.call_id) == ("r-4", 4) and servicer.calls == 1
    finally:
        stream.close()


async def test_a_request_unanswered_in_time_fails_alone_and_the_next_goes_on_a_fresh_call(worker) -> None:
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    try:
        answered = await run(stream, "r-1")
        held = run(stream, "hold-2", timeout=0.2)
        late = await failure(held)
        assert (late.code(), late.details()) == (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                 "no answer on the Assign stream within 0.2 s")
        # The call that left it unanswered takes no more (it may be dead): the next request opens another,
        # and the old one ends once the worker answered what it had (its own bound, timeout_ms, refuses hold-2).
        assert ((await run(stream, "r-3")).call_id, answered.call_id) == (1, 1)
        await eventually(lambda: servicer.ended == 1, "the worker ended the call it left unanswered")
        assert servicer.calls == 2
    finally:
        stream.close()


async def test_a_broken_stream_fails_its_unanswered_requests_and_the_next_request_reopens_it(worker) -> None:
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    try:
        held = run(stream, "hold-1")
        await eventually(lambda: servicer.calls == 1, "the Assign call opened")
        cut = await failure(run(stream, "cut"))
        assert (cut.code(), cut.details()) == (grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
        lost = await failure(held)
        assert (lost.code(), lost.details()) == (grpc.StatusCode.UNAVAILABLE, "the worker is stopping")
        result = await run(stream, "r-2")
        assert (result.call_id, servicer.calls) == (1, 2)  # numbered afresh on the new call
    finally:
        stream.close()


async def test_closing_fails_the_unanswered_requests_as_unavailable(worker) -> None:
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    held = run(stream, "hold-1")
    await eventually(lambda: servicer.calls == 1, "the Assign call opened")
    stream.close()
    lost = await failure(held)
    assert (lost.code(), lost.details()) == (grpc.StatusCode.UNAVAILABLE, "the Assign stream was closed")


async def test_a_half_closed_stream_ends_after_its_answers_and_the_next_request_opens_another(worker) -> None:
    servicer, stub = worker
    stream = AssignStream(stub, METADATA)
    try:
        held = run(stream, "hold-1")
        await eventually(lambda: servicer.calls == 1, "the Assign call opened")
        stream.half_close()
        servicer.release.set()
        assert (await held).request_id == "hold-1"
        await eventually(lambda: servicer.ended == 1, "the worker ended the half-closed call")
        assert (await run(stream, "r-2")).request_id == "r-2" and servicer.calls == 2
    finally:
        stream.close()


async def test_the_stream_needs_the_internal_token(worker) -> None:
    servicer, stub = worker
    bare = stub.Assign(metadata=(), timeout=30)  # no request written: the refusal is all that comes back
    assert await bare.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await bare.details() == ("missing credentials: send `x-tandem-internal-token: <token>` metadata with a "
                                    "configured key")
    stream = AssignStream(stub, ())
    try:
        refused = await failure(run(stream, "r-1"))
        # gRPC's client reports INTERNAL instead when its write of the request loses the race with the
        # refusal (grpc/aio/_call.py: a failed send sets an internal error over the status still on its way).
        assert refused.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INTERNAL)
        assert servicer.calls == 0 and servicer.admitted == []
    finally:
        stream.close()


async def test_the_worker_refuses_an_admission_past_its_timeout() -> None:
    async def requests() -> AsyncIterator[worker_pb2.RunRequest]:
        yield worker_pb2.RunRequest(call_id=7, request_id="slow", timeout_ms=50)

    async def never(request: worker_pb2.RunRequest) -> int:
        await asyncio.Event().wait()
        return 0

    (result,) = [result async for result in serve_assignments(requests(), never)]
    assert (result.call_id, result.request_id) == (7, "slow")
    assert result.status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert result.status.message == "request 'slow' was not queued within 50 ms"
