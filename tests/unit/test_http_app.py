"""The OpenAI-compatible HTTP bridge over the real gateway pipeline, against an in-test scheduler
servicer on loopback that replies with a known text: response shapes, SSE framing, n choices,
errors and limits, request ids, and cancellation when the client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Counter

from services.common.errors import DeadlineExceeded, Overloaded, TandemError, Unavailable
from services.common.tokenizer import TextCodec
from services.gateway import client_errors
from services.gateway.generation import GenerationPipeline
from services.gateway.http_app import HttpConfig, create_http_app, set_serving
from services.gateway.http_server import start_http
from services.gateway.limits import RequestLimits
from services.gateway.request import salt_for_key
from services.gateway.request import ServedModel
from services.common.wire import DEFAULT_MAX_TOKENS
from tandem.v1 import common_pb2, scheduler_pb2
from tests.placing_scheduler import PlacingScheduler
from tests.waiting import eventually

REPLY = " Paris is the capital of France. 한국어 🎉 ok"
PROMPT = "What is the capital of France?"
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def served_model(default_model_dir: Path, codec: TextCodec) -> ServedModel:
    return ServedModel.from_model_dir(default_model_dir, codec)


class FakeScheduler(PlacingScheduler):
    """Replies REPLY (prefixed " <seed>:" when a seed is set) then EOS, one token per event.

    Knobs: `fail` (raised before any token), `fail_after` ((k, error): raised after k tokens),
    `delay` (seconds before each token), `hold_after` (k: nothing after k tokens until the call is
    cancelled). `log` records "submit", "token", "cancelled" per request id.
    A prompt seen before reports its full 16-token blocks as cached.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.log: list[tuple[str, str]] = []
        self.fail: TandemError | None = None
        self.fail_after: tuple[int, TandemError] | None = None
        self.delay = 0.0
        self.hold_after: int | None = None
        self._seen: set[tuple[int, ...]] = set()

    def reply_ids(self, seed: int | None = None) -> list[int]:
        text = REPLY if seed is None else f" {seed}:{REPLY}"
        return self.codec.encode(text) + [self.codec.eos_token_ids[0]]

    async def events(self, request, context) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        rid = request.request_id
        self.submits.append(request)
        self.log.append(("submit", rid))
        if self.fail is not None:
            raise self.fail
        prompt = tuple(request.token_ids)
        cached = len(prompt) // 16 * 16 if prompt in self._seen else 0
        self._seen.add(prompt)
        seed = request.sampling.seed if request.sampling.HasField("seed") else None
        tokens = self.reply_ids(seed)[: request.sampling.max_tokens]
        try:
            for offset, token in enumerate(tokens):
                if self.fail_after is not None and offset == self.fail_after[0]:
                    raise self.fail_after[1]
                if self.delay:
                    await asyncio.sleep(self.delay)
                if offset == self.hold_after:
                    await asyncio.Event().wait()
                event = scheduler_pb2.TokenEvent(request_id=rid, output_offset=offset, token_ids=[token],
                                                 logprobs=_logprobs(token, request.sampling))
                if offset == len(tokens) - 1:
                    finished = token in self.codec.eos_token_ids
                    event.finish_reason = common_pb2.FINISH_REASON_STOP if finished else common_pb2.FINISH_REASON_LENGTH
                    event.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt), cached_tokens=cached,
                                                          completion_tokens=len(tokens)))
                self.log.append(("token", rid))
                yield event
        except asyncio.CancelledError:
            self.log.append(("cancelled", rid))
            raise

    def count(self, kind: str, rid: str) -> int:
        return self.log.count((kind, rid))


def _logprobs(token: int, sampling: common_pb2.SamplingParams) -> list[common_pb2.TokenLogprob]:
    if not sampling.HasField("logprobs"):
        return []
    top = [common_pb2.TopLogprob(token_id=token, logprob=-0.25),
           common_pb2.TopLogprob(token_id=token + 1, logprob=-2.0)]
    return [common_pb2.TokenLogprob(token_id=token, logprob=-0.25, top_logprobs=top[: sampling.logprobs])]


@pytest.fixture
async def scheduler(codec: TextCodec) -> AsyncIterator[tuple[FakeScheduler, grpc.aio.Channel]]:
    fake = FakeScheduler(codec)
    async with fake.served() as channel:
        yield fake, channel


@pytest.fixture
def fake(scheduler) -> FakeScheduler:
    return scheduler[0]


