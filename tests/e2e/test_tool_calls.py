"""Tool calls and the other OpenAI fields beyond plain generation, through the real `openai` package
and the e2e mesh with the default model (whose chat template has no tool support, so the tools
reach it through tool_prompt's fallback): required and named choices always parse, whole and
streamed; a list of prompts with echo; lm-eval-harness's loglikelihood call (echo, max_tokens 0,
logprobs) against HF's teacher-forced fp32 logprobs; refused fields name themselves."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from services.common.tokenizer import TextCodec
from tests.e2e.api import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_is_always_called_with_valid_arguments(client, seed):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=NAMED,
                                              temperature=1.0, seed=seed, max_tokens=48)
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather"})
    assert len(choice.message.tool_calls) == 1


def test_required_calls_stream_as_deltas_that_parse(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=64, stream=True)
    deltas, finishes = [], []
    for chunk in stream:
        (choice,) = chunk.choices
        deltas.extend(choice.delta.tool_calls or [])
        finishes.append(choice.finish_reason)
        assert not choice.delta.content
    assert finishes[-1] == "tool_calls"
    assert [delta.index for delta in deltas] == [0]
    _check_calls(deltas, {"get_weather", "get_time"})


def test_a_conversation_with_a_tool_result_goes_on(client, default_model_dir):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "It is sunny, 21 degrees."}]
    response = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                              temperature=0, max_tokens=8)
    (choice,) = response.choices
    assert choice.message.tool_calls is None and choice.message.content
    # The tools are not shown with "none"; the call and its result are, in the fallback's form.
    codec = TextCodec.from_model_dir(default_model_dir)
    assert response.usage.prompt_tokens == len(codec.apply_chat_template(history))
    assert "<tool_response>\nIt is sunny, 21 degrees.\n</tool_response>" in codec.decode(
        codec.apply_chat_template(history), skip_special_tokens=False)


def test_a_list_of_prompts_with_echo(client):
    response = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"], n=2,
                                         echo=True, temperature=0, max_tokens=3)
    texts = [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the two samples agree
    assert texts[0].startswith("The capital of France is") and texts[2].startswith("One, two,")
    single = client.completions.create(model=MODEL, prompt="One, two,", temperature=0, max_tokens=3)
    assert texts[2] == "One, two," + single.choices[0].text


def test_loglikelihood_call_returns_the_prompt_logprobs_of_hf(client, default_model_dir):
    from transformers import AutoModelForCausalLM

    codec = TextCodec.from_model_dir(default_model_dir)
    ids = codec.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    response = client.completions.create(model=MODEL, prompt=[ids], echo=True, max_tokens=0, logprobs=1,
                                         temperature=0)
    (choice,) = response.choices
    assert (choice.finish_reason, choice.text) == ("length", codec.decode(ids, skip_special_tokens=False))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert logprobs.tokens == [codec.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hf = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    want = hf[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert max(abs(got - w) for got, w in zip(logprobs.token_logprobs[1:], want)) < 1e-4
    best = [codec.decode([int(row.argmax())], skip_special_tokens=False) for row in hf]
    assert [next(iter(top)) for top in logprobs.top_logprobs[1:]] == best


@pytest.mark.parametrize(("call", "param"), [
    (lambda c: c.completions.create(model=MODEL, prompt="Hi", suffix="end", max_tokens=2), "suffix"),
    (lambda c: c.completions.create(model=MODEL, prompt="Hi", best_of=2, max_tokens=2), "best_of"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="high"), "reasoning_effort"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required"), "tool_choice"),
])
def test_refused_fields_are_400_naming_them(client, call, param):
    with pytest.raises(openai.BadRequestError) as caught:
        call(client)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param


def test_tokenize_detokenize_version_and_the_model(client, http):
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world"}
    assert http.get("/version").json()["version"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
