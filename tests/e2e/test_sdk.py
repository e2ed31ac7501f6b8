"""The Python SDK (tandem.Client, tandem.AsyncClient) against the real mesh: streaming, whole
completions, chat, models, cancel on close (blocks freed server-side), deadlines, and the
exception classes the real server's statuses turn into.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
import tandem
from tandem.errors import DeadlineExceeded, InvalidRequest, NotFound, Unauthenticated
from tests.e2e.api import API_KEY, MODEL, prompt_of, wait_aborted_and_idle
from tests.hf_reference import MAX_NEW_TOKENS, assert_matches

PROMPT = 5  # parity prompt "The quick brown fox": 48 tokens, no EOS


@pytest.fixture(scope="module")
def target(mesh) -> str:
    return mesh.endpoint("gateway").address


@pytest.fixture(scope="module")
def sdk(target) -> Iterator[tandem.Client]:
    with tandem.Client(target, api_key=API_KEY) as opened:
        yield opened


def test_generate_streams_the_hf_greedy_tokens(sdk, parity_prompts, parity_references):
    chunks = list(sdk.generate(token_ids=parity_prompts[PROMPT], max_tokens=MAX_NEW_TOKENS, temperature=0))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert_matches(tokens, parity_references[PROMPT], "sdk stream")
    assert len(chunks) > 1 and all(chunk.finish_reason is None and chunk.usage is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.stop_reason is None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(parity_prompts[PROMPT]), len(tokens))
    assert len({(chunk.request_id, chunk.trace_id) for chunk in chunks}) == 1
    assert last.request_id.startswith("req-") and len(last.trace_id) == 32


def test_complete_equals_the_joined_stream_and_models_lists_the_model(sdk):
    whole = sdk.complete("The capital of France is", max_tokens=12, temperature=0, logprobs=2,
                         request_id="e2e-sdk-complete")
    chunks = list(sdk.generate("The capital of France is", max_tokens=12, temperature=0))
    assert whole.text == "".join(chunk.text for chunk in chunks) and whole.text
    assert whole.token_ids == [t for chunk in chunks for t in chunk.token_ids] and len(whole.token_ids) == 12
    assert [lp.token_id for lp in whole.logprobs] == whole.token_ids
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token_id == lp.token_id for lp in whole.logprobs)
    assert whole.request_id == "e2e-sdk-complete"
    [model] = sdk.models()
    assert (model.id, model.has_chat_template, model.vocab_size) == (MODEL, True, 49152)


async def test_async_client_streams_chat_like_the_blocking_one(sdk, target):
    messages = [{"role": "user", "content": "Say hi in French."}]
    expected = sdk.chat(messages, max_tokens=16, temperature=0)
    async with tandem.AsyncClient(target, api_key=API_KEY) as client:
        chunks = [chunk async for chunk in client.chat_stream(messages, max_tokens=16, temperature=0)]
        whole = await client.chat(messages, max_tokens=16, temperature=0)
        [model] = await client.models()
    assert "".join(chunk.text for chunk in chunks) == whole.text == expected.text and whole.text
    assert [t for chunk in chunks for t in chunk.token_ids] == expected.token_ids
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected.usage.prompt_tokens, len(expected.token_ids))
    assert usage.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16  # the blocking call cached the prompt
    assert model.id == MODEL


def long_request() -> dict:
    return dict(token_ids=prompt_of(40, 20), max_tokens=500, ignore_eos=True, temperature=0)


def test_breaking_out_of_a_stream_cancels_it_on_the_server(sdk, mesh):
    aborted = mesh.scheduler_stats().aborted
    for count, _ in enumerate(sdk.generate(**long_request()), 1):
        if count == 3:
            break
    wait_aborted_and_idle(mesh, aborted)
    with sdk.generate(**long_request()) as stream:
        next(stream)
    wait_aborted_and_idle(mesh, aborted + 1)


async def test_closing_an_async_stream_cancels_it_on_the_server(target, mesh):
    async with tandem.AsyncClient(target, api_key=API_KEY) as client:
        aborted = mesh.scheduler_stats().aborted
        stream = client.generate(**long_request())
        await anext(stream)
        await stream.aclose()
        await asyncio.to_thread(wait_aborted_and_idle, mesh, aborted)


def test_deadline_exceeded_and_the_server_lets_go(sdk, mesh):
    aborted = mesh.scheduler_stats().aborted
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as error:
        for _ in sdk.generate(**long_request(), timeout=1.5):
            pass
    assert time.monotonic() - started >= 1.5  # not before the deadline (a loaded machine only adds time)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and error.value.request_id.startswith("req-")
    wait_aborted_and_idle(mesh, aborted)


def test_invalid_field_is_invalid_request_naming_it(sdk):
    with pytest.raises(InvalidRequest) as error:
        sdk.complete("Hello", max_tokens=4, top_p=1.5)
    assert error.value.field == "top_p" and error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.message == "top_p: must be in (0, 1] (1 turns it off), got 1.5"


def test_unknown_model_is_not_found(sdk):
    with pytest.raises(NotFound) as error:
        sdk.complete("Hello", max_tokens=4, model="no-such-model")
    assert error.value.message == "model 'no-such-model' not found; this gateway serves 'SmolLM2-135M-Instruct'"


@pytest.mark.parametrize("key", [None, "wrong"], ids=["missing", "wrong"])
def test_missing_or_wrong_key_is_unauthenticated(target, key, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    with tandem.Client(target, api_key=key) as stranger:
        with pytest.raises(Unauthenticated) as error:
            stranger.complete("Hello", max_tokens=4)
        with pytest.raises(Unauthenticated):
            stranger.models()
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED and error.value.message
