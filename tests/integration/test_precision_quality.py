"""Reduced precision against the fp32 reference, teacher-forced: each parity prompt plus HF's fp32
greedy continuation runs through the engine in one pass, and every continuation position is scored.

Two figures per precision, over the 8 parity prompts' continuations (337 positions: up to 48 tokens each):
- top-1 agreement: the share of positions whose argmax is HF's fp32 greedy token;
- max |delta logprob|: the largest gap between the logprob this precision gives HF's token and HF fp32's.
Thresholds: each format's measured figures (below, and in the README's "Precision and
quantization") with room for another CPU's kernels: about three times the disagreements seen
(1 position is 0.3%) and about three times the largest logprob gap, as vLLM's
`check_logprobs_close` tolerates near-ties but not a drift. A broken format is far outside them:
int4 weights whose zero point is off by half a level agreed on 0 of 337 positions (max gap 32).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from services.common.blocks import ceil_div
from services.runtime.engine import Engine, EngineConfig
from services.runtime.precision import Precision

# (precision, min top-1 agreement, max |delta logprob|); measured on the default model (AMD EPYC,
# torch 2.13): bf16 0.9941 / 0.194, fp16 1.0 / 0.039, bf16+int8 0.9852 / 0.516, bf16+int4 0.9911 / 0.463.
THRESHOLDS = [
    (Precision(torch.bfloat16), 0.98, 0.5),
    (Precision(torch.float16), 0.99, 0.1),
    (Precision(torch.bfloat16, "int8"), 0.96, 1.5),
    (Precision(torch.bfloat16, "int4"), 0.97, 1.5),
]


@dataclass(frozen=True, slots=True)
class Quality:
    agreement: float
    max_delta_logprob: float
    positions: int


def teacher_forced_quality(engine: Engine, prompts, references) -> Quality:
    agree, deltas = 0, []
    for prompt, ref in zip(prompts, references):
        ids = prompt + ref.tokens[:-1]
        blocks = list(range(ceil_div(len(ids), engine.cache.block_size)))
        engine.cache.initialize(blocks)
        logits = engine.runner.prompt_logits(ids, blocks)[len(prompt) - 1:]
        got = torch.log_softmax(logits.float(), dim=-1)
        want = torch.log_softmax(torch.stack(ref.logits).float(), dim=-1)
        tokens = torch.tensor(ref.tokens)
        rows = torch.arange(len(tokens))
        agree += int((got.argmax(dim=-1) == tokens).sum())
        deltas.append((got[rows, tokens] - want[rows, tokens]).abs().max().item())
    positions = sum(len(ref.tokens) for ref in references)
    return Quality(agree / positions, max(deltas), positions)


@pytest.mark.parametrize("precision,min_agreement,max_delta", THRESHOLDS, ids=lambda v: getattr(v, "name", None))
def test_reduced_precision_stays_close_to_fp32(default_model_dir, parity_prompts, parity_references,
                                               precision, min_agreement, max_delta):
    engine = Engine.from_model_dir(default_model_dir, EngineConfig(num_kv_blocks=64, precision=precision))
    quality = teacher_forced_quality(engine, parity_prompts, parity_references)
    print(f"{precision.name}: top-1 agreement {quality.agreement:.4f}, max |delta logprob| "
          f"{quality.max_delta_logprob:.3f} over {quality.positions} positions")
    assert quality.positions == 337  # 8 prompts' continuations: up to 48 tokens, fewer where HF stopped at EOS
    assert quality.agreement >= min_agreement
    assert quality.max_delta_logprob <= max_delta


def test_fp32_teacher_forcing_reproduces_the_reference(default_model_dir, parity_prompts, parity_references):
    """The scoring itself: fp32 agrees on every token, so a drop above comes from the precision."""
    engine = Engine.from_model_dir(default_model_dir, EngineConfig(num_kv_blocks=64))
    quality = teacher_forced_quality(engine, parity_prompts, parity_references)
    assert quality.agreement == 1.0 and quality.max_delta_logprob < 1e-3
