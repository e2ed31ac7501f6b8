"""Tiny randomly initialised models of each supported architecture: Tandem's logits equal HF
transformers' within 1e-4, over a prefill and several paged decode steps, on the torch path and on
the native kernels' (where their build is loaded)."""

from __future__ import annotations

import pytest
import torch

from services.common.model_config import ModelConfig
from services.runtime import native
from services.runtime.attention import TorchAttention
from services.runtime.batch_scheduler import ScheduledChunk
from services.runtime.kv_cache import PagedKVCache
from services.runtime.layer_ops import NativeOps, TorchOps
from services.runtime.model import CausalLM
from services.runtime.model_runner import ModelRunner
from services.runtime.sampler import SamplingParams
from services.runtime.sequence import Sequence

COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
ARCHITECTURES = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                   rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 128, 64, 11, 200, 33, 1, 2, 90, 77, 150, 31, 8]


def make_tiny(kind: str, directory) -> torch.nn.Module:
    import transformers

    config_cls, extra = ARCHITECTURES[kind]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():  # random norms and biases too, so every weight matters
            param.normal_(0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_logits_match_transformers(kind, path, tmp_path):
    if path == "native" and not native.loaded():
        pytest.skip("the native kernels are not built: python -m services.runtime.native")
    torch.set_num_threads(1)
    reference = make_tiny(kind, tmp_path)
    model = CausalLM.from_model_dir(tmp_path, TorchAttention(native=path == "native"))
    model.ops = NativeOps if path == "native" else TorchOps
    cache = PagedKVCache(model.config, num_blocks=8, block_size=4)
    cache.initialize(list(range(8)))
    runner = ModelRunner(model, cache)
    seq = Sequence("tiny", PROMPT[:11], SamplingParams(), seed=0)
    seq.block_table = [5, 2, 7]  # deliberately scattered blocks
    spare_blocks = [0, 3, 6]
    tokens = list(PROMPT[:11])
    logits = [runner.run([ScheduledChunk(seq, 11)])[0]]
    seq.num_computed_tokens = 11
    for token in PROMPT[11:]:
        seq.token_ids.append(token)
        tokens.append(token)
        if len(seq.block_table) * 4 < len(tokens):
            seq.block_table.append(spare_blocks.pop(0))
        logits.append(runner.run([ScheduledChunk(seq, 1)])[0])
        seq.num_computed_tokens += 1
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens[:-1]])).logits[0, 10:]
    # logits[i] is the prediction after tokens[: 11 + i], i.e. HF position 10 + i.
    got = torch.stack(logits[:-1])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_kv_cache_layer_views_write_through_to_the_cache(tmp_path):
    make_tiny("llama", tmp_path)
    cache = PagedKVCache(ModelConfig.from_model_dir(tmp_path), num_blocks=3, block_size=4)
    cache.initialize([0, 1, 2])
    k_layer, v_layer = cache.layer(1)
    assert cache.layer(1)[0] is k_layer  # the same views every step
    k_layer[2, 3] = 1.5
    v_layer[0, 1] = -2.0
    assert cache.k[1, 2, 3].eq(1.5).all() and cache.v[1, 0, 1].eq(-2.0).all()
    assert cache.k[0].abs().sum() == 0 and cache.v[0].abs().sum() == 0  # layer 0 untouched