def _pipeline(codec, served_model, scheduler, limits: RequestLimits = RequestLimits()) -> GenerationPipeline:
    return GenerationPipeline(codec, served_model, scheduler[1], tracer=TracerProvider().get_tracer("test"),
                              limits=limits)


REGISTRY = CollectorRegistry()
Counter("tandem:test_total", "A metric the /metrics test finds.", registry=REGISTRY).inc(3)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tandem")


@pytest.fixture
async def client(codec, served_model, scheduler) -> AsyncIterator[httpx.AsyncClient]:
    limits = RequestLimits(max_prompt_chars=300, max_stop_strings=2, max_n=3)
    app = create_http_app(_pipeline(codec, served_model, scheduler, limits), HttpConfig(max_body_bytes=4096),
                          REGISTRY)
    async with _client(app) as client:
        client.app = app
        yield client


@pytest.fixture
async def keyed_client(codec, served_model, scheduler) -> AsyncIterator[httpx.AsyncClient]:
    app = create_http_app(_pipeline(codec, served_model, scheduler), HttpConfig(api_keys=(KEY, "sk-other")))
    async with _client(app) as client:
        yield client


def _events(raw: str) -> list[dict | str]:
    """The SSE body as its events; asserts the exact framing on the way."""
    assert raw.endswith("data: [DONE]\n\n")
    frames = raw.split("\n\n")
    assert frames[-1] == ""
    events: list[dict | str] = []
    for frame in frames[:-1]:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        data = frame[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events.count("[DONE]") == 1
    return events


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- responses -------------------------------------------------------------------------------


async def test_completion_response_as_vllm_shapes_it(client, fake, codec, served_model):
    response = await client.post("/v1/completions", json={"model": served_model.name, "prompt": PROMPT,
                                                          "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    body = response.json()
    assert body == {
        "id": f"cmpl-{request_id}", "object": "text_completion", "created": body["created"],
        "model": served_model.name,
        "choices": [{"index": 0, "text": codec.decode(fake.reply_ids()[:5]), "logprobs": None,
                     "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": len(codec.encode(PROMPT)), "completion_tokens": 5,
                  "total_tokens": len(codec.encode(PROMPT)) + 5, "prompt_tokens_details": {"cached_tokens": 0}},
    }
    (submit,) = fake.submits
    assert submit.request_id == request_id
    assert list(submit.token_ids) == codec.encode(PROMPT)
    assert submit.sampling.max_tokens == 5 and submit.sampling.temperature == 0
    assert submit.cache_salt == ""
    assert response.headers["x-trace-id"] == submit.trace_id and len(submit.trace_id) == 32
    assert int(submit.trace_id, 16) != 0


async def test_chat_response_and_cached_tokens_of_a_repeated_prompt(client, fake, codec, served_model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Capital of "},
                                             {"type": "text", "text": "France?"}]}]
    bodies = []
    for _ in range(2):
        response = await client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 64})
        assert response.status_code == 200
        bodies.append(response.json())
    template = codec.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Capital of France?"}])
    assert [list(s.token_ids) for s in fake.submits] == [template, template]
    first, second = bodies
    assert first["id"] == f"chatcmpl-{fake.submits[0].request_id}"
    assert first["object"] == "chat.completion"
    assert first["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None,
                                 "finish_reason": "stop", "stop_reason": codec.eos_token_ids[0]}]
    completion = len(fake.reply_ids())
    assert first["usage"]["completion_tokens"] == completion
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": len(template) // 16 * 16}


async def test_token_id_prompt_and_a_batch_of_one(client, fake):
    await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
    await client.post("/v1/completions", json={"prompt": ["Hello"], "max_tokens": 1})
    await client.post("/v1/completions", json={"prompt": [[8, 9]], "max_tokens": 1})
    assert [list(s.token_ids) for s in fake.submits] == [[5, 6, 7], [19556], [8, 9]]


async def test_sampling_fields_reach_the_scheduler(client, fake):
    response = await client.post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "seed": 42,
        "stop_token_ids": [11], "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "min_tokens": 2, "logprobs": 1, "user": "u1", "cache_salt": "tenant-a",
        "some_vendor_extra": {"ignored": True}})
    assert response.status_code == 200
    (submit,) = fake.submits
    sampling = submit.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, list(sampling.stop_token_ids)) == (3, 20, 42, [11])
    assert (sampling.ignore_eos, sampling.min_tokens, sampling.logprobs) == (True, 2, 1)
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert sampling.min_p == pytest.approx(0.1) and sampling.repetition_penalty == pytest.approx(1.2)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert submit.cache_salt == "tenant-a"


