"""The HTTP bridge's fields beyond plain generation, over a pipeline whose generations replay a
scripted text token by token (real validation, tokenization and chat template): tool calls whole
and streamed through the real openai client, a list of prompts, echo, refused fields, and the
small endpoints /tokenize, /detokenize, /version and /v1/models/{id}.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.common.tokenizer import TextCodec
from services.common.tool_prompt import call_text
from services.gateway.generation import GenerationPipeline
from services.gateway.http_app import HttpConfig, create_http_app
from services.gateway.output import Chunk
from services.gateway.request import GenerationRequest, ServedModel
from tandem.v1 import common_pb2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
AUTO_REPLY = ("Let me check.\n" + call_text("get_weather", {"city": "Paris"}) + "\n"
              + call_text("get_weather", {"city": "Lyon"}))


class ScriptedGeneration:
    """Replays `text` one token per chunk, then finishes with "stop"."""

    def __init__(self, codec: TextCodec, request_id: str, text: str, num_prompt_tokens: int) -> None:
        self.request_id, self.trace_id = request_id, "0" * 32
        self._codec, self._text, self._num_prompt_tokens = codec, text, num_prompt_tokens

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        ids = self._codec.encode(self._text, add_special_tokens=False)
        detokenizer = self._codec.incremental()
        for token_id in ids:
            yield Chunk([token_id], detokenizer.push([token_id]))
        usage = common_pb2.Usage(prompt_tokens=self._num_prompt_tokens, completion_tokens=len(ids))
        yield Chunk([], detokenizer.flush(), finish_reason="stop", usage=usage)

    def close(self) -> None:
        pass


class ScriptedPipeline(GenerationPipeline):
    """The real pipeline's checks and tokenization; `reply(request)` is what the model says."""

    def __init__(self, codec: TextCodec, model: ServedModel, reply: Callable[[GenerationRequest], str],
                 unused: grpc.aio.Channel) -> None:
        super().__init__(codec, model, unused, tracer=TracerProvider().get_tracer("test"))
        self.reply = reply
        self.started: list[tuple[GenerationRequest, list[int]]] = []

    async def start(self, request: GenerationRequest, timeout: float) -> ScriptedGeneration:  # type: ignore[override]
        prompt_ids = await self.tokenize(request)
        self.started.append((request, prompt_ids))
        return ScriptedGeneration(self.codec, request.request_id, self.reply(request), len(prompt_ids))


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def served_model(default_model_dir: Path, codec: TextCodec) -> ServedModel:
    return ServedModel.from_model_dir(default_model_dir, codec)


@pytest.fixture
async def pipeline(codec, served_model) -> AsyncIterator[ScriptedPipeline]:
    unused = grpc.aio.insecure_channel("127.0.0.1:9")  # never called: start() is scripted
    scripted = ScriptedPipeline(codec, served_model, lambda request: AUTO_REPLY, unused)
    yield scripted
    scripted.close()
    await unused.close()


@pytest.fixture
async def http(pipeline) -> AsyncIterator[httpx.AsyncClient]:
    app = create_http_app(pipeline, HttpConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tandem") as client:
        yield client


@pytest.fixture
async def client(http) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url="http://tandem/v1", api_key="none", http_client=http,
                                  max_retries=0) as opened:
        yield opened


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- tool calls ------------------------------------------------------------------------------


async def test_auto_tool_calls_come_back_as_tool_calls(client, pipeline, codec):
    response = await client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, CLOCK])
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Lyon"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    (request, prompt_ids), = pipeline.started
    assert request.tools == [WEATHER, CLOCK]
    prompt = codec.decode(prompt_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(WEATHER["function"]) in prompt and json.dumps(CLOCK["function"]) in prompt


async def test_streamed_tool_calls_are_deltas_in_openai_shape(client):
    stream = await client.chat.completions.create(model="", messages=ASK, tools=[WEATHER], stream=True)
    content, calls, finishes = "", [], []
    async for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        calls.extend(choice.delta.tool_calls or [])
        finishes.append(choice.finish_reason)
    assert content == "Let me check.\n\n"
    assert [(c.index, c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "function", "get_weather", {"city": "Paris"}), (1, "function", "get_weather", {"city": "Lyon"})]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


async def test_parallel_tool_calls_false_keeps_the_first(client):
    response = await client.chat.completions.create(model="", messages=ASK, tools=[WEATHER],
                                                    parallel_tool_calls=False)
    calls = response.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]


async def test_required_reads_the_forced_json_array(client, pipeline):
    pipeline.reply = lambda request: '[{"name": "get_time", "parameters": {}}]'
    response = await client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, CLOCK],
                                                    tool_choice="required")
    (choice,) = response.choices
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("get_time", "{}")]
    (request, _), = pipeline.started
    structured = request.sampling.structured
    assert structured.kind == "json_schema" and json.loads(structured.spec)["minItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in json.loads(structured.spec)["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]


async def test_a_named_function_reads_its_arguments(client, pipeline):
    pipeline.reply = lambda request: '{"city": "Oslo"}'
    stream = await client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, CLOCK], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [chunk async for chunk in stream]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "get_weather", '{"city": "Oslo"}')]
    assert chunks[-1].choices[0].finish_reason == "stop"  # as OpenAI answers a named choice
    (request, _), = pipeline.started
    assert json.loads(request.sampling.structured.spec) == WEATHER["function"]["parameters"]


async def test_auto_leaves_the_output_free(client, pipeline):
    await client.chat.completions.create(model="", messages=ASK, tools=[WEATHER])
    (request, _), = pipeline.started
    assert request.sampling.structured is None


