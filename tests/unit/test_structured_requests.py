"""The structured-output and logit_bias fields of the OpenAI bodies, their wire form, and the
errors that name the field a client sent; torch-free, like the gateway that runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.common.errors import InvalidRequest
from services.common.sampling_params import SamplingParams
from services.common.structured_output import StructuredOutput
from services.common.wire import sampling_from_proto, sampling_to_proto
from services.gateway.openai_requests import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> SamplingParams:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields}).generation_requests("r", "", 16)[0].sampling


def completion(**fields) -> SamplingParams:
    return CompletionRequest.model_validate({"prompt": "x", **fields}).generation_requests("r", "", 16)[0].sampling


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA), strict=True)),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", choices=("a", "b"))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
    ({"guided_grammar": 'start: "x"'}, StructuredOutput("grammar", 'start: "x"')),
])
def test_chat_fields_become_one_constraint(fields, expected):
    assert chat(**fields).structured == expected


def test_completions_take_the_vllm_fields_but_not_response_format():
    assert completion(guided_choice=["yes", "no"]).structured == StructuredOutput("choice", choices=("yes", "no"))
    assert completion(logit_bias={"7": -100, "3": 2.5}).logit_bias == ((3, 2.5), (7, -100.0))
    assert "response_format" not in CompletionRequest.model_fields


@pytest.mark.parametrize("fields, param, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}},
     "response_format", "json_schema does not compile: Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format", "type json_schema needs json_schema.schema, the JSON schema to follow"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "response_format", "cannot be combined with guided_regex; send one structured output"),
    ({"guided_json": SCHEMA, "guided_regex": "a"},
     "guided_regex", "cannot be combined with guided_json; send one structured output"),
    ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list of non-empty strings"),
    ({"guided_json": "[1, 2]"}, "guided_json", "json_schema must be a JSON object, got list"),
    ({"structured_outputs": {}}, "structured_outputs", "set one of json, regex, choice, grammar or json_object"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids (non-negative integers), got 'x'"),
])
def test_bad_constraints_name_the_field_sent(fields, param, problem):
    with pytest.raises(InvalidRequest) as caught:
        chat(**fields)
    assert (caught.value.field, str(caught.value)) == (param, f"{param}: {problem}")


def test_a_misspelt_key_inside_structured_outputs_is_refused_not_dropped():
    with pytest.raises(ValueError, match="regexp"):
        chat(structured_outputs={"regexp": "a+"})


def test_a_strict_schema_refuses_what_it_cannot_enforce():
    schema = {"type": "string", "format": "no-such-format"}
    lenient = StructuredOutput("json_schema", json.dumps(schema))
    lenient.validate()
    with pytest.raises(ValueError, match="json_schema does not compile: Unknown format: no-such-format"):
        StructuredOutput("json_schema", json.dumps(schema), strict=True).validate()


@pytest.mark.parametrize("params, field", [
    (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
    (SamplingParams(logit_bias=((1, float("nan")),)), "logit_bias"),
    (SamplingParams(structured=StructuredOutput("regex", "a[b")), "structured"),
])
def test_validate_names_the_field(params, field):
    with pytest.raises(ValueError) as caught:
        params.validate()
    assert str(caught.value).startswith(f"{field} ")


def test_logit_bias_is_clamped_as_openai_does():
    params = SamplingParams(logit_bias=((1, -1e9), (2, 250.0), (3, 5.0)))
    assert params.clamped_logit_bias == ((1, -100.0), (2, 100.0), (3, 5.0))


@pytest.mark.parametrize("structured", [
    None, StructuredOutput("json_object"), StructuredOutput("choice", choices=("a", "b")),
    StructuredOutput("json_schema", "{}", strict=True, num_generated_prompt_tokens=4),
    StructuredOutput("regex", "a+"), StructuredOutput("grammar", 'start: "x"'),
])
def test_the_wire_form_round_trips(structured):
    params = SamplingParams(structured=structured, logit_bias=((3, -100.0), (9, 1.5)))
    assert sampling_from_proto(sampling_to_proto(params), 16) == params


def test_the_gateway_side_stays_torch_free():
    code = ("import sys, services.gateway.openai_requests, services.common.structured_output; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_continuation_tells_the_worker_how_many_prompt_tokens_the_grammar_has_seen():
    from services.scheduler.migration import continuation
    from tandem.v1 import common_pb2, scheduler_pb2

    request = scheduler_pb2.SubmitRequest(request_id="r", token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(
        max_tokens=10, structured=common_pb2.StructuredOutput(regex="[a-z]+")))
    moved = continuation(request, [7, 8], "r#migrated-1")
    assert list(moved.token_ids) == [1, 2, 3, 7, 8]
    assert moved.sampling.structured.num_generated_prompt_tokens == 2
    assert not continuation(scheduler_pb2.SubmitRequest(request_id="p", token_ids=[1]), [7], "p#1").sampling.HasField(
        "structured")


@pytest.mark.parametrize("sampling, field, problem", [
    (SamplingParams(structured=StructuredOutput("json_schema", '{"type": "strin"}')), "structured",
     "json_schema does not compile: Invalid type: strin"),
    (SamplingParams(logit_bias=((1000, 1.0),)), "logit_bias", "token id 1000 at index 0 is outside the vocabulary [0, 1000)"),
])
def test_the_pipeline_refuses_before_any_worker(sampling, field, problem):
    from services.gateway.request import GenerationRequest, ServedModel
    from services.gateway.validation import validate_request

    model = ServedModel(name="smol", max_model_len=100, vocab_size=1000, has_chat_template=True, created=0)
    with pytest.raises(InvalidRequest) as caught:
        validate_request(GenerationRequest(sampling=sampling, prompt="x"), model)
    assert str(caught.value) == f"{field}: {problem}"


def test_the_sdk_sends_one_structured_output_and_logit_bias():
    from tandem.client.request import build_request

    sampling = build_request({"json_schema": SCHEMA, "strict": True, "logit_bias": {5: -100.0}}, prompt="x").sampling
    assert (json.loads(sampling.structured.json_schema), sampling.structured.strict) == (SCHEMA, True)
    assert dict(sampling.logit_bias) == {5: -100.0}
    assert list(build_request({"choice": ["a", "b"]}, prompt="x").sampling.structured.choice.choices) == ["a", "b"]
    assert not build_request({}, prompt="x").sampling.HasField("structured")
    with pytest.raises(TypeError, match="options regex and choice are exclusive; give one structured output"):
        build_request({"choice": ["a"], "regex": "a"}, prompt="x")
