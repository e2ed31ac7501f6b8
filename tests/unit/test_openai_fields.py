"""No request field is silently dropped: every field of the openai package's request types is either
declared by the gateway's body (implemented) or has a policy (inert or refused); refused ones get
an InvalidRequest naming them unless their value asks for nothing, and unknown ones a log warning.
"""

from __future__ import annotations

import logging

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from services.common.errors import InvalidRequest
from services.gateway.openai_fields import CHAT_FIELDS, COMPLETION_FIELDS, Inert, Refused
from services.gateway.openai_requests import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "Hi"}]
ENDPOINTS = [
    (CompletionRequest, completion_create_params.CompletionCreateParamsBase, COMPLETION_FIELDS, {"prompt": "Hi"}),
    (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase, CHAT_FIELDS, {"messages": MESSAGES}),
]
NOT_HARMLESS = {"surely": "not a default"}


@pytest.mark.parametrize(("body_type", "params_type", "policies", "base"), ENDPOINTS)
def test_every_openai_field_is_declared_or_has_a_policy(body_type, params_type, policies, base) -> None:
    openai_fields = set(params_type.__annotations__) | {"stream"}
    assert len(openai_fields) > 15  # the package's TypedDict really was read
    unhandled = sorted(name for name in openai_fields if name not in body_type.model_fields and name not in policies)
    assert unhandled == []
    assert not set(body_type.model_fields) & set(policies)  # one home per field


@pytest.mark.parametrize(("body_type", "policies", "base"), [(b, p, x) for b, _, p, x in ENDPOINTS])
def test_a_refused_field_is_named_and_its_harmless_values_pass(body_type, policies, base) -> None:
    refused = {name: policy for name, policy in policies.items() if isinstance(policy, Refused)}
    assert {"suffix", "audio", "prompt_logprobs"} & set(refused)
    for name, policy in refused.items():
        with pytest.raises(InvalidRequest) as caught:
            body_type.model_validate({**base, name: NOT_HARMLESS}).check_undeclared()
        assert caught.value.field == name
        assert caught.value.message == f"{name}: {policy.reason}"
        for value in policy.harmless:
            body_type.model_validate({**base, name: value}).check_undeclared()


def test_harmless_values_compare_by_type_too() -> None:
    ChatCompletionRequest.model_validate({"messages": MESSAGES, "store": False}).check_undeclared()
    with pytest.raises(InvalidRequest, match="^store: completions are not stored"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "store": 0}).check_undeclared()


def test_unknown_fields_are_logged_and_inert_ones_are_not(caplog) -> None:
    inert = [name for name, policy in CHAT_FIELDS.items() if isinstance(policy, Inert)]
    body = {"messages": MESSAGES, "x_vendor": 1, "another_extra": "a", **{name: "tag" for name in inert}}
    with caplog.at_level(logging.WARNING, logger="services.gateway.openai_fields"):
        ChatCompletionRequest.model_validate(body).check_undeclared()
    assert [record.getMessage() for record in caplog.records] == [
        "/v1/chat/completions: ignoring fields this server does not know: another_extra, x_vendor"]


def test_known_fields_log_nothing(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="services.gateway.openai_fields"):
        CompletionRequest.model_validate({"prompt": "Hi", "user": "u1", "n": 2, "best_of": 2}).check_undeclared()
    assert caplog.records == []


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"best_of": 3}, "best_of", "best_of: must equal n (1): every sample is returned, none is ranked out"),
    ({"n": 2, "best_of": 1}, "best_of", "best_of: must equal n (2): every sample is returned, none is ranked out"),
    ({"echo": True, "logprobs": 0, "stream": True}, "echo",
     "echo: prompt logprobs are returned on whole responses only; send stream: false"),
])
def test_completion_fields_that_do_not_fit_together(fields, param, message) -> None:
    with pytest.raises(InvalidRequest) as caught:
        CompletionRequest.model_validate({"prompt": "Hi", **fields}).check_undeclared()
    assert (caught.value.field, caught.value.message) == (param, message)


def test_a_list_of_prompts_is_one_request_each() -> None:
    body = CompletionRequest.model_validate({"prompt": ["The sky", "Grass"], "max_tokens": 3})
    requests = body.generation_requests("req-1", "salt", 16)
    assert [(r.request_id, r.prompt, r.token_ids, r.sampling.max_tokens, r.cache_salt) for r in requests] == [
        ("req-1", "The sky", None, 3, "salt"), ("req-1-p1", "Grass", None, 3, "salt")]
    ids = CompletionRequest.model_validate({"prompt": [[5, 6], [7]]}).generation_requests("r", "", 16)
    assert [(r.prompt, r.token_ids) for r in ids] == [(None, [5, 6]), (None, [7])]
    one = CompletionRequest.model_validate({"prompt": [5, 6]}).generation_requests("r", "", 16)
    assert [(r.prompt, r.token_ids) for r in one] == [(None, [5, 6])]
