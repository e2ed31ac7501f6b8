"""The SDK (tandem.Client, tandem.AsyncClient) against a scripted grpc.aio GenerateService on loopback.

The fake gateway plays the scenario named by the prompt ("count:3", "fail:NOT_FOUND", ...) and
records what it saw (requests, metadata, attempts, cancellations) per request id.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from tandem import errors
from tandem.client import (
    AsyncChunkStream, AsyncClient, Chunk, ChunkStream, Client, Completion, ModelInfo, RetryPolicy, TLSConfig,
    TokenLogprob, TopLogprob, Usage,
)
from tandem.client.connection import Deadline, retry_delay
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.certificates import CertificateAuthority
from tests.waiting import DEADLINE_S, eventually

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.02, jitter=0.0)
KINDS = ["sync", "async"]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
MESSAGES = {
    grpc.StatusCode.INVALID_ARGUMENT: "sampling.top_p: must be in (0, 1], got 2.0",
    grpc.StatusCode.UNAUTHENTICATED: "missing API key: send 'authorization: Bearer KEY'",
    grpc.StatusCode.PERMISSION_DENIED: "key 'k1' may not use model 'big'",
    grpc.StatusCode.NOT_FOUND: "unknown model 'gpt-9': this gateway serves 'smol'",
    grpc.StatusCode.FAILED_PRECONDITION: "block size 16 != 32",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "waiting queue full (256 requests)",
    grpc.StatusCode.UNAVAILABLE: "decode worker decode-0 was lost",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline passed while queued",
    grpc.StatusCode.CANCELLED: "request aborted by an operator",
    grpc.StatusCode.INTERNAL: "engine step failed: out of memory",
    grpc.StatusCode.UNIMPLEMENTED: "GenerateService.Embed is not served",
}
ERROR_CLASSES = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.Overloaded,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.INTERNAL: errors.Internal,
    grpc.StatusCode.UNIMPLEMENTED: errors.TandemError,
}


@dataclass(slots=True)
class Seen:
    """What the fake gateway saw of one request id."""

    requests: list[gateway_pb2.GenerateRequest] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each attempt
    metadata: list[dict[str, str]] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)  # the handler was cancelled mid-call

    @property
    def attempts(self) -> int:
        return len(self.requests)


class FakeGateway(gateway_pb2_grpc.GenerateServiceServicer):
    """Plays the scenario the prompt names; `models_failures` are the codes of the next ListModels calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, Seen] = {}
        self.models_failures: list[grpc.StatusCode] = []
        self.models_calls = 0
        self.target = ""

    def seen(self, request_id: str) -> Seen:
        with self._lock:
            return self._seen.setdefault(request_id, Seen())

    async def Generate(self, request, context):
        seen = self.seen(request.request_id or "auto")
        seen.requests.append(request)
        seen.arrivals.append(time.monotonic())
        seen.metadata.append(dict(context.invocation_metadata()))
        scenario, _, arg = request.prompt.partition(":")
        if request.messages:
            yield _chat_reply(request)
        elif request.token_ids:
            yield _response(request, list(request.token_ids), first=True, last=True)
        elif scenario == "count":
            for message in _count(request, int(arg)):
                yield message
        elif scenario == "fail":
            await _abort(context, grpc.StatusCode[arg])
        elif scenario == "flaky" and seen.attempts <= int(arg):
            await _abort(context, grpc.StatusCode.UNAVAILABLE)
        elif scenario == "flaky":
            for message in _count(request, 2):
                yield message
        elif scenario == "busy-ms" and seen.attempts == 1:  # a full queue, with a sub-second retry hint
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, MESSAGES[grpc.StatusCode.RESOURCE_EXHAUSTED],
                                trailing_metadata=(("retry-after", "1"), ("retry-after-ms", arg)))
        elif scenario == "busy-ms":
            for message in _count(request, 2):
                yield message
        elif scenario == "busy-bare":  # a full queue, without a retry hint
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, MESSAGES[grpc.StatusCode.RESOURCE_EXHAUSTED])
        elif scenario == "token-then":
            yield _response(request, [100], first=True, last=False)
            await _abort(context, grpc.StatusCode[arg])
        elif scenario == "hang":
            yield _response(request, [100], first=True, last=False)
            await _wait_for_cancellation(seen)
        elif scenario == "silent":
            await _wait_for_cancellation(seen)

    async def ListModels(self, request, context):
        self.models_calls += 1
        if self.models_failures:
            await _abort(context, self.models_failures.pop(0))
        card = gateway_pb2.ModelCard(id="smol", max_model_len=8192, vocab_size=49152, has_chat_template=True,
                                     created=1700000000, owned_by="tandem", resident=True, resident_workers=2)
        return gateway_pb2.ListModelsResponse(models=[card])