async def test_default_max_tokens_completions_gateway_default_chat_rest_of_context(client, fake, codec,
                                                                                     served_model):
    await client.post("/v1/completions", json={"prompt": "Hi"})
    messages = [{"role": "user", "content": "Hi"}]
    await client.post("/v1/chat/completions", json={"messages": messages})
    await client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 7})
    room = served_model.max_model_len - len(codec.apply_chat_template(messages))
    assert [s.sampling.max_tokens for s in fake.submits] == [DEFAULT_MAX_TOKENS, room, 7]


async def test_completion_logprobs_legacy_shape(client, fake, codec):
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 2})
    ids = fake.reply_ids()[:2]
    texts = [codec.decode([i], skip_special_tokens=False) for i in ids]
    assert response.json()["choices"][0]["logprobs"] == {
        "tokens": texts,
        "token_logprobs": [-0.25, -0.25],
        "top_logprobs": [{texts[k]: -0.25, codec.decode([ids[k] + 1], skip_special_tokens=False): -2.0}
                         for k in range(2)],
        "text_offset": [0, len(texts[0])],
    }


async def test_chat_logprobs_shape(client, fake, codec):
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 1})
    token = fake.reply_ids()[0]
    text = codec.decode([token], skip_special_tokens=False)
    entry = {"token": text, "logprob": -0.25, "bytes": list(text.encode())}
    assert response.json()["choices"][0]["logprobs"] == {"content": [{**entry, "top_logprobs": [entry]}]}


async def test_stop_string_across_tokens_cuts_the_text_and_cancels_upstream(client, fake, codec):
    fake.delay = 0.02
    stop = " the cap"  # " the" is one token, " capital" the next
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 100, "stop": [stop, "zzz"]})
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (" Paris is", "stop", stop)
    rid = response.headers["x-request-id"]
    await eventually(lambda: fake.count("cancelled", rid) == 1, "the cancelled submit call")
    assert fake.count("token", rid) < len(fake.reply_ids())


# --- streaming -------------------------------------------------------------------------------


async def test_completion_stream_framing_done_and_usage_chunk(client, fake, codec):
    body = {"prompt": PROMPT, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    request_id = response.headers["x-request-id"]
    assert response.headers["x-trace-id"] == fake.submits[0].trace_id
    events = _events(response.text)
    chunks, usage, done = events[:-2], events[-2], events[-1]
    assert done == "[DONE]"
    assert all(c["id"] == f"cmpl-{request_id}" and c["object"] == "text_completion" for c in chunks)
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    prompt_tokens = len(codec.encode(PROMPT))
    assert usage["choices"] == [] and usage["id"] == f"cmpl-{request_id}"
    assert usage["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(fake.reply_ids()),
                              "total_tokens": prompt_tokens + len(fake.reply_ids()),
                              "prompt_tokens_details": {"cached_tokens": 0}}


async def test_streamed_text_equals_the_non_streamed_text(client):
    """Multi-byte characters split across tokens (Korean, emoji) are held until complete."""
    body = {"prompt": PROMPT, "max_tokens": 64}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    events = _events((await client.post("/v1/completions", json={**body, "stream": True})).text)
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == whole == REPLY
    assert all("\ufffd" not in piece for piece in pieces)


async def test_chat_stream_opens_with_the_role_and_ends_without_usage(client):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "stream": True}
    events = _events((await client.post("/v1/chat/completions", json=body)).text)
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)


async def test_error_after_the_stream_started_is_one_error_event_then_done(client, fake):
    fake.fail_after = (3, Unavailable("decode worker decode-0 was lost"))
    response = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 50, "stream": True})
    assert response.status_code == 200
    events = _events(response.text)
    message = f"{client_errors.NO_WORKER} (request {response.headers['x-request-id']})"  # not the worker's words
    assert events[-2] == {"error": {"message": message, "type": "service_unavailable_error",
                                    "param": None, "code": "unavailable"}}
    assert all("choices" in e for e in events[:-2])
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == " Paris is the"


# --- n choices -------------------------------------------------------------------------------


