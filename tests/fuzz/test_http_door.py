"""Schemathesis over the gateway's OpenAPI document (/openapi.json, as the gateway serves it):
positive and negative cases for every operation. Pass: never a 5xx, every response has the
documented content type, JSON where JSON is due, errors in OpenAI's shape with the type their
status calls for; afterwards the mesh serves the reference request's exact tokens and is idle.

The document describes no request body for the POST operations (the gateway reads its bodies
itself, see http_app.py); where it describes none, the body schema is taken from the models the
gateway parses bodies with (openai_requests.py), so the fuzzing reaches past "missing body".
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import event, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from services.gateway.http_errors import ERROR_TYPES
from services.gateway.openai_requests import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest)
from tests.fuzz.serving import API_KEY, CALL_TIMEOUT_S, assert_still_serving, budget
from tests.fuzz.strategies import CHEAP_MAX_TOKENS, CONTEXT

pytestmark = pytest.mark.slow

HEADERS = {"authorization": f"Bearer {API_KEY}"}
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
              "GET /v1/models", "GET /v1/models/{model_id}", "GET /version", "GET /health", "GET /metrics"]
BODY_EXAMPLES = 40
OTHER_EXAMPLES = 5


@pytest.fixture(scope="module")
def document(mesh) -> dict[str, Any]:
    """The gateway's own OpenAPI document, completed with request bodies where it has none."""
    served = httpx.get(f"{mesh.http_url}/openapi.json", timeout=CALL_TIMEOUT_S)
    assert served.status_code == 200
    return with_bodies(served.json())


def with_bodies(document: dict[str, Any]) -> dict[str, Any]:
    """`document` with a JSON request body on each POST operation that lacks one, its schema the
    pydantic model the gateway parses that body with (definitions moved to components)."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        operation = document["paths"][path]["post"]
        if "requestBody" in operation:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return document


@pytest.mark.parametrize("label", OPERATIONS)
def test_operation_never_fails_on_the_server(mesh, reference, document, label):
    operation = schemathesis.openapi.from_dict(document).find_operation_by_label(label)
    has_body = label.startswith("POST")
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_body else [GenerationMode.POSITIVE]
    cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes)).map(cheap)

    @budget(max_examples=BODY_EXAMPLES if has_body else OTHER_EXAMPLES)
    @given(case=cases)
    def fuzz(case) -> None:
        response = case.call(base_url=mesh.http_url, headers=HEADERS, timeout=CALL_TIMEOUT_S)
        event(str(response.status_code))
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        assert_shaped(case, response)

    fuzz()


def test_mesh_serves_the_same_tokens_after_the_fuzzing(mesh, reference):
    assert_still_serving(mesh, reference)


def cheap(case):
    """Bounds a valid generation to CHEAP_MAX_TOKENS tokens: a max_tokens within the context is
    lowered to it, and a chat request without one (which may fill the context) gets it."""
    body = case.body
    if not isinstance(body, dict):
        return case
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and CHEAP_MAX_TOKENS < value <= CONTEXT:
            body[key] = CHEAP_MAX_TOKENS
    if case.path == "/v1/chat/completions" and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CHEAP_MAX_TOKENS
    return case


def assert_shaped(case, response) -> None:
    """The response in the gateway's shapes: an OpenAI error body on any error, SSE for a stream,
    the Prometheus text format for /metrics, JSON otherwise."""
    content_type = ", ".join(response.headers.get("content-type", []))  # schemathesis: name -> values
    if response.status_code >= 400:
        error = response.json()["error"]
        expected_type = ERROR_TYPES.get(response.status_code, "invalid_request_error")
        assert error["message"] and error["type"] == expected_type, (case.body, response.status_code, error)
    elif case.path == "/metrics":
        assert content_type.startswith("text/plain"), content_type
    elif isinstance(case.body, dict) and case.body.get("stream") is True:
        assert content_type.startswith("text/event-stream") and response.text.endswith("data: [DONE]\n\n")
    else:
        assert content_type == "application/json", content_type
        json.loads(response.text)