async def _wait_for_cancellation(seen: Seen) -> None:
    """Sleeps until grpc cancels the handler (client cancelled, deadline passed), and records it."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        seen.cancelled.set()
        raise


def _count(request: gateway_pb2.GenerateRequest, n: int) -> Iterator[gateway_pb2.GenerateResponse]:
    for i in range(n):
        yield _response(request, [100 + i], first=i == 0, last=i == n - 1)


def _response(request: gateway_pb2.GenerateRequest, token_ids: list[int], *, first: bool,
              last: bool) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(token_ids=token_ids, text="".join(f"t{t} " for t in token_ids))
    if first:
        msg.request_id, msg.trace_id = request.request_id or "auto", TRACE_ID
    if request.sampling.HasField("logprobs"):
        msg.logprobs.extend(common_pb2.TokenLogprob(
            token_id=t, logprob=-0.5, top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=-0.5)])
            for t in token_ids)
    if last:
        msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=len(token_ids)))
        msg.timings.total_ms = 12.5
    return msg


def _chat_reply(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResponse:
    text = "|".join(f"{m.role}={m.content}" for m in request.messages)
    return gateway_pb2.GenerateResponse(request_id=request.request_id, trace_id=TRACE_ID, token_ids=[7, 2],
                                        text=text, finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=2,
                                        usage=common_pb2.Usage(prompt_tokens=9, completion_tokens=2))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode) -> None:
    trailing = (("retry-after", "7"),) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else ()
    await context.abort(code, MESSAGES[code], trailing_metadata=trailing)


class ServerThread:
    """A grpc.aio server on its own event loop thread, so blocking clients can call it from the test."""

    def __init__(self, servicer: FakeGateway, credentials: grpc.ServerCredentials | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.port = self._run(self._start(servicer, credentials))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _start(self, servicer: FakeGateway, credentials: grpc.ServerCredentials | None) -> int:
        self._server = grpc.aio.server()
        gateway_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, self._server)
        address = "127.0.0.1:0"
        port = (self._server.add_secure_port(address, credentials) if credentials
                else self._server.add_insecure_port(address))
        await self._server.start()
        return port

    def stop(self) -> None:
        self._run(self._server.stop(None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def gateway() -> Iterator[FakeGateway]:
    servicer = FakeGateway()
    server = ServerThread(servicer)
    servicer.target = f"127.0.0.1:{server.port}"
    yield servicer
    server.stop()


def call(kind: str, target: str, method: str, *args: Any, client: dict[str, Any] | None = None,
         **kwargs: Any) -> Any:
    """`method` of a fresh Client or AsyncClient; a stream comes back drained into (chunks, error or None)."""
    options = {"retry": FAST_RETRY, **(client or {})}
    if kind == "sync":
        with Client(target, **options) as sdk:
            result = getattr(sdk, method)(*args, **kwargs)
            return _drain(result) if isinstance(result, ChunkStream) else result

    async def run() -> Any:
        async with AsyncClient(target, **options) as sdk:
            result = getattr(sdk, method)(*args, **kwargs)
            return await _adrain(result) if isinstance(result, AsyncChunkStream) else await result

    return asyncio.run(run())


def _drain(stream: ChunkStream) -> tuple[list[Chunk], errors.TandemError | None]:
    chunks: list[Chunk] = []
    try:
        chunks.extend(stream)
    except errors.TandemError as exc:
        return chunks, exc
    return chunks, None


async def _adrain(stream: AsyncChunkStream) -> tuple[list[Chunk], errors.TandemError | None]:
    chunks: list[Chunk] = []
    try:
        async for chunk in stream:
            chunks.append(chunk)
    except errors.TandemError as exc:
        return chunks, exc
    return chunks, None


# --- streaming and results -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_generate_streams_typed_chunks(gateway: FakeGateway, kind: str) -> None:
    chunks, error = call(kind, gateway.target, "generate", "count:3", request_id="r-stream", logprobs=1)
    assert error is None

    def logprobs(token: int) -> list[TokenLogprob]:
        return [TokenLogprob(token, -0.5, [TopLogprob(token, -0.5)])]

    assert chunks[:2] == [
        Chunk("t100 ", [100], logprobs(100), None, None, "r-stream", TRACE_ID),
        Chunk("t101 ", [101], logprobs(101), None, None, "r-stream", TRACE_ID),
    ]
    last = chunks[2]
    assert (last.text, last.token_ids, last.finish_reason, last.request_id, last.trace_id) == (
        "t102 ", [102], "length", "r-stream", TRACE_ID)
    assert last.usage == Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=1)
    assert last.usage.total_tokens == 6
    assert last.timings is not None and last.timings.total_ms == 12.5


@pytest.mark.parametrize("kind", KINDS)
def test_complete_joins_the_stream(gateway: FakeGateway, kind: str) -> None:
    completion = call(kind, gateway.target, "complete", "count:3", request_id="r-complete")
    assert completion.text == "t100 t101 t102 "
    assert completion.token_ids == [100, 101, 102]
    assert completion.logprobs == []
    assert (completion.finish_reason, completion.request_id, completion.trace_id) == (
        "length", "r-complete", TRACE_ID)
    assert completion.usage == Usage(prompt_tokens=5, cached_tokens=2, completion_tokens=1)


@pytest.mark.parametrize("kind", KINDS)
def test_chat_sends_messages_and_returns_the_reply(gateway: FakeGateway, kind: str) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    completion = call(kind, gateway.target, "chat", messages, request_id="r-chat", max_tokens=4)
    assert completion == Completion(text="system=be brief|user=hi", token_ids=[7, 2], logprobs=[],
                                    finish_reason="stop", usage=Usage(9, 0, 2), request_id="r-chat",
                                    trace_id=TRACE_ID, stop_reason=2)
    sent = gateway.seen("r-chat").requests[0]
    assert not sent.HasField("prompt") and sent.sampling.max_tokens == 4
    chunks, error = call(kind, gateway.target, "chat_stream", messages, request_id="r-chat-stream")
    assert error is None and [chunk.text for chunk in chunks] == ["system=be brief|user=hi"]


@pytest.mark.parametrize("kind", KINDS)
def test_token_ids_prompt_is_sent_as_ids(gateway: FakeGateway, kind: str) -> None:
    completion = call(kind, gateway.target, "complete", token_ids=[1, 2, 3], request_id="r-ids")
    assert completion.token_ids == [1, 2, 3]
    sent = gateway.seen("r-ids").requests[0]
    assert list(sent.token_ids) == [1, 2, 3] and not sent.HasField("prompt")


@pytest.mark.parametrize("kind", KINDS)
def test_models_lists_the_served_models(gateway: FakeGateway, kind: str) -> None:
    assert call(kind, gateway.target, "models") == [
        ModelInfo(id="smol", max_model_len=8192, vocab_size=49152, has_chat_template=True, created=1700000000,
                  owned_by="tandem", resident=True, resident_workers=2)]


def test_options_reach_the_server_and_unset_ones_stay_unset(gateway: FakeGateway) -> None:
    call("sync", gateway.target, "complete", "count:1", request_id="r-opts", model="smol", max_tokens=3,
         temperature=0.0, top_k=-1, seed=2**63, stop="END", stop_token_ids=[2, 3], ignore_eos=True, logprobs=0,
         presence_penalty=0.5, min_tokens=1, skip_special_tokens=False, cache_salt="tenant-a")
    sent = gateway.seen("r-opts").requests[0]
    assert (sent.model, sent.prompt, sent.cache_salt, sent.request_id) == ("smol", "count:1", "tenant-a", "r-opts")
    sampling = sent.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k, sampling.seed) == (3, 0.0, -1, 2**63)
    assert (list(sampling.stop), list(sampling.stop_token_ids), sampling.ignore_eos) == (["END"], [2, 3], True)
    assert (sampling.logprobs, sampling.presence_penalty, sampling.min_tokens) == (0, 0.5, 1)
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
    assert not any(sampling.HasField(name) for name in ("top_p", "min_p", "repetition_penalty", "frequency_penalty"))


def test_unknown_or_mistyped_option_fails_before_any_call(gateway: FakeGateway) -> None:
    with Client(gateway.target) as sdk:
        with pytest.raises(TypeError, match="unknown option.*max_token\\b"):
            sdk.generate("count:1", max_token=3)
        with pytest.raises(TypeError, match="option temperature='hot'"):
            sdk.generate("count:1", temperature="hot")
        with pytest.raises(TypeError, match=r"messages\[1\] must be a mapping with 'role' and 'content'"):
            sdk.chat([{"role": "user", "content": "hi"}, {"text": "no role"}])
    assert gateway.seen("auto").attempts == 0


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code", list(MESSAGES), ids=lambda code: code.name)
def test_each_status_code_raises_its_exception(gateway: FakeGateway, kind: str, code: grpc.StatusCode) -> None:
    chunks, error = call(kind, gateway.target, "generate", f"fail:{code.name}", request_id="r-fail",
                         client={"retry": RetryPolicy(max_attempts=1)})
    assert chunks == []
    assert type(error) is ERROR_CLASSES[code]
    assert (error.code, error.message, str(error)) == (code, MESSAGES[code], MESSAGES[code])
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert error.retry_after == 7.0
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert error.field == "sampling.top_p"


@pytest.mark.parametrize("kind", KINDS)
def test_models_errors_are_typed_too(gateway: FakeGateway, kind: str) -> None:
    gateway.models_failures = [grpc.StatusCode.UNAUTHENTICATED]
    with pytest.raises(errors.Unauthenticated, match="missing API key"):
        call(kind, gateway.target, "models")


# --- retries ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_unavailable_is_retried_before_the_first_chunk(gateway: FakeGateway, kind: str) -> None:
    completion = call(kind, gateway.target, "complete", "flaky:2", request_id="r-flaky")
    assert completion.token_ids == [100, 101]
    assert gateway.seen("r-flaky").attempts == 3


@pytest.mark.parametrize("kind", KINDS)
def test_unavailable_after_the_first_chunk_is_raised_not_retried(gateway: FakeGateway, kind: str) -> None:
    chunks, error = call(kind, gateway.target, "generate", "token-then:UNAVAILABLE", request_id="r-late")
    assert [chunk.token_ids for chunk in chunks] == [[100]]
    assert isinstance(error, errors.Unavailable) and error.message == MESSAGES[grpc.StatusCode.UNAVAILABLE]
    assert error.request_id == "r-late"
    assert gateway.seen("r-late").attempts == 1


@pytest.mark.parametrize("kind", KINDS)
def test_retries_stop_after_max_attempts(gateway: FakeGateway, kind: str) -> None:
    chunks, error = call(kind, gateway.target, "generate", "flaky:100", request_id="r-down")
    assert chunks == [] and isinstance(error, errors.Unavailable)
    assert gateway.seen("r-down").attempts == FAST_RETRY.max_attempts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", ["fail:INTERNAL", "fail:NOT_FOUND", "busy-bare"])
def test_other_codes_and_unhinted_overload_are_never_retried(gateway: FakeGateway, kind: str, prompt: str) -> None:
    chunks, error = call(kind, gateway.target, "generate", prompt, request_id="r-once")
    assert chunks == [] and type(error) is ERROR_CLASSES[grpc.StatusCode[prompt.partition(":")[2] or
                                                                          "RESOURCE_EXHAUSTED"]]
    assert gateway.seen("r-once").attempts == 1


@pytest.mark.parametrize("kind", KINDS)
def test_overload_is_retried_after_the_sub_second_hint(gateway: FakeGateway, kind: str) -> None:
    """retry-after-ms wins over the whole-second retry-after (1 s here) and over the policy's backoff."""
    completion = call(kind, gateway.target, "complete", "busy-ms:300", request_id="r-busy")
    assert completion.token_ids == [100, 101]
    first, second = gateway.seen("r-busy").arrivals
    assert second - first >= 0.3  # at least the hint (FAST_RETRY alone would wait 0.01 s)


