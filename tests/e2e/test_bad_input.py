"""Bad input over HTTP, through the real gateway: every invalid field is a 400 naming it in
`param`, malformed JSON is a 400, an oversized body a 413, a missing key a 401 — all before any
work — and the next request is served as usual.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from tandem.v1 import common_pb2, gateway_pb2
from tests.e2e.api import API_KEY, prompt_of
from tests.waiting import DEADLINE_S

CHAT = [{"role": "user", "content": "Hi"}]
RANGE, TYPE = "invalid_request", "invalid_type"  # a value out of range; a value of the wrong JSON type
INVALID_FIELDS = [
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature", RANGE),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature", TYPE),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p", RANGE),
    ("/v1/completions", {"prompt": "Hi", "top_k": -2}, "top_k", RANGE),
    ("/v1/completions", {"prompt": "Hi", "min_p": 1.5}, "min_p", RANGE),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", RANGE),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 8192}, "max_tokens", RANGE),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, "n", RANGE),
    ("/v1/completions", {"prompt": "Hi", "n": 17}, "n", RANGE),
    ("/v1/completions", {"prompt": "Hi", "seed": -1}, "seed", TYPE),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x"] * 17}, "stop", RANGE),
    ("/v1/completions", {"prompt": "Hi", "stop": ["x", ""]}, "stop", RANGE),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [49152]}, "stop_token_ids", RANGE),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs", RANGE),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 2.5}, "presence_penalty", RANGE),
    ("/v1/completions", {"prompt": "Hi", "frequency_penalty": -2.5}, "frequency_penalty", RANGE),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty", RANGE),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": -1}, "min_tokens", RANGE),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, "stream", TYPE),
    ("/v1/completions", {"prompt": ""}, "prompt", RANGE),
    ("/v1/completions", {"prompt": []}, "prompt", RANGE),
    ("/v1/completions", {"prompt": [49152]}, "prompt", RANGE),
    ("/v1/completions", {"prompt": prompt_of(8192, 9)}, "prompt", RANGE),
    ("/v1/completions", {"prompt": "x" * 200_001}, "prompt", RANGE),
    ("/v1/completions", {"max_tokens": 4}, "prompt", TYPE),
    ("/v1/chat/completions", {"messages": []}, "messages", RANGE),
    ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages", TYPE),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens", RANGE),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", RANGE),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", RANGE),
]


def assert_served(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def assert_error(response: httpx.Response, status: int, error_type: str, param: str | None, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (error_type, param, code), error
    assert response.headers["x-request-id"].startswith("req-")
    return error["message"]


def queried_tokens(mesh) -> int:
    """Prompt tokens the prefill worker has looked up: it grows with every request that reached it."""
    return mesh.worker_stats("prefill-0").prefix_cache_queried_tokens


@pytest.mark.parametrize("path, body, param, code", INVALID_FIELDS,
                         ids=[f"{case[2]}-{i}" for i, case in enumerate(INVALID_FIELDS)])
def test_each_invalid_field_is_400_naming_it_before_any_work(mesh, http, path, body, param, code):
    before = queried_tokens(mesh)
    message = assert_error(http.post(path, json=body), 400, "invalid_request_error", param, code)
    assert message.startswith(param)
    assert queried_tokens(mesh) == before
    assert_served(http)


@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b"null", b"\xff\xfe"],
                         ids=["cut", "empty", "array", "null", "bytes"])
def test_malformed_json_is_400(http, raw):
    response = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_request_error", None, "invalid_json")
    assert_served(http)


def test_oversized_body_is_413_whether_declared_or_streamed(http):
    body = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    declared = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    message = assert_error(declared, 413, "invalid_request_error", None, "request_too_large")
    assert message == (f"the request body has {len(body)} bytes; this server accepts at most {1 << 20} "
                       "(--max-body-bytes)")

    def chunks():
        for start in range(0, len(body), 64 * 1024):
            yield body[start:start + 64 * 1024]

    streamed = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    message = assert_error(streamed, 413, "invalid_request_error", None, "request_too_large")
    assert message == f"the request body has more than {1 << 20} bytes; this server accepts at most {1 << 20} " \
                      "(--max-body-bytes)"
    assert_served(http)


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": "Basic c2stZTJl"}],
                         ids=["missing", "wrong", "not-bearer"])
def test_missing_or_wrong_key_is_401(mesh, http, headers):
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]:
        response = httpx.request(method, f"{mesh.http_url}{path}", json={"prompt": "Hi", "messages": CHAT},
                                 headers=headers)
        assert_error(response, 401, "authentication_error", None, "unauthenticated")
    assert_served(http)


def test_unknown_model_path_and_method(mesh, http):
    assert_error(http.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-4"}), 404, "not_found_error",
                 None, "not_found")
    assert_error(http.get("/v1/nothing"), 404, "not_found_error", None, None)
    assert_error(http.get("/v1/completions"), 405, "invalid_request_error", None, None)
    assert_served(http)
    mesh.wait_idle(DEADLINE_S)


# --- the gRPC door: the same limits as HTTP, with the same messages -----------------------------

GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)
OVER_LIMITS = [  # (gRPC request fields, the same request as an HTTP body, exact message)
    ({"sampling": common_pb2.SamplingParams(stop=["x"] * 100_000)}, {"stop": ["x"] * 100_000},
     "stop: has 100000 stop strings; this server accepts at most 16"),
    ({"prompt": "x" * 200_001}, {"prompt": "x" * 200_001},
     "prompt: has 200001 characters; this server accepts at most 200000"),
    ({"sampling": common_pb2.SamplingParams(logprobs=21)}, {"logprobs": 21},
     "logprobs: must be in [0, 20] or unset, got 21"),
    ({"sampling": common_pb2.SamplingParams(stop=["x" * 2000])}, {"stop": ["x" * 2000]},
     "stop: stop string 0 has 2000 characters; this server accepts at most 1024"),
]


@pytest.mark.parametrize("fields, body, message", OVER_LIMITS,
                         ids=["stop-count", "prompt-chars", "logprobs", "stop-chars"])
def test_over_a_limit_is_invalid_argument_on_grpc_and_400_on_http_with_one_message(mesh, http, fields, body, message):
    before = queried_tokens(mesh)
    request = gateway_pb2.GenerateRequest(**{"prompt": "Hi", **fields})
    with pytest.raises(grpc.RpcError) as caught:
        list(mesh.gateway().Generate(request, metadata=GRPC_AUTH, timeout=60))
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert dict(caught.value.trailing_metadata())["x-request-id"].startswith("req-")
    assert assert_error(http.post("/v1/completions", json={"prompt": "Hi", **body}), 400, "invalid_request_error",
                        message.partition(":")[0], "invalid_request") == message
    assert queried_tokens(mesh) == before
    assert_served(http)


def test_a_5_mb_stop_string_is_refused_by_both_doors_before_any_work(mesh, http):
    before = queried_tokens(mesh)
    request = gateway_pb2.GenerateRequest(prompt="Hi", sampling=common_pb2.SamplingParams(stop=["x" * 5_000_000]))
    with pytest.raises(grpc.RpcError) as caught:
        list(mesh.gateway().Generate(request, metadata=GRPC_AUTH, timeout=60))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # over the gateway's 4 MiB message limit
    response = http.post("/v1/completions", json={"prompt": "Hi", "stop": ["x" * 5_000_000]})
    assert_error(response, 413, "invalid_request_error", None, "request_too_large")
    assert queried_tokens(mesh) == before
    assert_served(http)
