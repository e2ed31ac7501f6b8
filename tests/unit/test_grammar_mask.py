"""The sampler's grammar mask and logit_bias on a small vocabulary: constrained rows draw only
allowed tokens, an empty mask falls back to EOS, and other rows keep their logits bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from services.runtime.grammar import disallowed_tokens
from services.runtime.sampler import SampleRequest, Sampler, SamplingParams

VOCAB = 70  # three 32-bit words, the last one partly used
EOS = (2,)


class FixedMatcher:
    """Stands in for a GrammarMatcher: allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask.view(np.uint32)
        words[row] = 0
        for token_id in self.allowed:
            words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))


def request(params: SamplingParams, seed: int = 0, grammar: FixedMatcher | None = None) -> SampleRequest:
    return SampleRequest(params, seed, 5, [1], [], EOS, grammar)  # type: ignore[arg-type]


def test_disallowed_tokens_unpacks_every_word_and_falls_back_to_eos():
    mask = disallowed_tokens([FixedMatcher({0, 31, 32, 63, 69}), FixedMatcher(set())], VOCAB, EOS)  # type: ignore[list-item]
    assert mask.shape == (2, VOCAB) and mask.dtype == torch.bool
    assert (~mask[0]).nonzero().squeeze(1).tolist() == [0, 31, 32, 63, 69]
    assert (~mask[1]).nonzero().squeeze(1).tolist() == [2]


def test_constrained_rows_draw_allowed_tokens_and_other_rows_are_untouched():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    sampled_params = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0.0)
    allowed = {5, 40, 66}
    batch = [request(sampled_params, seed, FixedMatcher(allowed)) for seed in range(2)]
    batch += [request(greedy), request(sampled_params, seed=9)]
    out = Sampler().sample(logits, batch)
    alone = Sampler().sample(logits[2:], batch[2:])
    assert {out[0].token_id, out[1].token_id} <= allowed
    assert [(t.token_id, t.logprob) for t in out[2:]] == [(t.token_id, t.logprob) for t in alone]
    assert out[2].token_id == int(logits[2].argmax())
    for seed in range(40):  # every draw of a constrained row is allowed
        (token,) = Sampler().sample(logits[:1], [request(sampled_params, seed, FixedMatcher(allowed))])
        assert token.token_id in allowed


def test_logit_bias_moves_the_greedy_choice_and_is_clamped():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 50.0
    greedy = SamplingParams(temperature=0.0)
    assert Sampler().sample(logits, [request(greedy)])[0].token_id == 7
    banned = SamplingParams(temperature=0.0, logit_bias=((7, -100.0), (9, 1.0)))
    assert Sampler().sample(logits, [request(banned)])[0].token_id == 9
    clamped = SamplingParams(temperature=0.0, logit_bias=((7, -1e9), (9, 1e9)))
    logits[0, 11] = 150.0  # token 9 gets +100 (clamped), not +1e9, so token 11 stays ahead
    assert Sampler().sample(logits, [request(clamped)])[0].token_id == 11
