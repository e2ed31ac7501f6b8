"""Both doors of the gateway (gRPC and HTTP, over one pipeline) against a fake scheduler on loopback:
the same request limits with the same messages, tokenization off the event loop and bounded,
health following the workers the scheduler reports, and what clients are told when upstream fails.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.errors import Overloaded, TandemError, Unauthenticated, Unavailable
from services.common.grpc_server import GrpcServer, create_server
from services.common.tokenizer import TextCodec
from services.common.tracing import setup_tracing
from services.gateway import client_errors
from services.gateway.generation import GenerationPipeline
from services.gateway.health import can_serve, follow_scheduler_health
from services.gateway.http_app import HttpConfig, create_http_app, set_serving
from services.gateway.prompt_encoder import PromptEncoder
from services.gateway.request import GenerationRequest, ServedModel
from services.gateway.servicer import GenerateServicer
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.placing_scheduler import PlacingScheduler
from tests.waiting import DEADLINE_S, eventually, eventually_async

MODEL = "SmolLM2-135M-Instruct"
INTERNAL_TOKEN = "internal-secret"
GATED_CHARS = 1000  # prompts at least this long wait at the codec's gate, when it is closed
REPLY = [504, 3458, 30]  # the fake scheduler's tokens


class GatedTokenizer:
    """The codec's Rust tokenizer, except that encoding a long text waits for `gate` (when set)
    inside the tokenizer call, where a lock around it would be held, and it counts who is encoding."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.gate: threading.Event | None = None

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def encode_batch(self, texts: list[str], **kwargs):
        if self.gate is None or len(texts[0]) < GATED_CHARS:
            return self._backend.encode_batch(texts, **kwargs)
        with self.counting:
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.seen.append(texts[0])
        self.entered.set()
        try:
            if not self.gate.wait(DEADLINE_S):
                raise TimeoutError("the test never opened the gate")
            return self._backend.encode_batch(texts, **kwargs)
        finally:
            with self.counting:
                self.active -= 1

    def close_gate(self) -> threading.Event:
        self.gate, self.entered, self.counting = threading.Event(), threading.Event(), threading.Lock()
        self.active, self.peak, self.seen = 0, 0, []
        return self.gate


class FakeScheduler(PlacingScheduler):
    """Submit replies REPLY (or raises `fail`); Stats lists `workers`."""

    def __init__(self) -> None:
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.fail: TandemError | None = None
        self.workers: list[scheduler_pb2.WorkerStatus] = []

    async def events(self, request, context) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.submits.append(request)
        if self.fail is not None:
            raise self.fail
        yield scheduler_pb2.TokenEvent(
            request_id=request.request_id, token_ids=REPLY, finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.token_ids), completion_tokens=len(REPLY)))

    async def Stats(self, request, context) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(workers=self.workers)


def worker(role: int, model: str = MODEL) -> scheduler_pb2.WorkerStatus:
    return scheduler_pb2.WorkerStatus(info=scheduler_pb2.WorkerInfo(worker_id=f"w-{role}", role=role, model=model))


PREFILL, DECODE, COLOCATED = (worker(common_pb2.WORKER_ROLE_PREFILL), worker(common_pb2.WORKER_ROLE_DECODE),
                              worker(common_pb2.WORKER_ROLE_COLOCATED))


@dataclass(slots=True)
class Doors:
    scheduler: FakeScheduler
    scheduler_server: GrpcServer
    upstream: grpc.aio.Channel
    gateway: GrpcServer
    channel: grpc.aio.Channel
    app: FastAPI
    http: httpx.AsyncClient
    spans: InMemorySpanExporter

    def generate(self, request_id: str = "", **fields) -> grpc.aio.UnaryStreamCall:
        stub = gateway_pb2_grpc.GenerateServiceStub(self.channel)
        return stub.Generate(gateway_pb2.GenerateRequest(request_id=request_id, **fields), timeout=DEADLINE_S)


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    codec = TextCodec.from_model_dir(default_model_dir)
    codec._backend = GatedTokenizer(codec._backend)
    return codec


@pytest.fixture
def tokenizer(codec: TextCodec) -> Iterator[GatedTokenizer]:
    """The codec's gated tokenizer; its gate is open again after the test."""
    yield codec._backend
    if codec._backend.gate is not None:
        codec._backend.gate.set()
    codec._backend.gate = None