def test_the_retry_wait_is_the_servers_hint_else_the_backoff() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.5, multiplier=2.0, jitter=0.0)
    deadline = Deadline(60)
    assert retry_delay(policy, 1, errors.Overloaded("full", retry_after=0.25), deadline) == 0.25
    assert retry_delay(policy, 1, errors.Unavailable("down", retry_after=0.125), deadline) == 0.125
    assert retry_delay(policy, 2, errors.Unavailable("down"), deadline) == 1.0
    assert retry_delay(policy, 1, errors.Overloaded("full"), deadline) is None
    assert retry_delay(policy, 3, errors.Unavailable("down", retry_after=0.1), deadline) is None  # out of attempts
    assert retry_delay(policy, 1, errors.Overloaded("full", retry_after=90), deadline) is None  # past the deadline


@pytest.mark.parametrize(("trailing", "hint"), [
    ((("retry-after", "2"), ("retry-after-ms", "1250")), 1.25),
    ((("retry-after", "2"),), 2.0),
    ((("retry-after-ms", "40"),), 0.04),
    ((("retry-after", "soon"),), None),
    ((), None),
])
def test_the_retry_hint_reads_milliseconds_first(trailing, hint) -> None:
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        assert errors.error_from_status(code, "no room", trailing).retry_after == hint


