"""The Submissions stream on its own: the gateway's client (services/gateway/submissions.py) against
the scheduler's end (services/scheduler/submissions.py) over loopback, around a scripted per-request
handler. Many requests share one call; each reads as its own Submit call (events, then EOF or the
status with its retry hint); a cancel, a deadline, the stream breaking and the gateway closing end
the handler as cancelling its Submit call would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from services.common.errors import Overloaded, TandemError, Unavailable, error_from_rpc
from services.common.grpc_server import INTERNAL_TOKEN_KEY, create_server
from services.gateway import submissions as gateway_submissions
from services.gateway.submissions import SchedulerSubmissions, SubmitCall
from services.scheduler import submissions
from services.scheduler.submissions import SubmissionCall
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.waiting import DEADLINE_S, eventually

TOKEN = "s3cret"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
METADATA = ((INTERNAL_TOKEN_KEY, TOKEN), ("traceparent", TRACEPARENT))


def placement(attempt_id: str) -> scheduler_pb2.SubmitEvent:
    return scheduler_pb2.SubmitEvent(placement=scheduler_pb2.Placement(attempt_id=attempt_id))


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Serves Submissions with `handle`: each request id's script is what its Submit call does."""

    def __init__(self) -> None:
        self.streams = 0
        self.messages = 0  # command messages received
        self.seen: dict[str, SubmissionCall] = {}
        self.done: list[str] = []  # request ids whose handler ended, in order
        self.release: dict[str, asyncio.Event] = {}
        self.break_stream: asyncio.Event | None = None
        self.address = ""

    def Submissions(self, request_iterator, context) -> AsyncIterator[scheduler_pb2.SubmitUpdates]:
        self.streams += 1
        return self._served(submissions.serve(self.handle, self._counted(request_iterator), context))

    async def _counted(self, messages: AsyncIterator[scheduler_pb2.SubmitCommands]):
        async for message in messages:
            self.messages += 1
            yield message

    async def _served(self, updates: AsyncIterator[scheduler_pb2.SubmitUpdates]):
        async for message in updates:
            yield message
            if self.break_stream is not None and self.break_stream.is_set():
                raise Unavailable("the scheduler went away")

    async def handle(self, request: scheduler_pb2.SubmitRequest,
                     call: SubmissionCall) -> AsyncIterator[scheduler_pb2.SubmitEvent]:
        request_id = request.request_id
        self.seen[request_id] = call
        call.add_done_callback(lambda _: self.done.append(request_id))
        if request_id.startswith("full"):
            raise Overloaded(f"request {request_id}: the scheduler's waiting queue is full", retry_after=2.5)
        if request_id.startswith("crash"):
            raise RuntimeError("a bug")
        yield placement(request_id)
        if request_id.startswith("lost"):
            yield scheduler_pb2.SubmitEvent(lost=scheduler_pb2.AttemptLost(worker_id="w-0", reason="gone"))
            return
        self.release[request_id] = release = asyncio.Event()
        await release.wait()


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[ScriptedScheduler, SchedulerSubmissions]]:
    servicer = ScriptedScheduler()
    server = create_server("127.0.0.1", 0, internal_token=TOKEN)
    server.add_service("tandem.v1.SchedulerService", scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                       servicer)
    await server.start()
    servicer.address = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(servicer.address)
    client = SchedulerSubmissions(scheduler_pb2_grpc.SchedulerServiceStub(channel))
    try:
        yield servicer, client
    finally:
        client.close()
        await channel.close()
        await server.stop(0)


def submit(client: SchedulerSubmissions, request_id: str, timeout: float = DEADLINE_S) -> SubmitCall:
    return client.submit(scheduler_pb2.SubmitRequest(request_id=request_id), timeout=timeout, metadata=METADATA)


async def read(call: SubmitCall) -> scheduler_pb2.SubmitEvent | object:
    return await asyncio.wait_for(call.read(), DEADLINE_S)