@pytest.fixture
async def doors(codec: TextCodec, default_model_dir: Path) -> AsyncIterator[Doors]:
    spans = InMemorySpanExporter()
    tracing = setup_tracing("gateway", exporter=spans, install_global=False)
    scheduler = FakeScheduler()
    scheduler_server = create_server("127.0.0.1", 0, internal_token=INTERNAL_TOKEN)
    scheduler.serve_on(scheduler_server)
    await scheduler_server.start()
    scheduler.placed_at(scheduler_server.port)
    await scheduler_server.mark_serving()
    upstream = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_server.port}")
    model = ServedModel.from_model_dir(default_model_dir, codec)
    pipeline = GenerationPipeline(codec, model, upstream, INTERNAL_TOKEN,
                                  tracing.get_tracer("test"))
    gateway = create_server("127.0.0.1", 0)
    gateway.add_service("tandem.v1.GenerateService", gateway_pb2_grpc.add_GenerateServiceServicer_to_server,
                        GenerateServicer(pipeline, default_timeout=DEADLINE_S))
    await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    app = create_http_app(pipeline, HttpConfig(max_body_bytes=16 << 20))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tandem") as http:
        try:
            yield Doors(scheduler, scheduler_server, upstream, gateway, channel, app, http, spans)
        finally:
            await channel.close()
            await gateway.stop(0)
            await upstream.close()
            await scheduler_server.stop(0)
            pipeline.close()
            tracing.shutdown()


async def rpc_error(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [response async for response in call]
    return caught.value


# --- the same limits on both doors ------------------------------------------------------------

CHAT = [{"role": "user", "content": "Hi"}]
# (gRPC request fields, the same request as an HTTP /v1/completions body, field, exact message)
OVER_LIMITS = [
    ({"prompt": "Hi", "sampling": common_pb2.SamplingParams(stop=["x"] * 100_000)},
     {"prompt": "Hi", "stop": ["x"] * 100_000},
     "stop", "stop: has 100000 stop strings; this server accepts at most 16"),
    ({"prompt": "Hi", "sampling": common_pb2.SamplingParams(stop=["x" * 5_000_000])},
     {"prompt": "Hi", "stop": ["x" * 5_000_000]},
     "stop", "stop: stop string 0 has 5000000 characters; this server accepts at most 1024"),
    ({"prompt": "x" * 200_001}, {"prompt": "x" * 200_001},
     "prompt", "prompt: has 200001 characters; this server accepts at most 200000"),
    ({"prompt": "x" * 10_000_000}, {"prompt": "x" * 10_000_000},
     "prompt", "prompt: has 10000000 characters; this server accepts at most 200000"),
    ({"prompt": "Hi", "sampling": common_pb2.SamplingParams(logprobs=21)}, {"prompt": "Hi", "logprobs": 21},
     "logprobs", "logprobs: must be in [0, 20] or unset, got 21"),
    ({"prompt": "Hi", "sampling": common_pb2.SamplingParams(stop_token_ids=[2] * 257)},
     {"prompt": "Hi", "stop_token_ids": [2] * 257},
     "stop_token_ids", "stop_token_ids: has 257 ids; this server accepts at most 256"),
    ({"prompt": "Hi", "cache_salt": "s" * 257}, {"prompt": "Hi", "cache_salt": "s" * 257},
     "cache_salt", "cache_salt: has 257 characters; this server accepts at most 256"),
]
# The same for chat: gRPC messages and an HTTP /v1/chat/completions body.
CHAT_OVER_LIMITS = [
    ([{"role": "user", "content": "x" * 199_997}],
     "messages", "messages: has 200001 characters in roles and contents; this server accepts at most 200000"),
    (CHAT * 1025, "messages", "messages: has 1025 messages; this server accepts at most 1024"),
]


@pytest.mark.parametrize(("fields", "body", "field", "message"), OVER_LIMITS,
                         ids=[f"{case[2]}-{i}" for i, case in enumerate(OVER_LIMITS)])
async def test_a_request_over_a_limit_gets_the_same_message_on_both_doors(doors, fields, body, field, message):
    call = doors.generate(request_id="big-1", **fields)
    error = await rpc_error(call)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert dict(error.trailing_metadata())["x-request-id"] == "big-1"  # the initial metadata may be dropped
    response = await doors.http.post("/v1/completions", json=body, headers={"x-request-id": "big-2"})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": field,
                                        "code": "invalid_request"}
    assert response.headers["x-request-id"] == "big-2"
    assert doors.scheduler.submits == []


