"""The real `openai` package against the real mesh: completions and chat, streamed and not, usage,
stop strings, n choices with a seed, the error classes, and greedy output equal to HF transformers'.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from services.common.tokenizer import TextCodec
from tests.e2e.api import MODEL, prompt_of
from tests.hf_reference import MAX_NEW_TOKENS, NEAR_TIE, PARITY_PROMPTS, Reference

BLOCK = 16  # tokens per KV block
EOS = 2  # <|im_end|>, the model's end of sequence
IGNORE_EOS = {"ignore_eos": True}  # a vLLM field the openai package sends as an extra


@pytest.fixture(scope="module")
def codec(default_model_dir) -> TextCodec:
    return TextCodec.from_model_dir(default_model_dir)


def decisive(reference: Reference) -> bool:
    """No near-tie among the reference's top two logits: any correct system must pick its tokens."""
    return all(float(torch.topk(logits, 2).values.diff().abs()) >= NEAR_TIE for logits in reference.logits)


def test_greedy_completions_equal_hf_for_text_and_token_prompts(client, codec, parity_prompts, parity_references):
    cases = [(i, prompt) for i, ref in enumerate(parity_references) if decisive(ref)
             for prompt in (PARITY_PROMPTS[i], parity_prompts[i])]
    assert len(cases) >= 12, "most parity prompts must be decisive, or this test checks too little"

    def complete(prompt: str | list[int]):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(complete, [prompt for _, prompt in cases]))
    for (i, prompt), response in zip(cases, responses):
        ref = parity_references[i]
        choice = response.choices[0]
        label = f"prompt {i} as {'text' if isinstance(prompt, str) else 'token ids'}"
        assert choice.text == codec.decode(ref.tokens), label
        assert choice.finish_reason == ("stop" if ref.tokens[-1] == EOS else "length"), label
        assert response.usage.prompt_tokens == len(parity_prompts[i]), label
        assert response.usage.completion_tokens == len(ref.tokens), label


def test_completion_shape_and_cached_tokens_of_a_repeated_prompt(client):
    prompt = prompt_of(40, 1)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    assert first.id.startswith("cmpl-req-") and first.object == "text_completion" and first.model == MODEL
    assert [c.index for c in first.choices] == [0] and first.choices[0].finish_reason == "length"
    assert again.choices[0].text == first.choices[0].text
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (40, 5, 45)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK  # the prompt's full blocks


def test_completion_stream_equals_the_response_and_ends_with_usage(client):
    prompt = "The quick brown fox"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert all(c.usage is None and len(c.choices) == 1 for c in text_chunks)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.id == text_chunks[0].id
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id


def test_completion_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=6, temperature=0,
                                            stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_applies_the_template_and_streams_the_same_reply(client, codec):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    template_ids = codec.apply_chat_template(messages)
    as_tokens = client.completions.create(model=MODEL, prompt=template_ids, max_tokens=24, temperature=0)
    reply = whole.choices[0].message
    assert reply.role == "assistant" and reply.content == as_tokens.choices[0].text and reply.content
    assert whole.id.startswith("chatcmpl-req-") and whole.object == "chat.completion"
    assert whole.usage.prompt_tokens == len(template_ids)
    assert whole.choices[0].finish_reason == as_tokens.choices[0].finish_reason

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_the_text_and_name_the_stop(client):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    stops = ["\n\nThe", "Paris"]
    first = min((full.index(s), s) for s in stops)  # which of the two the text meets first
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stops)
    choice = response.choices[0]
    assert choice.text == full[: first[0]] and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == first[1]
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop="\n\nThe",
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index("\n\nThe") + len("\n\nThe")]


def test_a_stop_token_id_ends_the_text_before_it(client, codec):
    period = codec.encode(".")[0]
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16,
                                         temperature=0, extra_body={"stop_token_ids": [period]})
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (" Paris", "stop", period)
    assert response.usage.completion_tokens == 2  # " Paris", "."


def test_n_choices_with_a_seed_are_reproducible_and_share_the_prompt_blocks(client, mesh):
    prompt = prompt_of(40, 2)
    before = mesh.worker_stats("prefill-0")
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=2,
                                         extra_body=IGNORE_EOS)
    after = mesh.worker_stats("prefill-0")
    texts = [c.text for c in response.choices]
    assert [c.index for c in response.choices] == [0, 1] and texts[0] != texts[1]
    # choice 1 reuses the prompt's two full blocks that choice 0 computed, instead of computing them again
    assert after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens == 2 * 40
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 2 * BLOCK
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (40, 16)

    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=2,
                                      extra_body=IGNORE_EOS)
    assert [c.text for c in again.choices] == texts
    # choice i draws what a single request with seed + i draws
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=12,
                                       extra_body=IGNORE_EOS)
    assert single.choices[0].text == texts[1]

    streamed = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=2,
                                           extra_body=IGNORE_EOS, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_invalid_field_is_bad_request_naming_it(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=-1)
    assert error.value.status_code == 400 and error.value.param == "temperature"
    assert error.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=0)
    assert error.value.param == "max_completion_tokens"


def test_bad_key_is_authentication_error(mesh):
    with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as error:
            stranger.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert error.value.status_code == 401 and error.value.type == "authentication_error"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert error.value.status_code == 404 and "no-such-model" in error.value.message