async def test_tool_choice_none_hides_the_tools_and_reads_plain_text(client, pipeline, codec):
    response = await client.chat.completions.create(model="", messages=ASK, tools=[WEATHER], tool_choice="none")
    (choice,) = response.choices
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", AUTO_REPLY, None)
    (request, prompt_ids), = pipeline.started
    assert request.tools is None
    assert prompt_ids == codec.apply_chat_template(ASK)


async def test_tool_calls_and_results_in_the_history_reach_the_prompt(client, pipeline, codec):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}]
    await client.chat.completions.create(model="", messages=history, tools=[WEATHER])
    (request, prompt_ids), = pipeline.started
    prompt = codec.decode(prompt_ids, skip_special_tokens=False)
    assert prompt.endswith(
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice: needs tools: send the functions the model may call"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice: names function 'nope', which is not in tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "tools: function names must be unique"),
    ({"tools": [{"type": "retrieval"}]}, "tools", None),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice: a required or named tool call cannot be combined with another structured output; send one of them"),
])
async def test_tool_fields_that_do_not_fit_are_400_naming_them(http, pipeline, fields, param, message):
    response = await http.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert response.status_code == 400
    error = _error(response)
    assert error["param"] == param
    if message is not None:
        assert error["message"] == message
    assert pipeline.started == []


# --- completions: prompts, echo, refused fields ----------------------------------------------


async def test_a_list_of_prompts_gets_n_choices_each_numbered_prompt_by_prompt(http, pipeline, codec):
    pipeline.reply = lambda request: f" about {request.prompt}"
    response = await http.post("/v1/completions", json={"prompt": ["The sky", "Grass"], "n": 2, "echo": True})
    assert response.status_code == 200
    body = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "The sky about The sky", "stop"), (1, "The sky about The sky", "stop"),
        (2, "Grass about Grass", "stop"), (3, "Grass about Grass", "stop")]
    prompt_tokens = len(codec.encode("The sky")) + len(codec.encode("Grass"))
    completion_tokens = 2 * len(codec.encode(" about The sky")) + 2 * len(codec.encode(" about Grass"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    ids = [request.request_id for request, _ in pipeline.started]
    rid = response.headers["x-request-id"]
    assert ids == [rid, f"{rid}-p1", f"{rid}-1", f"{rid}-p1-1"]  # every prompt validated first


async def test_streamed_echo_opens_each_choice_with_its_prompt(client, pipeline, codec):
    pipeline.reply = lambda request: " and more"
    stream = await client.completions.create(model="", prompt=[[504, 2330], [7042]], echo=True, stream=True)
    texts: dict[int, str] = {}
    firsts: dict[int, str] = {}
    async for chunk in stream:
        (choice,) = chunk.choices
        firsts.setdefault(choice.index, choice.text)
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    echoed = [codec.decode(ids, skip_special_tokens=False) for ids in ([504, 2330], [7042])]
    assert texts == {0: f"{echoed[0]} and more", 1: f"{echoed[1]} and more"}
    assert firsts[0].startswith(echoed[0]) and firsts[1].startswith(echoed[1])


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"prompt": "Hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": ASK, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": ASK, "audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ("/v1/chat/completions", {"messages": ASK, "functions": [WEATHER["function"]]}, "functions"),
])
async def test_refused_fields_are_400_naming_them(http, pipeline, path, fields, param):
    response = await http.post(path, json=fields)
    assert response.status_code == 400
    assert _error(response)["param"] == param
    assert pipeline.started == []


# --- small endpoints -------------------------------------------------------------------------


async def test_tokenize_and_detokenize_round_trip(http, codec, served_model):
    response = await http.post("/tokenize", json={"prompt": "Hello world"})
    assert response.status_code == 200
    ids = codec.encode("Hello world")
    assert response.json() == {"tokens": ids, "count": len(ids), "max_model_len": served_model.max_model_len}
    chat = await http.post("/tokenize", json={"messages": ASK, "tools": [WEATHER]})
    assert chat.json()["tokens"] == codec.apply_chat_template(ASK, [WEATHER])
    back = await http.post("/detokenize", json={"tokens": ids, "model": served_model.name})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, 400, "add_special_tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, None),
])
async def test_tokenize_endpoints_refuse_bad_bodies(http, path, body, status, param):
    response = await http.post(path, json=body)
    assert response.status_code == status
    assert _error(response)["param"] == param


async def test_version_and_one_model(http, served_model):
    version = await http.get("/version")
    assert version.status_code == 200 and version.json() == {"version": "0.1.0"}
    card = await http.get(f"/v1/models/{served_model.name}")
    assert card.status_code == 200
    assert card.json() == {"id": served_model.name, "object": "model", "created": served_model.created,
                           "owned_by": "tandem", "root": served_model.name,
                           "max_model_len": served_model.max_model_len,
                           "resident": False, "resident_workers": 0}  # no scheduler to ask: none known
    missing = await http.get("/v1/models/gpt-4o")
    assert missing.status_code == 404
    assert _error(missing) == {"message": f"the model 'gpt-4o' does not exist; this server serves "
                                          f"{served_model.name!r} (GET /v1/models)",
                               "type": "not_found_error", "param": "model", "code": "model_not_found"}


async def test_the_openapi_document_lists_the_small_endpoints(http):
    paths = (await http.get("/openapi.json")).json()["paths"]
    assert {"/tokenize", "/detokenize", "/version", "/v1/models/{model_id}"} <= set(paths)