def test_retries_stay_within_the_call_deadline(gateway: FakeGateway) -> None:
    # Attempts at about 0 s, 1 s, 2 s; a fourth would start after the 3 s deadline. A second attempt
    # needs the first to fail within 2 s (0.4 s apart in a 1 s deadline left it 0.6 s under load).
    steady = RetryPolicy(max_attempts=100, initial_backoff=1.0, multiplier=1.0, jitter=0.0)
    chunks, error = call("sync", gateway.target, "generate", "flaky:100", request_id="r-deadline",
                         timeout=3.0, client={"retry": steady})
    assert isinstance(error, errors.Unavailable)
    # Three when the machine keeps up; fewer when it lags, never the 100 allowed.
    assert 1 < gateway.seen("r-deadline").attempts <= 3


@pytest.mark.parametrize("kind", KINDS)
def test_models_retries_unavailable(gateway: FakeGateway, kind: str) -> None:
    gateway.models_failures = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    assert [model.id for model in call(kind, gateway.target, "models")] == ["smol"]
    assert gateway.models_calls == 3


def test_unreachable_server_is_unavailable_after_retries() -> None:
    with Client("127.0.0.1:1", retry=FAST_RETRY, timeout=5) as sdk:
        with pytest.raises(errors.Unavailable):
            sdk.complete("count:1")


