"""Structured outputs and logit_bias through the real `openai` package and the e2e mesh (a prefill
and a decode worker, so every constrained request crosses the KV hand-off with its grammar)."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
import tandem
from tandem.errors import InvalidRequest

from services.common.tokenizer import TextCodec
from tests.e2e.api import API_KEY, MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},  # bounded, so it ends
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
USER = [{"role": "user", "content": "Name a city and its population, as JSON."}]


@pytest.fixture(scope="module")
def codec(default_model_dir) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


def test_json_schema_replies_validate_for_every_seed(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(6):
        reply = client.chat.completions.create(model=MODEL, messages=USER, temperature=1.0, seed=seed,
                                               max_tokens=64, response_format=response_format)
        choice = reply.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop", seed


def test_guided_choice_and_regex_on_completions(client):
    for seed in range(6):
        chosen = client.completions.create(model=MODEL, prompt="Is the sky blue?", temperature=1.0, seed=seed,
                                           max_tokens=8, extra_body={"guided_choice": CHOICES})
        assert chosen.choices[0].text in CHOICES and chosen.choices[0].finish_reason == "stop"
    dated = client.completions.create(model=MODEL, prompt="Today's date:", temperature=1.0, seed=1, max_tokens=16,
                                      extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    text = dated.choices[0].text
    assert len(text) == 10 and text[:2] == "20" and text[4] == text[7] == "-", text


@pytest.mark.parametrize("response_format, problem", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
     "response_format: json_schema does not compile: Invalid type: strin"),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format: type json_schema needs json_schema.schema, the JSON schema to follow"),
])
def test_an_invalid_schema_is_a_400_naming_response_format(client, response_format, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, response_format=response_format)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "response_format"
    assert caught.value.body["message"] == problem


def test_an_invalid_regex_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "a[b"})
    assert caught.value.body["param"] == "guided_regex"
    assert caught.value.body["message"].startswith("guided_regex: regex does not compile:")


def test_logit_bias_minus_100_bans_the_greedy_token(client, codec):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    (banned,) = codec.encode(first, add_special_tokens=False)
    biased = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=0,
                                       logit_bias={str(banned): -100})
    assert biased.choices[0].text != plain.choices[0].text
    assert first not in biased.choices[0].logprobs.tokens


def test_the_sdk_over_grpc_follows_a_choice_and_refuses_a_bad_regex(mesh):
    with tandem.Client(mesh.endpoint("gateway").address, api_key=API_KEY) as sdk:
        for seed in range(3):
            done = sdk.complete("Is the sky blue?", max_tokens=8, temperature=1.0, seed=seed, choice=CHOICES)
            assert done.text in CHOICES and done.finish_reason == "stop"
        with pytest.raises(InvalidRequest) as caught:
            sdk.complete("x", max_tokens=4, regex="a[b")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.field == "structured"
    assert caught.value.message.startswith("structured: regex does not compile:")