@pytest.mark.parametrize(("messages", "field", "message"), CHAT_OVER_LIMITS, ids=["characters", "count"])
async def test_chat_over_a_limit_gets_the_same_message_on_both_doors(doors, messages, field, message):
    error = await rpc_error(doors.generate(messages=[gateway_pb2.ChatMessage(**m) for m in messages]))
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    response = await doors.http.post("/v1/chat/completions", json={"messages": messages})
    assert (response.status_code, response.json()["error"]["message"]) == (400, message)
    assert response.json()["error"]["param"] == field
    assert doors.scheduler.submits == []


async def test_n_over_its_limit_is_400(doors):
    response = await doors.http.post("/v1/completions", json={"prompt": "Hi", "n": 17})
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["message"]) == (
        "n", "n: must be in [1, 16], got 17")
    assert doors.scheduler.submits == []


async def test_token_ids_beyond_the_context_are_refused_by_their_count(doors):
    error = await rpc_error(doors.generate(token_ids=[10**6] * 8192))  # out of vocabulary too: the count comes first
    assert (error.code(), error.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "token_ids: the prompt has 8192 tokens but the model's context is 8192 tokens, including at least one "
        "generated token; shorten it to at most 8191 tokens")


async def test_requests_within_the_limits_are_served_by_both_doors(doors):
    responses = [r async for r in doors.generate(prompt="x" * 20_000, sampling=common_pb2.SamplingParams(
        stop=["y" * 1024] * 16, stop_token_ids=[2] * 256, logprobs=20))]
    assert [t for r in responses for t in r.token_ids] == REPLY
    response = await doors.http.post("/v1/chat/completions", json={"messages": CHAT * 1024, "n": 1})
    assert response.status_code == 200
    assert len(doors.scheduler.submits) == 2


# --- tokenization off the event loop --------------------------------------------------------------