# --- deadlines and cancellation --------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_deadline_exceeded(gateway: FakeGateway, kind: str) -> None:
    started = time.monotonic()
    chunks, error = call(kind, gateway.target, "generate", "silent", request_id="r-slow", timeout=0.3)
    assert chunks == [] and isinstance(error, errors.DeadlineExceeded)
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started >= 0.3  # not before the deadline (a loaded machine only adds time)
    assert gateway.seen("r-slow").cancelled.wait(timeout=DEADLINE_S)


def test_client_default_timeout_applies(gateway: FakeGateway) -> None:
    chunks, error = call("sync", gateway.target, "generate", "silent", request_id="r-default",
                         client={"timeout": 0.3})
    assert isinstance(error, errors.DeadlineExceeded)


def test_breaking_out_of_the_loop_cancels_the_server_call(gateway: FakeGateway) -> None:
    with Client(gateway.target) as sdk:
        for chunk in sdk.generate("hang", request_id="r-break"):
            assert chunk.token_ids == [100]
            break
        assert gateway.seen("r-break").cancelled.wait(timeout=DEADLINE_S)


def test_closing_the_stream_cancels_the_server_call(gateway: FakeGateway) -> None:
    with Client(gateway.target) as sdk:
        with sdk.generate("hang", request_id="r-with") as stream:
            assert next(stream).token_ids == [100]
        assert gateway.seen("r-with").cancelled.wait(timeout=DEADLINE_S)
        stream = sdk.generate("hang", request_id="r-close")
        next(stream)
        stream.close()
        assert gateway.seen("r-close").cancelled.wait(timeout=DEADLINE_S)
        with pytest.raises(StopIteration):
            next(stream)


async def _cancelled(gateway: FakeGateway, request_id: str) -> bool:
    return await asyncio.to_thread(gateway.seen(request_id).cancelled.wait, DEADLINE_S)


async def test_async_breaking_out_of_the_loop_cancels_the_server_call(gateway: FakeGateway) -> None:
    async with AsyncClient(gateway.target) as sdk:
        async for chunk in sdk.generate("hang", request_id="r-abreak"):
            assert chunk.token_ids == [100]
            break
        assert await _cancelled(gateway, "r-abreak")


async def test_async_closing_the_stream_cancels_the_server_call(gateway: FakeGateway) -> None:
    async with AsyncClient(gateway.target) as sdk:
        async with sdk.generate("hang", request_id="r-awith") as stream:
            assert (await anext(stream)).token_ids == [100]
        assert await _cancelled(gateway, "r-awith")