async def failure(call: SubmitCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await read(call)
    return error.value


async def test_many_requests_share_one_stream_each_read_as_its_own_call(scheduler) -> None:
    servicer, client = scheduler
    first, second, lost = submit(client, "r1"), submit(client, "r2"), submit(client, "lost-1")
    assert (await read(second)).placement.attempt_id == "r2"
    assert (await read(first)).placement.attempt_id == "r1"
    assert [(await read(lost)).WhichOneof("kind"), (await read(lost)).lost.worker_id] == ["placement", "w-0"]
    assert await read(lost) is grpc.aio.EOF
    servicer.release["r2"].set()
    assert await read(second) is grpc.aio.EOF
    assert await read(second) is grpc.aio.EOF  # ended stays ended
    servicer.release["r1"].set()
    assert [event async for event in first] == []
    assert servicer.streams == 1
    assert servicer.done == ["lost-1", "r2", "r1"]


async def test_a_submission_sees_its_trace_context_the_streams_token_and_its_timeout(scheduler) -> None:
    servicer, client = scheduler
    call = submit(client, "r1", timeout=20.0)
    await read(call)
    seen = servicer.seen["r1"]
    assert dict(seen.invocation_metadata())[INTERNAL_TOKEN_KEY] == TOKEN
    assert dict(seen.invocation_metadata())["traceparent"] == TRACEPARENT
    assert 0 < seen.time_remaining() <= 20.0


async def test_a_failed_submission_ends_with_its_status_and_retry_hint(scheduler) -> None:
    _, client = scheduler
    refused = await failure(submit(client, "full-1"))
    assert (refused.code(), refused.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "request full-1: the scheduler's waiting queue is full")
    assert dict(refused.trailing_metadata()) == {"retry-after": "3", "retry-after-ms": "2500"}
    error = error_from_rpc(refused)
    assert isinstance(error, Overloaded) and error.retry_after == 2.5
    crashed = await failure(submit(client, "crash-1"))
    assert (crashed.code(), crashed.details()) == (
        grpc.StatusCode.INTERNAL, "request crash-1: the scheduler failed it (internal error); its log has the detail")
    assert type(error_from_rpc(crashed)) is TandemError


async def test_a_cancel_ends_the_handler_and_leaves_the_others_running(scheduler) -> None:
    servicer, client = scheduler
    cancelled, other = submit(client, "r1"), submit(client, "r2")
    await read(cancelled), await read(other)
    assert cancelled.cancel() is True
    await eventually(lambda: servicer.done == ["r1"], "r1's handler ended by the cancel")
    assert (await failure(cancelled)).code() == grpc.StatusCode.CANCELLED
    assert cancelled.cancel() is False
    servicer.release["r2"].set()
    assert await read(other) is grpc.aio.EOF


async def test_past_its_timeout_a_submission_fails_and_its_handler_is_cancelled(scheduler) -> None:
    servicer, client = scheduler
    call = submit(client, "r1", timeout=0.5)
    await read(call)
    error = await failure(call)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: servicer.done == ["r1"], "r1's handler ended by the deadline's cancel")


async def test_a_broken_stream_fails_its_submissions_and_the_next_one_opens_another(scheduler) -> None:
    servicer, client = scheduler
    held = submit(client, "r1")
    await read(held)
    servicer.break_stream = asyncio.Event()
    servicer.break_stream.set()
    submit(client, "lost-2")  # its placement is the stream's last message
    error = await failure(held)
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAVAILABLE, "the scheduler went away")
    await eventually(lambda: "r1" in servicer.done, "r1's handler ended with its stream")
    servicer.break_stream = None
    again = submit(client, "lost-3")
    assert (await read(again)).placement.attempt_id == "lost-3"
    assert servicer.streams == 2