async def test_n_choices_with_a_seed(client, fake, codec):
    response = await client.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "seed": 7, "max_tokens": 64})
    rid = response.headers["x-request-id"]
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [f" {seed}:{REPLY}" for seed in (7, 8, 9)]
    assert [s.request_id for s in fake.submits] == [rid, f"{rid}-1", f"{rid}-2"]
    assert [s.sampling.seed for s in fake.submits] == [7, 8, 9]
    # The others are submitted only after choice 0's first token, so they find its prompt cached.
    assert fake.log.index(("submit", f"{rid}-1")) > fake.log.index(("token", rid))
    prompt = len(codec.encode(PROMPT))
    completion = sum(len(fake.reply_ids(seed)) for seed in (7, 8, 9))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": 0}}


async def test_n_choices_stream_interleaved_by_index(client, fake):
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True}}
    events = _events((await client.post("/v1/chat/completions", json=body)).text)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[2:-2] if e["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
        assert mine[-1]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 2 * len(fake.reply_ids())


# --- errors and limits -----------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),  # no prompt of a list is submitted
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 4}, "n"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c"]}, "stop"),
    ("/v1/completions", {"prompt": "x" * 301}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 301}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                              "top_logprobs": 30}, "top_logprobs"),
])
async def test_invalid_field_is_400_naming_it_before_any_work(client, fake, path, body, param):
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(param), error["message"]
    assert response.headers["x-request-id"]
    assert fake.submits == []
    assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200


@pytest.mark.parametrize("raw", [b'{"prompt": "Hi",', b"not json", b"", b"[1, 2]"])
async def test_malformed_json_is_400(client, fake, raw):
    response = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = _error(response)
    assert (error["param"], error["code"]) == (None, "invalid_json")
    assert fake.submits == []


async def test_oversized_body_is_413_whether_declared_or_streamed(client, fake):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    response = await client.post("/v1/completions", content=big)
    assert response.status_code == 413
    assert _error(response)["code"] == "request_too_large"

    async def chunked() -> AsyncIterator[bytes]:  # no content-length: counted while read
        for start in range(0, len(big), 1000):
            yield big[start:start + 1000]

    response = await client.post("/v1/completions", content=chunked())
    assert response.status_code == 413
    assert fake.submits == []
    assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200


async def test_unknown_model_is_404(client, fake):
    response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"})
    assert response.status_code == 404
    error = _error(response)
    assert (error["type"], error["code"], error["param"]) == ("not_found_error", "not_found", None)
    assert "gpt-9" in error["message"]


@pytest.mark.parametrize(("failure", "status", "message", "headers"), [
    (Overloaded("waiting queue full (256 requests)", retry_after=2.5), 429, client_errors.BUSY,
     {"retry-after": "3", "retry-after-ms": "2500"}),
    (Unavailable("no decode worker is registered"), 503, client_errors.NO_WORKER,
     {"retry-after": "1", "retry-after-ms": "1000"}),
    (DeadlineExceeded("deadline passed while queued"), 504, client_errors.DEADLINE, {}),
])
async def test_scheduler_failures_map_to_http_statuses(client, fake, failure, status, message, headers):
    for stream in (False, True):
        fake.fail = failure
        response = await client.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
        assert response.status_code == status
        assert _error(response)["message"] == f"{message} (request {response.headers['x-request-id']})"
        for name, value in headers.items():
            assert response.headers[name] == value
        assert response.headers["x-trace-id"] == fake.submits[-1].trace_id
    fake.fail = None
    assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})).status_code == 200


async def test_api_key_required_and_default_cache_salt_from_it(keyed_client, fake):
    body = {"prompt": "Hi", "max_tokens": 1}
    missing = await keyed_client.post("/v1/completions", json=body)
    wrong = await keyed_client.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"})
    basic = await keyed_client.post("/v1/completions", json=body, headers={"authorization": f"Basic {KEY}"})
    for response in (missing, wrong, basic):
        assert response.status_code == 401
        assert _error(response)["type"] == "authentication_error"
    assert (await keyed_client.get("/v1/models")).status_code == 401
    assert fake.submits == []
    for key in (KEY, "sk-other"):
        ok = await keyed_client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    assert [s.cache_salt for s in fake.submits] == [salt_for_key(KEY), salt_for_key("sk-other")]
    assert salt_for_key(KEY) != salt_for_key("sk-other") and len(salt_for_key(KEY)) == 32
    assert (await keyed_client.get("/health")).status_code == 503  # open, no key needed