async def test_async_task_cancellation_cancels_the_server_call(gateway: FakeGateway) -> None:
    async with AsyncClient(gateway.target) as sdk:
        async def consume() -> None:
            async for _ in sdk.generate("hang", request_id="r-atask"):
                pass

        task = asyncio.create_task(consume())
        await eventually(lambda: gateway.seen("r-atask").attempts, "the call at the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _cancelled(gateway, "r-atask")


# --- credentials -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_api_key_is_sent_as_bearer_metadata(gateway: FakeGateway, kind: str) -> None:
    call(kind, gateway.target, "complete", "count:1", request_id="r-key", client={"api_key": "k1"})
    assert gateway.seen("r-key").metadata[0]["authorization"] == "Bearer k1"


def test_api_key_defaults_to_the_environment(gateway: FakeGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    call("sync", gateway.target, "complete", "count:1", request_id="r-env")
    monkeypatch.delenv("TANDEM_API_KEY")
    call("sync", gateway.target, "complete", "count:1", request_id="r-nokey")
    assert gateway.seen("r-env").metadata[0]["authorization"] == "Bearer from-env"
    assert "authorization" not in gateway.seen("r-nokey").metadata[0]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A self-signed certificate for localhost / 127.0.0.1 and its key (PEM)."""
    folder = tmp_path_factory.mktemp("tls")
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                        "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
                       check=True, capture_output=True)
    except FileNotFoundError:
        pytest.skip("openssl is not installed")
    return (folder / "cert.pem").read_bytes(), (folder / "key.pem").read_bytes()


@pytest.fixture
def tls_gateway(certificate: tuple[bytes, bytes]) -> Iterator[FakeGateway]:
    cert, key = certificate
    servicer = FakeGateway()
    server = ServerThread(servicer, grpc.ssl_server_credentials([(key, cert)]))
    servicer.target = f"127.0.0.1:{server.port}"
    yield servicer
    server.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_tls_with_custom_root_certificates(tls_gateway: FakeGateway, certificate: tuple[bytes, bytes],
                                           kind: str) -> None:
    tls = TLSConfig(root_certificates=certificate[0])
    completion = call(kind, tls_gateway.target, "complete", "count:1", client={"tls": tls, "api_key": "k"})
    assert completion.token_ids == [100]


def test_plaintext_client_cannot_reach_a_tls_server(tls_gateway: FakeGateway) -> None:
    chunks, error = call("sync", tls_gateway.target, "generate", "count:1", client={"timeout": 5})
    assert isinstance(error, errors.Unavailable)


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.create(tmp_path_factory.mktemp("sdk-ca"))


@pytest.fixture
def mtls_gateway(authority: CertificateAuthority, tmp_path: Path) -> Iterator[FakeGateway]:
    """A gateway that asks every client for a certificate its CA signed."""
    ca, cert, key = authority.issue(tmp_path, "gateway").pem()
    servicer = FakeGateway()
    server = ServerThread(servicer, grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                                require_client_auth=True))
    servicer.target = f"127.0.0.1:{server.port}"
    yield servicer
    server.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_mutual_tls_with_a_ca_a_client_certificate_and_a_key(mtls_gateway: FakeGateway, authority, tmp_path: Path,
                                                             kind: str) -> None:
    issued = authority.issue(tmp_path, "sdk-client")
    tls = TLSConfig.from_files(ca=issued.ca, cert=issued.cert, key=issued.key)
    ca, cert, key = issued.pem()
    assert tls == TLSConfig(root_certificates=ca, certificate_chain=cert, private_key=key)
    completion = call(kind, mtls_gateway.target, "complete", "count:1", client={"tls": tls})
    assert completion.token_ids == [100]
    without_certificate = TLSConfig.from_files(ca=issued.ca)
    chunks, error = call(kind, mtls_gateway.target, "generate", "count:1", client={"tls": without_certificate,
                                                                                   "timeout": 5})
    assert chunks == [] and type(error) is errors.Unavailable


# --- packaging -------------------------------------------------------------------------------------


def test_sdk_is_lazy_and_independent_of_services() -> None:
    script = ("import sys, tandem; assert 'grpc' not in sys.modules, 'import tandem pulled grpc in'; "
              "tandem.Client; assert not [m for m in sys.modules if m.split('.')[0] == 'services'], 'services'")
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
