"""Prompt logprobs from the engine equal HF transformers' teacher-forced ones in fp32 (|delta| < 1e-4,
exact token ids and top alternatives' ids), under chunked prefill and with the prompt's prefix
already in the prefix cache (a request for them computes its whole prompt)."""

from __future__ import annotations

import pytest
import torch

from services.runtime.engine import Engine, EngineConfig, RequestOutput
from services.runtime.sampler import SamplingParams

TOP_N = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def prompts(parity_prompts, parity_references) -> list[list[int]]:
    """Prompts of a few tokens to over a hundred: the parity prompts with HF's continuation."""
    return [prompt + ref.tokens for prompt, ref in zip(parity_prompts, parity_references)]


@pytest.fixture(scope="module")
def hf_logprobs(default_model_dir, prompts) -> list[torch.Tensor]:
    """log_softmax of HF fp32 logits at every prompt position but the last: row i predicts token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1) for ids in prompts]


def first_outputs(engine: Engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[RequestOutput]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    firsts: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            firsts.setdefault(out.request_id, out)
    return [firsts[rid] for rid in ids]


def assert_close_to_hf(output: RequestOutput, prompt: list[int], want: torch.Tensor) -> None:
    got = output.prompt_logprobs
    assert got is not None and [t.token_id for t in got] == prompt[1:]
    rows = torch.arange(len(prompt) - 1)
    expected = want[rows, torch.tensor(prompt[1:])]
    assert max(abs(t.logprob - e) for t, e in zip(got, expected.tolist())) < TOLERANCE
    for token, row in zip(got, want):
        values, ids = row.topk(TOP_N)
        assert [i for i, _ in token.top_logprobs] == ids.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(token.top_logprobs, values.tolist())) < TOLERANCE


def test_prompt_logprobs_match_hf_chunked_and_after_a_prefix_cache_hit(default_model_dir, prompts, hf_logprobs):
    engine = Engine.from_model_dir(default_model_dir, EngineConfig(num_kv_blocks=256, chunk_size=32))
    first_outputs(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0), "warm")  # fills the prefix cache
    outputs = first_outputs(engine, prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_N),
                            "scored")
    for output, prompt, want in zip(outputs, prompts, hf_logprobs):
        assert output.num_cached_tokens == 0
        assert_close_to_hf(output, prompt, want)
    assert engine.blocks.num_referenced_blocks == 0


def test_no_prompt_logprobs_unless_asked(default_model_dir, prompts):
    engine = Engine.from_model_dir(default_model_dir, EngineConfig(num_kv_blocks=64))
    (output,) = first_outputs(engine, prompts[:1], SamplingParams(max_tokens=1, temperature=0.0), "plain")
    assert output.prompt_logprobs is None
