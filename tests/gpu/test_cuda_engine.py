"""The engine on a CUDA device (`pytest -m gpu`; every test skips without CUDA): bf16 greedy parity
against HF transformers in bf16 on the same GPU, through SDPA and through flash-attn's paged kernel
(asserted taken), and the KV cache sized from free GPU memory.

bf16 near-tie bound: HF and the engine run different kernels in bf16, so their logits differ by a
few bf16 steps (0.125 between 16 and 32); a divergence is accepted only where the reference's top two
logits are within NEAR_TIE_BF16, and the tokens before it must be equal."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.runtime.engine import Engine, EngineConfig
from services.runtime.kv_cache import kv_block_bytes
from services.runtime.precision import Precision
from services.runtime.sampler import SamplingParams
from tests.hf_reference import MAX_NEW_TOKENS, Reference, assert_matches, reference_outputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NEAR_TIE_BF16 = 0.25  # two bf16 steps at |logit| in [16, 32)
BF16 = Precision(torch.bfloat16)
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
needs_flash = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")


@pytest.fixture(scope="module")
def bf16_references(default_model_dir, parity_prompts) -> list[Reference]:
    return reference_outputs(default_model_dir, parity_prompts, MAX_NEW_TOKENS, torch.bfloat16, "cuda:0")


def _engine(model_dir, **overrides) -> Engine:
    config = EngineConfig(device="cuda:0", precision=BF16, num_kv_blocks=overrides.pop("num_kv_blocks", 256),
                          **overrides)
    return Engine.from_model_dir(model_dir, config)


def _run_all(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for rid, prompt in zip(tokens, prompts):
        engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return list(tokens.values())


def _assert_parity(outputs: list[list[int]], references: list[Reference], label: str) -> None:
    for i, (got, ref) in enumerate(zip(outputs, references)):
        assert_matches(got, ref, f"{label} prompt {i}", near_tie=NEAR_TIE_BF16)


def test_bf16_sdpa_greedy_matches_hf_bf16(default_model_dir, parity_prompts, bf16_references):
    engine = _engine(default_model_dir, attention_backend="torch")
    assert engine.model.backend.name == "torch"
    _assert_parity(_run_all(engine, parity_prompts), bf16_references, "sdpa")


def test_bf16_chunked_prefill_matches_hf_bf16(default_model_dir, parity_prompts, bf16_references):
    engine = _engine(default_model_dir, attention_backend="torch", max_num_batched_tokens=64)
    _assert_parity(_run_all(engine, parity_prompts), bf16_references, "chunked")


@needs_flash
def test_bf16_flash_greedy_matches_hf_bf16_and_decode_takes_flash(default_model_dir, parity_prompts,
                                                                   bf16_references):
    engine = _engine(default_model_dir, attention_backend="auto", block_size=256, num_kv_blocks=32)
    backend = engine.model.backend
    assert backend.name == "flash"
    kernel, calls = backend._with_kvcache, []
    backend._with_kvcache = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
    _assert_parity(_run_all(engine, parity_prompts), bf16_references, "flash")
    assert calls, "no decode step ran flash-attn's paged kernel"


def test_the_kv_cache_takes_its_share_of_free_gpu_memory(default_model_dir):
    engine = _engine(default_model_dir, num_kv_blocks=None, kv_memory_bytes=None, kv_memory_fraction=0.25)
    free, _total = torch.cuda.mem_get_info(torch.device("cuda:0"))
    cache_bytes = engine.blocks.num_blocks * kv_block_bytes(engine.model_config, 16, torch.bfloat16)
    # Sized from the memory free before the cache took its share: a quarter of (free now + the cache).
    assert cache_bytes == pytest.approx((free + cache_bytes) * 0.25, rel=0.02)
    assert _run_all(engine, [[1, 2, 3]])[0]
