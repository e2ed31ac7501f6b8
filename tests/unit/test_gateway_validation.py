"""The gateway's request validation: each invalid field gives InvalidRequest naming it, with the
exact message; an unknown model gives NotFound naming the served model; valid requests pass."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest, NotFound
from services.common.sampling_params import SamplingParams
from services.gateway.limits import RequestLimits
from services.gateway.request import GenerationRequest, ServedModel
from services.gateway.validation import (
    REQUEST_ID_PATTERN, check_choices, check_prompt_length, check_repeated_sizes, request_id_or_new, validate_request,
)

MODEL = ServedModel(name="smol", max_model_len=100, vocab_size=1000, has_chat_template=True, created=0)


def request(sampling: SamplingParams | None = None, **fields) -> GenerationRequest:
    fields.setdefault("prompt", "Hello")
    return GenerationRequest(sampling=sampling or SamplingParams(), **fields)


def invalid(req: GenerationRequest, model: ServedModel = MODEL) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        validate_request(req, model)
    return caught.value


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"prompt": ""}, "prompt", "prompt: must not be empty"),
        ({"prompt": None}, "prompt", "prompt: missing; set one of prompt, token_ids or messages"),
        ({"token_ids": [1, 2]}, "token_ids",
         "token_ids: cannot be combined with prompt; set only one of prompt, token_ids or messages"),
        ({"prompt": None, "token_ids": [1], "messages": [{"role": "user", "content": "hi"}]}, "messages",
         "messages: cannot be combined with token_ids; set only one of prompt, token_ids or messages"),
        ({"prompt": None, "token_ids": []}, "token_ids", "token_ids: must not be empty"),
        ({"prompt": None, "token_ids": [5, 1000]}, "token_ids",
         "token_ids: token id 1000 at index 1 is outside the vocabulary [0, 1000)"),
        ({"prompt": None, "token_ids": [-1]}, "token_ids",
         "token_ids: token id -1 at index 0 is outside the vocabulary [0, 1000)"),
        ({"prompt": None, "messages": []}, "messages", "messages: must not be empty"),
        ({"prompt": None, "messages": [{"role": "", "content": "hi"}]}, "messages", "messages: message 0 has no role"),
        ({"stop": ("end", "")}, "stop", "stop: stop string 1 is empty"),
        ({"request_id": "bad id!"}, "request_id",
         "request_id: must be 1 to 128 characters of A-Z a-z 0-9 . _ : -"),
        ({"request_id": "x" * 129}, "request_id",
         "request_id: must be 1 to 128 characters of A-Z a-z 0-9 . _ : -"),
    ],
)
def test_invalid_prompt_and_request_fields(fields, field, message):
    error = invalid(request(**fields))
    assert (error.field, error.message) == (field, message)


@pytest.mark.parametrize(
    ("sampling", "field", "message"),
    [
        (SamplingParams(max_tokens=0), "max_tokens", "max_tokens: must be an integer >= 1, got 0"),
        (SamplingParams(max_tokens=-3), "max_tokens", "max_tokens: must be an integer >= 1, got -3"),
        (SamplingParams(temperature=-0.5), "temperature",
         "temperature: must be a finite number >= 0 (0 means greedy), got -0.5"),
        (SamplingParams(top_p=0.0), "top_p", "top_p: must be in (0, 1] (1 turns it off), got 0.0"),
        (SamplingParams(top_p=1.5), "top_p", "top_p: must be in (0, 1] (1 turns it off), got 1.5"),
        (SamplingParams(top_k=-2), "top_k", "top_k: must be -1 or 0 (off) or a positive integer, got -2"),
        (SamplingParams(min_p=2.0), "min_p", "min_p: must be in [0, 1] (0 turns it off), got 2.0"),
        (SamplingParams(logprobs=21), "logprobs", "logprobs: must be in [0, 20] or unset, got 21"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty",
         "repetition_penalty: must be a finite number > 0 (1 is off), got 0.0"),
        (SamplingParams(presence_penalty=3.0), "presence_penalty", "presence_penalty: must be in [-2, 2], got 3.0"),
        (SamplingParams(frequency_penalty=-2.5), "frequency_penalty",
         "frequency_penalty: must be in [-2, 2], got -2.5"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens",
         "min_tokens: must be an integer in [0, max_tokens], got 5"),
        (SamplingParams(stop_token_ids=(3, 1000)), "stop_token_ids",
         "stop_token_ids: token id 1000 at index 1 is outside the vocabulary [0, 1000)"),
    ],
)
def test_invalid_sampling_fields(sampling, field, message):
    error = invalid(request(sampling))
    assert (error.field, error.message) == (field, message)


def test_unknown_model_is_not_found_naming_the_served_model():
    with pytest.raises(NotFound) as caught:
        validate_request(request(model="gpt-9"), MODEL)
    assert caught.value.message == "model 'gpt-9' not found; this gateway serves 'smol'"


def test_model_is_checked_first():
    with pytest.raises(NotFound):
        validate_request(request(SamplingParams(temperature=-1), model="gpt-9", prompt=""), MODEL)


def test_messages_need_a_chat_template():
    model = ServedModel(name="base", max_model_len=100, vocab_size=1000, has_chat_template=False, created=0)
    error = invalid(request(prompt=None, messages=[{"role": "user", "content": "hi"}]), model)
    assert error.message == "messages: model 'base' has no chat template; send prompt or token_ids instead"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "prompt"),
        ({"model": "smol", "request_id": "my-req_1.a:b", "stop": ("\n",)}, "prompt"),
        ({"prompt": None, "token_ids": [0, 999]}, "token_ids"),
        ({"prompt": None, "messages": [{"role": "user", "content": ""}]}, "messages"),
    ],
)
def test_valid_requests_return_their_prompt_field(fields, expected):
    assert validate_request(request(SamplingParams(temperature=0, top_p=1.0), **fields), MODEL) == expected


def test_prompt_longer_than_the_context():
    with pytest.raises(InvalidRequest) as caught:
        check_prompt_length("prompt", 100, 1, MODEL)
    assert caught.value.field == "prompt"
    assert caught.value.message == (
        "prompt: the prompt has 100 tokens but the model's context is 100 tokens, including at least one "
        "generated token; shorten it to at most 99 tokens")


def test_token_ids_longer_than_the_context_name_token_ids():
    with pytest.raises(InvalidRequest) as caught:
        check_prompt_length("token_ids", 150, 1, MODEL)
    assert caught.value.field == "token_ids"


def test_max_tokens_beyond_the_context():
    with pytest.raises(InvalidRequest) as caught:
        check_prompt_length("prompt", 90, 11, MODEL)
    assert caught.value.field == "max_tokens"
    assert caught.value.message == (
        "max_tokens: the prompt (90 tokens) plus max_tokens (11) exceeds the model's context of 100 tokens; "
        "set max_tokens to at most 10")


def test_prompt_and_max_tokens_filling_the_context_exactly_pass():
    check_prompt_length("prompt", 90, 10, MODEL)
    check_prompt_length("prompt", 99, 1, MODEL)


SMALL = RequestLimits(max_prompt_chars=10, max_messages=2, max_stop_strings=2, max_stop_chars=3, max_stop_token_ids=2,
                      max_n=3, max_cache_salt_chars=4)


@pytest.mark.parametrize(
    ("sampling", "fields", "field", "message"),
    [
        (None, {"prompt": "x" * 11}, "prompt", "prompt: has 11 characters; this server accepts at most 10"),
        (None, {"prompt": None, "messages": [{"role": "user", "content": "x" * 7}]}, "messages",
         "messages: has 11 characters in roles and contents; this server accepts at most 10"),
        (None, {"prompt": None, "messages": [{"role": "u", "content": ""}] * 3}, "messages",
         "messages: has 3 messages; this server accepts at most 2"),
        (None, {"stop": ("a", "b", "c")}, "stop", "stop: has 3 stop strings; this server accepts at most 2"),
        (None, {"stop": ("abc", "abcd")}, "stop",
         "stop: stop string 1 has 4 characters; this server accepts at most 3"),
        (SamplingParams(stop_token_ids=(1, 2, 3)), {}, "stop_token_ids",
         "stop_token_ids: has 3 ids; this server accepts at most 2"),
        (None, {"cache_salt": "salty"}, "cache_salt", "cache_salt: has 5 characters; this server accepts at most 4"),
        # Sizes come before the values: 10**6 is out of the vocabulary, but the count is what is reported.
        (None, {"prompt": None, "token_ids": [10**6] * 100}, "token_ids",
         "token_ids: the prompt has 100 tokens but the model's context is 100 tokens, including at least one "
         "generated token; shorten it to at most 99 tokens"),
        (SamplingParams(stop_token_ids=(-1,) * 3), {}, "stop_token_ids",
         "stop_token_ids: has 3 ids; this server accepts at most 2"),
    ],
)
def test_each_request_limit_names_its_field_and_value(sampling, fields, field, message):
    with pytest.raises(InvalidRequest) as caught:
        validate_request(request(sampling, **fields), MODEL, SMALL)
    assert (caught.value.field, caught.value.message) == (field, message)


def test_requests_at_the_limits_pass():
    fields = {"prompt": "x" * 10, "stop": ("abc", "d"), "cache_salt": "salt"}
    assert validate_request(request(SamplingParams(stop_token_ids=(1, 2)), **fields), MODEL, SMALL) == "prompt"
    chat = [{"role": "user", "content": "hi"}, {"role": "u", "content": "x"}]  # 4 + 2 + 1 + 1 characters
    assert validate_request(request(prompt=None, messages=chat), MODEL, SMALL) == "messages"


def test_the_number_of_choices():
    check_choices(3, SMALL)
    for n in (0, 4):
        with pytest.raises(InvalidRequest) as caught:
            check_choices(n, SMALL)
        assert caught.value.message == f"n: must be in [1, 3], got {n}"


def test_repeated_fields_are_sized_before_conversion():
    with pytest.raises(InvalidRequest) as caught:
        check_repeated_sizes(3, 0, MODEL, SMALL)
    assert caught.value.message == "messages: has 3 messages; this server accepts at most 2"
    with pytest.raises(InvalidRequest) as caught:
        check_repeated_sizes(0, 100, MODEL, SMALL)
    assert caught.value.field == "token_ids"
    check_repeated_sizes(2, 99, MODEL, SMALL)


def test_a_request_id_names_every_response():
    assert request_id_or_new("mine-1") == "mine-1"
    assert REQUEST_ID_PATTERN.fullmatch(request_id_or_new("bad id!")) and request_id_or_new("").startswith("req-")
