"""The gateway's gRPC door against a scripted scheduler on loopback: the stream's first and last
messages, errors relayed with their status, upstream cancellation (client gone, stop string),
validation before any upstream work, auth, ListModels, and health following the scheduler."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.errors import DeadlineExceeded, Overloaded, Unavailable
from services.common.grpc_server import create_server
from services.common.tokenizer import TextCodec
from services.common.spans import gateway_span_name
from services.common.tracing import Attr, setup_tracing
from services.gateway import client_errors
from services.gateway.generation import GenerationPipeline
from services.gateway.main import GENERATE_SERVICE, follow_scheduler_health
from services.gateway.request import ServedModel, salt_for_key
from services.gateway.servicer import GenerateServicer
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from tests.placing_scheduler import PlacingScheduler
from tests.waiting import eventually, eventually_async

API_KEY = "k-test"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
TEXT = "The capital of France is Paris. It is a big city with many museums."


class ScriptedScheduler(PlacingScheduler):
    """Submit streams the tokens of TEXT one event each, `delay` seconds apart (with `hold_after` set,
    that many, then nothing until the call is cancelled), or fails as `cache_salt` asks; it records
    the requests, their metadata and deadlines, and which calls ended cancelled."""

    def __init__(self, codec: TextCodec) -> None:
        self.output = codec.encode(TEXT)
        self.requests: list[scheduler_pb2.SubmitRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.remaining: list[float | None] = []
        self.cancelled: list[str] = []
        self.delay = 0.0
        self.hold_after: int | None = None
        self.workers = [scheduler_pb2.WorkerStatus(info=scheduler_pb2.WorkerInfo(
            worker_id="colocated-0", role=common_pb2.WORKER_ROLE_COLOCATED, model="SmolLM2-135M-Instruct"))]

    async def Stats(self, request, context) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(workers=self.workers)

    async def events(self, request, context) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        self.remaining.append(context.time_remaining())
        failures = {"overloaded": Overloaded("waiting queue full (2 requests)", retry_after=3),
                    "unavailable": Unavailable("decode worker decode-0 was lost"),
                    "deadline": DeadlineExceeded("deadline passed while queued")}
        if request.cache_salt in failures:
            raise failures[request.cache_salt]
        try:
            count = min(len(self.output), request.sampling.max_tokens)
            for offset in range(count):
                await asyncio.sleep(self.delay)
                if offset == self.hold_after:
                    await asyncio.Event().wait()
                event = scheduler_pb2.TokenEvent(request_id=request.request_id, output_offset=offset,
                                                 token_ids=[self.output[offset]], worker_id="decode-0")
                if offset == 0:
                    event.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.token_ids), cached_tokens=16))
                if offset == count - 1:
                    event.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    event.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.token_ids), cached_tokens=16,
                                                          completion_tokens=count))
                yield event
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def mesh(codec, default_model_dir, spans):
    """(scheduler servicer, scheduler server, gateway server, gateway channel)."""
    tracing = setup_tracing("gateway", exporter=spans, install_global=False)
    scheduler = ScriptedScheduler(codec)
    scheduler_server = create_server("127.0.0.1", 0)
    scheduler.serve_on(scheduler_server)
    await scheduler_server.start()
    scheduler.placed_at(scheduler_server.port)
    await scheduler_server.mark_serving()
    upstream = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_server.port}")
    model = ServedModel.from_model_dir(default_model_dir, codec)
    pipeline = GenerationPipeline(codec, model, upstream, "internal-secret",
                                  tracing.get_tracer("test"))
    gateway = create_server("127.0.0.1", 0, api_keys=[API_KEY])
    gateway.add_service(GENERATE_SERVICE, gateway_pb2_grpc.add_GenerateServiceServicer_to_server,
                        GenerateServicer(pipeline, default_timeout=30.0, tenant_salts=True))
    await gateway.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield scheduler, scheduler_server, gateway, channel
    finally:
        await channel.close()
        await gateway.stop(0)
        await upstream.close()
        await scheduler_server.stop(0)
        tracing.shutdown()


def generate(channel, timeout: float = 10.0, metadata=AUTH, **fields):
    fields.setdefault("prompt", "Hi")
    stub = gateway_pb2_grpc.GenerateServiceStub(channel)
    return stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout, metadata=metadata)


async def test_stream_first_message_has_ids_last_has_finish_and_usage(mesh, codec, spans):
    scheduler, _, _, channel = mesh
    call = generate(channel, sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0), request_id="my-1")
    responses = [r async for r in call]
    assert (responses[0].request_id, len(responses[0].trace_id)) == ("my-1", 32)
    assert all(r.request_id == "" and r.trace_id == "" for r in responses[1:])
    assert [t for r in responses for t in r.token_ids] == scheduler.output[:5]
    assert "".join(r.text for r in responses) == codec.decode(scheduler.output[:5])
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage == common_pb2.Usage(prompt_tokens=1, cached_tokens=16, completion_tokens=5)
    assert dict(await call.initial_metadata())["x-request-id"] == "my-1"
    submitted, metadata = scheduler.requests[0], scheduler.metadata[0]
    assert list(submitted.token_ids) == codec.encode("Hi")
    assert (submitted.request_id, submitted.model, submitted.trace_id) == ("my-1", "SmolLM2-135M-Instruct",
                                                                           responses[0].trace_id)
    assert submitted.sampling.max_tokens == 5 and submitted.sampling.HasField("temperature")
    assert metadata["traceparent"].split("-")[1] == responses[0].trace_id
    assert metadata["x-tandem-internal-token"] == "internal-secret"
    # The client's 10 s deadline passed on, not the default 30 s. gRPC rounds a timeout up when it
    # encodes it on the wire (10.0987 s was seen), hence the half second above 10.
    assert 0 < scheduler.remaining[0] <= 10.5
    (span,) = await eventually(spans.get_finished_spans, "the gateway's span")
    root = gateway_span_name("text_completion", "SmolLM2-135M-Instruct")
    assert (span.name, format(span.context.trace_id, "032x")) == (root, responses[0].trace_id)
    assert span.attributes[Attr.REQUEST_ID] == "my-1"
    assert span.attributes[Attr.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert span.attributes[Attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 5


async def test_chat_messages_use_the_template(mesh, codec):
    scheduler, _, _, channel = mesh
    messages = [gateway_pb2.ChatMessage(role="user", content="Hi")]
    [r async for r in generate(channel, prompt=None, messages=messages)]
    assert list(scheduler.requests[0].token_ids) == codec.apply_chat_template([{"role": "user", "content": "Hi"}])


async def test_stop_string_cuts_the_text_and_cancels_the_submit_call(mesh):
    scheduler, _, _, channel = mesh
    scheduler.delay = 0.02  # still generating when the stop string matches
    sampling = common_pb2.SamplingParams(max_tokens=100, stop=["is Paris."])
    responses = [r async for r in generate(channel, sampling=sampling, request_id="stop-1")]
    assert "".join(r.text for r in responses) == "The capital of France "
    assert (responses[-1].finish_reason, responses[-1].stop_string) == (common_pb2.FINISH_REASON_STOP, "is Paris.")
    assert responses[-1].usage.completion_tokens == len(responses[-1].token_ids) + sum(
        len(r.token_ids) for r in responses[:-1])
    assert responses[-1].usage.cached_tokens == 16
    await eventually(lambda: scheduler.cancelled == ["stop-1"], "the cancelled submit call")


async def test_client_gone_cancels_the_submit_call(mesh):
    scheduler, _, _, channel = mesh
    scheduler.hold_after = 1
    call = generate(channel, sampling=common_pb2.SamplingParams(max_tokens=100), request_id="gone-1")
    await call.read()
    call.cancel()
    await eventually(lambda: scheduler.cancelled == ["gone-1"], "the cancelled submit call")


@pytest.mark.parametrize(
    ("salt", "code", "details", "trailing"),
    [
        ("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, client_errors.BUSY, ("retry-after", "3")),
        ("unavailable", grpc.StatusCode.UNAVAILABLE, client_errors.NO_WORKER, ("retry-after", "1")),
        ("deadline", grpc.StatusCode.DEADLINE_EXCEEDED, client_errors.DEADLINE, None),
    ],
)
async def test_scheduler_errors_keep_their_status_and_hint_in_stable_words(mesh, salt, code, details, trailing):
    _, _, _, channel = mesh
    call = generate(channel, cache_salt=salt, request_id=f"{salt}-1")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert (caught.value.code(), caught.value.details()) == (code, f"{details} (request {salt}-1)")
    if trailing:
        assert trailing in tuple(caught.value.trailing_metadata())


async def test_invalid_field_fails_before_any_upstream_work(mesh):
    scheduler, _, _, channel = mesh
    call = generate(channel, sampling=common_pb2.SamplingParams(temperature=-1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "temperature: must be a finite number >= 0 (0 means greedy), got -1.0"
    call = generate(channel, prompt="x " * 9000)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.details().startswith("prompt: the prompt has 9001 tokens but the model's context is 8192")
    call = generate(channel, sampling=common_pb2.SamplingParams(prompt_logprobs=1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in call]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("sampling.prompt_logprobs: prompt logprobs are returned on the HTTP door")
    assert scheduler.requests == []
    assert len([r async for r in generate(channel)]) > 0  # the next valid request is served


async def test_unknown_model_is_not_found(mesh):
    _, _, _, channel = mesh
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in generate(channel, model="gpt-9")]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "SmolLM2-135M-Instruct" in caught.value.details()


async def test_bad_api_key_is_unauthenticated(mesh):
    _, _, _, channel = mesh
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in generate(channel, metadata=(("authorization", "Bearer nope"),))]
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_list_models(mesh):
    _, _, _, channel = mesh
    models = await gateway_pb2_grpc.GenerateServiceStub(channel).ListModels(
        gateway_pb2.ListModelsRequest(), metadata=AUTH)
    card = models.models[0]
    assert (card.id, card.max_model_len, card.vocab_size, card.has_chat_template, card.owned_by) == (
        "SmolLM2-135M-Instruct", 8192, 49152, True, "tandem")


async def test_health_follows_the_scheduler(mesh):
    _, scheduler_server, gateway, channel = mesh
    health = health_pb2_grpc.HealthStub(channel)

    async def status() -> int:
        return (await health.Check(health_pb2.HealthCheckRequest())).status

    async def serving() -> bool:
        return await status() == health_pb2.HealthCheckResponse.SERVING

    async def not_serving() -> bool:
        return await status() == health_pb2.HealthCheckResponse.NOT_SERVING

    assert await status() == health_pb2.HealthCheckResponse.NOT_SERVING
    upstream = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_server.port}")
    follower = asyncio.create_task(follow_scheduler_health([upstream], gateway))
    try:
        await eventually_async(serving, "the gateway SERVING")
        await scheduler_server.mark_not_serving()
        await eventually_async(not_serving, "the gateway NOT_SERVING")
    finally:
        follower.cancel()
        await upstream.close()


def test_gateway_never_imports_torch_or_the_runtime(default_model_dir):
    script = (
        "import sys\n"
        "from services.gateway.main import serve\n"
        "from services.common.tokenizer import TextCodec\n"
        "from services.gateway.request import ServedModel\n"
        f"ServedModel.from_model_dir({str(default_model_dir)!r}, TextCodec.from_model_dir({str(default_model_dir)!r}))\n"
        "loaded = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'services.runtime'))]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2], timeout=60)


async def test_cache_salt_defaults_to_the_callers_key_as_on_the_http_door(mesh):
    scheduler, _, _, channel = mesh
    [r async for r in generate(channel, sampling=common_pb2.SamplingParams(max_tokens=1))]
    [r async for r in generate(channel, sampling=common_pb2.SamplingParams(max_tokens=1), cache_salt="shared")]
    assert [r.cache_salt for r in scheduler.requests] == [salt_for_key(API_KEY), "shared"]
    assert len(salt_for_key(API_KEY)) == 32 and salt_for_key(None) == ""