async def test_the_gateway_closing_the_stream_cancels_every_handler_on_it(scheduler) -> None:
    servicer, client = scheduler
    calls = [submit(client, f"r{i}") for i in range(3)]
    for call in calls:
        await read(call)
    client.close()
    for call in calls:
        assert (await failure(call)).code() == grpc.StatusCode.CANCELLED
    await eventually(lambda: sorted(servicer.done) == ["r0", "r1", "r2"], "every handler ended with the stream")


async def test_a_reader_cancelled_while_it_waits_cancels_its_submission(scheduler) -> None:
    servicer, client = scheduler
    call = submit(client, "r1")
    await read(call)
    reader = asyncio.ensure_future(call.read())
    await asyncio.sleep(0)  # one pass of the loop: the reader starts and waits (no time is waited for)
    assert not reader.done()
    reader.cancel()
    await eventually(lambda: servicer.done == ["r1"], "r1's handler ended by the reader's cancel")


async def test_after_a_half_close_the_submissions_run_to_their_ends_then_the_stream_ends(scheduler) -> None:
    servicer, _ = scheduler
    commands = scheduler_pb2.SubmitCommands(commands=[
        scheduler_pb2.SubmitCommand(call_id=7, submit=scheduler_pb2.Submission(
            request=scheduler_pb2.SubmitRequest(request_id="lost-1"))),
        scheduler_pb2.SubmitCommand(call_id=8, submit=scheduler_pb2.Submission(
            request=scheduler_pb2.SubmitRequest(request_id="full-1")))])
    async with grpc.aio.insecure_channel(servicer.address) as channel:
        stream = scheduler_pb2_grpc.SchedulerServiceStub(channel).Submissions(
            iter([commands]), metadata=METADATA, timeout=DEADLINE_S)
        updates = [(u.call_id, u.WhichOneof("kind")) async for message in stream for u in message.updates]
        assert await stream.code() == grpc.StatusCode.OK
    assert sorted(updates) == [(7, "end"), (7, "event"), (7, "event"), (8, "end")]
    assert sorted(servicer.done) == ["full-1", "lost-1"]


async def test_commands_past_the_message_budget_go_in_several_messages(scheduler, monkeypatch) -> None:
    servicer, client = scheduler
    monkeypatch.setattr(gateway_submissions, "MESSAGE_BUDGET_BYTES", 1)  # smaller than any command: one each
    calls = [client.submit(scheduler_pb2.SubmitRequest(request_id=f"lost-{i}", token_ids=range(200)),
                           timeout=DEADLINE_S, metadata=METADATA) for i in range(4)]
    for call in calls:
        assert [event.WhichOneof("kind") async for event in call] == ["placement", "lost"]
    assert servicer.messages == 4


async def test_a_call_id_reused_after_its_cancel_names_the_new_submission_to_its_end(scheduler) -> None:
    servicer, _ = scheduler

    def submission(request_id: str) -> scheduler_pb2.SubmitCommand:
        return scheduler_pb2.SubmitCommand(call_id=5, submit=scheduler_pb2.Submission(
            request=scheduler_pb2.SubmitRequest(request_id=request_id)))

    commands = scheduler_pb2.SubmitCommands(commands=[
        submission("old"), scheduler_pb2.SubmitCommand(call_id=5, cancel=True), submission("new")])
    async with grpc.aio.insecure_channel(servicer.address) as channel:
        stream = scheduler_pb2_grpc.SchedulerServiceStub(channel).Submissions(
            iter([commands]), metadata=METADATA, timeout=DEADLINE_S)
        await eventually(lambda: "new" in servicer.release, "the new submission placed and held")
        servicer.release["new"].set()
        updates = [u async for message in stream for u in message.updates]
        assert await stream.code() == grpc.StatusCode.OK
    assert [(u.WhichOneof("kind"), u.event.placement.attempt_id) for u in updates][-2:] == [
        ("event", "new"), ("end", "")]
    assert servicer.done == ["new"]  # the old one was cancelled before its handler started