async def test_health_and_other_streams_answer_while_a_long_prompt_tokenizes(doors, tokenizer):
    await doors.gateway.mark_serving()
    set_serving(doors.app, True)
    gate = tokenizer.close_gate()
    long = asyncio.create_task(_collect(doors.generate(prompt="x" * 28_000, request_id="long-1")))
    await eventually(tokenizer.entered.is_set, "the long prompt inside the tokenizer")
    # The long prompt is being tokenized now, and stays so until the gate opens.
    health = await health_pb2_grpc.HealthStub(doors.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert (await doors.http.get("/health")).status_code == 200
    short = await _collect(doors.generate(prompt="Hi", request_id="short-1"))
    assert [t for r in short for t in r.token_ids] == REPLY
    assert not long.done()
    gate.set()
    assert [t for r in await long for t in r.token_ids] == REPLY
    assert [s.request_id for s in doors.scheduler.submits] == ["short-1", "long-1"]


async def test_at_most_the_pool_size_tokenize_at_once_and_a_request_that_left_never_does(codec, tokenizer):
    encoder = PromptEncoder(threads=2)
    texts = [f"{i} " + "word " * 300 for i in range(4)]
    expected = [codec.encode(texts[i]) for i in (0, 1, 3)]
    gate = tokenizer.close_gate()
    try:
        first, second = (asyncio.create_task(encoder.encode(GenerationRequest(prompt=t), "prompt", codec))
                         for t in texts[:2])
        await eventually(lambda: tokenizer.active == 2, "two prompts inside the tokenizer")
        left = asyncio.create_task(encoder.encode(GenerationRequest(prompt=texts[2]), "prompt", codec))
        last = asyncio.create_task(encoder.encode(GenerationRequest(prompt=texts[3]), "prompt", codec))
        await asyncio.sleep(0)  # both wait for a slot now
        left.cancel()
        gate.set()
        assert await asyncio.gather(first, second, last) == expected
        assert tokenizer.peak == 2 and sorted(tokenizer.seen) == sorted(texts[i] for i in (0, 1, 3))
        assert left.cancelled()
    finally:
        encoder.close()


async def _collect(call: grpc.aio.UnaryStreamCall) -> list[gateway_pb2.GenerateResponse]:
    return [response async for response in call]


# --- health follows the workers -----------------------------------------------------------------


@pytest.mark.parametrize(("workers", "model", "expected"), [
    ([], MODEL, False),
    ([PREFILL], MODEL, False),
    ([DECODE], MODEL, False),
    ([PREFILL, DECODE], MODEL, True),
    ([COLOCATED], MODEL, True),
    ([worker(common_pb2.WORKER_ROLE_COLOCATED, "other-model")], MODEL, False),
    ([worker(common_pb2.WORKER_ROLE_COLOCATED, "other-model")], "", True),
    ([PREFILL, worker(common_pb2.WORKER_ROLE_DECODE, "other-model")], MODEL, False),
])
def test_the_workers_that_can_serve_a_model(workers, model, expected):
    assert can_serve(scheduler_pb2.SchedulerStats(workers=workers), model) is expected


async def test_health_is_not_serving_while_no_worker_can_take_requests_and_back_when_one_can(doors):
    health = health_pb2_grpc.HealthStub(doors.channel)

    async def status() -> tuple[int, int]:
        grpc_status = (await health.Check(health_pb2.HealthCheckRequest())).status
        return grpc_status, (await doors.http.get("/health")).status_code

    def now(expected: tuple[int, int]):
        return lambda: _returns(status, expected)

    serving = (health_pb2.HealthCheckResponse.SERVING, 200)
    not_serving = (health_pb2.HealthCheckResponse.NOT_SERVING, 503)
    follower = asyncio.create_task(follow_scheduler_health([doors.upstream], doors.gateway, doors.app, model=MODEL,
                                                           internal_token=INTERNAL_TOKEN))
    try:
        doors.scheduler.workers = [PREFILL, DECODE]
        await eventually_async(now(serving), "SERVING with a prefill and a decode worker")
        doors.scheduler.workers = [PREFILL]  # the decode worker died
        await eventually_async(now(not_serving), "NOT_SERVING without a decode worker")
        response = await doors.http.get("/health")
        assert (response.headers["retry-after"], response.json()) == ("1", {"status": "not_serving"})
        doors.scheduler.workers = [COLOCATED]
        await eventually_async(now(serving), "SERVING again with a colocated worker")
        await doors.scheduler_server.stop(0)  # the scheduler is gone
        await eventually_async(now(not_serving), "NOT_SERVING without a scheduler")
    finally:
        follower.cancel()


async def _returns(probe, expected) -> bool:
    return await probe() == expected


# --- what clients are told when upstream fails ------------------------------------------------


@pytest.mark.parametrize(("failure", "code", "status", "message", "hint"), [
    (Unavailable("no live decode worker serves model 'x' (decode-0 at 10.1.2.3:50061 was lost)", retry_after=2.5),
     grpc.StatusCode.UNAVAILABLE, 503, client_errors.NO_WORKER, ("3", "2500")),
    (Unavailable("failed to connect to all addresses; last error: 10.1.2.3:50052"),
     grpc.StatusCode.UNAVAILABLE, 503, client_errors.NO_WORKER, ("1", "1000")),
    (Overloaded("the scheduler's waiting queue is full (256 requests) at 10.1.2.3", retry_after=0.4),
     grpc.StatusCode.RESOURCE_EXHAUSTED, 429, client_errors.BUSY, ("1", "400")),
    (Unauthenticated("missing credentials: send `x-tandem-internal-token` 10.1.2.3"),
     grpc.StatusCode.INTERNAL, 500, client_errors.INTERNAL, None),
])
async def test_upstream_failures_reach_clients_in_stable_words_with_the_request_id_and_hint(
        doors, failure, code, status, message, hint):
    doors.scheduler.fail = failure
    call = doors.generate(prompt="Hi", request_id="fails-1")
    error = await rpc_error(call)
    assert (error.code(), error.details()) == (code, f"{message} (request fails-1)")
    assert dict(error.trailing_metadata())["x-request-id"] == "fails-1"
    response = await doors.http.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-id": "fails-2"})
    assert (response.status_code, response.json()["error"]["message"]) == (status, f"{message} (request fails-2)")
    trailing = dict(error.trailing_metadata())
    if hint is not None:
        assert (trailing["retry-after"], trailing["retry-after-ms"]) == hint
        assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == hint
    else:
        assert "retry-after" not in trailing and "retry-after" not in response.headers
    spans = await eventually(lambda: len(doors.spans.get_finished_spans()) == 2 and doors.spans.get_finished_spans(),
                             "both requests' spans")
    assert all(failure.message in span.status.description for span in spans)  # the detail is for the operator