async def test_request_ids(client):
    mine = await client.get("/v1/models", headers={"x-request-id": "my-req.1"})
    assert mine.headers["x-request-id"] == "my-req.1"
    invalid = await client.get("/v1/models", headers={"x-request-id": "bad id with spaces"})
    assert invalid.headers["x-request-id"].startswith("req-")
    unknown = await client.get("/v2/nothing")
    assert unknown.status_code == 404 and unknown.headers["x-request-id"].startswith("req-")
    assert _error(unknown)["type"] == "not_found_error"
    wrong_method = await client.get("/v1/completions")
    assert wrong_method.status_code == 405


# --- models, health, metrics -----------------------------------------------------------------


async def test_models(client, served_model):
    body = (await client.get("/v1/models")).json()  # this scheduler has no Stats: no worker holds the model
    assert body == {"object": "list", "data": [{
        "id": served_model.name, "object": "model", "created": served_model.created, "owned_by": "tandem",
        "root": served_model.name, "max_model_len": served_model.max_model_len,
        "resident": False, "resident_workers": 0}]}


async def test_health_follows_the_serving_flag(client):
    assert (await client.get("/health")).status_code == 503
    set_serving(client.app, True)
    response = await client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "serving"})
    set_serving(client.app, False)  # draining
    assert (await client.get("/health")).status_code == 503


async def test_metrics(client):
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "tandem:test_total 3.0" in response.text


# --- client disconnect, over a real socket ---------------------------------------------------


@pytest.fixture
async def live_client(codec, served_model, scheduler) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app served by uvicorn on a loopback port (start_http)."""
    server = await start_http(create_http_app(_pipeline(codec, served_model, scheduler), HttpConfig()), "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
            yield client
    finally:
        await server.stop()


async def test_a_stream_served_by_uvicorn_has_its_headers_and_every_event(live_client, fake, codec):
    """The body's events go to the server's own send (http_server.ServerSend), past the middleware:
    the headers it adds still come with the start, and the events are the same as through it."""
    body = {"prompt": PROMPT, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    response = await live_client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-trace-id"] == fake.submits[0].trace_id
    events = _events(response.text)
    chunks, usage, done = events[:-2], events[-2], events[-1]
    assert done == "[DONE]"
    assert all(c["id"] == f"cmpl-{response.headers['x-request-id']}" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert usage["usage"]["completion_tokens"] == len(fake.reply_ids())


async def test_client_disconnect_mid_stream_cancels_upstream(live_client, fake):
    fake.hold_after = 1
    body = {"prompt": "Hi", "max_tokens": 100, "stream": True}
    async with live_client.stream("POST", "/v1/completions", json=body) as response:
        rid = response.headers["x-request-id"]
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass
    await eventually(lambda: fake.count("cancelled", rid) == 1, "the cancelled submit call")
    assert fake.count("token", rid) < len(fake.reply_ids())


async def test_client_disconnect_before_the_first_token_cancels_upstream(live_client, fake):
    fake.hold_after = 0
    request = asyncio.ensure_future(live_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 9}))
    await eventually(lambda: len(fake.submits) == 1, "the submit call")
    request.cancel()
    rid = fake.submits[0].request_id
    await eventually(lambda: fake.count("cancelled", rid) == 1, "the cancelled submit call")
    assert fake.count("token", rid) == 0


# --- the openai package as a client ----------------------------------------------------------


async def test_openai_client_reads_responses_streams_and_errors(codec, served_model, scheduler, fake):
    import openai

    app = create_http_app(_pipeline(codec, served_model, scheduler), HttpConfig(api_keys=(KEY,)))
    async with _client(app) as http_client:
        client = openai.AsyncOpenAI(api_key=KEY, base_url="http://tandem/v1", http_client=http_client, max_retries=0)
        completion = await client.completions.create(model=served_model.name, prompt=PROMPT, max_tokens=3)
        assert completion.choices[0].text == " Paris is the" and completion.choices[0].finish_reason == "length"
        assert completion.usage.prompt_tokens_details.cached_tokens == 0
        stream = await client.chat.completions.create(
            model=served_model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=64, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(fake.reply_ids())
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=served_model.name, prompt="Hi", temperature=-1)
        assert bad.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="gpt-9", prompt="Hi")
        fake.fail = Overloaded("waiting queue full (256 requests)")
        with pytest.raises(openai.RateLimitError):
            await client.completions.create(model=served_model.name, prompt="Hi")
        wrong = openai.AsyncOpenAI(api_key="nope", base_url="http://tandem/v1", http_client=http_client, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
