"""Sampler: greedy, seeded draws, filters, penalties, min_tokens, logprobs and parameter checks."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.runtime.sampler import (
    SampleRequest,
    Sampler,
    SamplingParams,
    apply_penalties,
    resolve_seed,
    sampling_probs,
)

torch.set_num_threads(1)

PROBS = [0.4, 0.3, 0.2, 0.1]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def request(params: SamplingParams, seed: int = 7, position: int = 0, prompt=(), output=(), eos=()) -> SampleRequest:
    return SampleRequest(params, seed, position, list(prompt), list(output), tuple(eos))


def sample_one(logits, params, **kwargs):
    return Sampler().sample(torch.as_tensor(logits, dtype=torch.float32).reshape(1, -1), [request(params, **kwargs)])[0]


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


# --- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("stop_token_ids", (3, -1)),
        ("logprobs", -1),
        ("logprobs", 21),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("min_tokens", 17),
    ],
)
def test_validate_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} .*got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value}).validate()


def test_defaults_and_edges_are_valid():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, logprobs=20, repetition_penalty=0.5,
                   presence_penalty=-2, frequency_penalty=2, min_tokens=16, seed=-3).validate()
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-6).greedy


def test_resolve_seed_keeps_a_given_seed_and_invents_a_63_bit_one():
    assert resolve_seed(123) == 123
    seeds = {resolve_seed(None) for _ in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


# --- greedy and seeded draws ---------------------------------------------------------------------

def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    assert sample_one([1.0, 3.0, 3.0, 2.0], SamplingParams(temperature=0)).token_id == 1


def test_top_k_one_equals_greedy():
    logits = random_logits(16, 50)
    requests = [request(SamplingParams(temperature=1.5, top_k=1), seed=s, position=s) for s in range(16)]
    tokens = [t.token_id for t in Sampler().sample(logits, requests)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_seeded_sampling_is_a_pure_function_of_seed_position_and_logits():
    logits = random_logits(1, 64, seed=1)
    params = SamplingParams(temperature=1.0)
    alone = [sample_one(logits, params, seed=42, position=p).token_id for p in range(40)]
    # The same row inside a mixed batch, at another index, draws the same tokens.
    for position in range(40):
        batch = torch.cat([random_logits(1, 64, seed=9), logits, random_logits(1, 64, seed=10)])
        rows = [request(SamplingParams(temperature=0)), request(params, seed=42, position=position),
                request(SamplingParams(temperature=0.8, top_p=0.9), seed=5, position=position)]
        assert Sampler().sample(batch, rows)[1].token_id == alone[position]
    assert alone == [sample_one(logits, params, seed=42, position=p).token_id for p in range(40)]
    assert len(set(alone)) > 10, "the draw must depend on the position"
    other_seed = [sample_one(logits, params, seed=43, position=p).token_id for p in range(40)]
    assert other_seed != alone


def test_draws_are_pinned_so_workers_of_different_builds_agree():
    # Changing the (seed, position) mixing breaks prefill -> decode handoffs across versions.
    tokens = [sample_one(torch.zeros(8), SamplingParams(), seed=42, position=p).token_id for p in range(12)]
    assert tokens == [2, 7, 3, 7, 2, 7, 5, 0, 7, 7, 5, 4]


def test_draws_follow_the_distribution_and_never_pick_a_filtered_token():
    logits = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.25), -math.inf])
    counts = [0, 0, 0, 0]
    for position in range(4000):
        counts[sample_one(logits, SamplingParams(), seed=11, position=position).token_id] += 1
    assert counts[3] == 0
    assert [c / 4000 for c in counts] == pytest.approx([0.5, 0.25, 0.25, 0.0], abs=0.03)


def test_a_tiny_temperature_samples_the_argmax_without_nans():
    assert sample_one([1.0, 5.0, 4.999], SamplingParams(temperature=1e-30), seed=3).token_id == 1


# --- filters on crafted logits ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), PROBS),
        (SamplingParams(temperature=0.5), [0.16 / 0.3, 0.09 / 0.3, 0.04 / 0.3, 0.01 / 0.3]),
        (SamplingParams(top_k=2), [4 / 7, 3 / 7, 0, 0]),
        (SamplingParams(top_k=-1), PROBS),
        (SamplingParams(top_p=0.6), [4 / 7, 3 / 7, 0, 0]),
        (SamplingParams(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0]),
        (SamplingParams(top_p=0.05), [1, 0, 0, 0]),
        (SamplingParams(min_p=0.3), [4 / 9, 3 / 9, 2 / 9, 0]),
        (SamplingParams(min_p=0.6), [4 / 7, 3 / 7, 0, 0]),
        # top-p runs on the top-k distribution renormalized: 4/7 alone reaches 0.5.
        (SamplingParams(top_k=2, top_p=0.5), [1, 0, 0, 0]),
        (SamplingParams(top_p=0.5), [4 / 7, 3 / 7, 0, 0]),
        (SamplingParams(top_k=3, min_p=0.6), [4 / 7, 3 / 7, 0, 0]),
    ],
)
def test_sampling_probs_on_crafted_logits(params, expected):
    probs = sampling_probs(LOGITS.clone(), [params])
    assert probs[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_filters_apply_per_row():
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.6), SamplingParams(min_p=0.6)]
    probs = sampling_probs(LOGITS.repeat(4, 1), params)
    expected = torch.tensor([[1, 0, 0, 0], PROBS, [4 / 7, 3 / 7, 0, 0], [4 / 7, 3 / 7, 0, 0]])
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)


def test_top_p_keeps_every_token_tied_with_the_last_one_kept():
    # Each tied token holds about 0.3: two reach 0.4, and the third is tied with the second.
    probs = sampling_probs(torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0]]), [SamplingParams(top_p=0.4)])
    assert probs[0].tolist() == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 0], abs=1e-6)


def test_top_p_on_a_flat_distribution_matches_a_full_sort():
    logits = torch.linspace(0.0, -1.0, 1000).unsqueeze(0)
    probs = torch.softmax(logits, dim=-1)[0].double()
    expected_kept = int((probs.cumsum(0) - probs < 0.7).sum())
    assert expected_kept == 585, "the cut must lie far beyond the first candidates"
    kept = sampling_probs(logits, [SamplingParams(top_p=0.7)])[0] > 0
    assert kept.tolist() == [True] * expected_kept + [False] * (1000 - expected_kept)


def test_filtered_tokens_are_never_drawn():
    params = SamplingParams(top_p=0.6)
    drawn = {sample_one(LOGITS, params, seed=1, position=p).token_id for p in range(300)}
    assert drawn == {0, 1}


# --- penalties ------------------------------------------------------------------------------------

def test_penalties_match_vllm_on_crafted_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]]).repeat(3, 1)
    requests = [
        request(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                prompt=[0], output=[1, 1, 2]),
        request(SamplingParams(), prompt=[0, 1], output=[3]),
        request(SamplingParams(presence_penalty=2, frequency_penalty=2), prompt=[0, 0, 1], output=[]),
    ]
    apply_penalties(logits, requests)
    # Row 0, repetition on prompt+output: 2/2, -1*2, 0.5/2; then frequency x count and presence
    # once, on output tokens only. Row 1 has no penalties; row 2 penalizes no prompt token.
    assert logits.tolist() == [[1.0, -3.25, -0.5, 3.0, 1.0], [2.0, -1.0, 0.5, 3.0, 1.0], [2.0, -1.0, 0.5, 3.0, 1.0]]


@pytest.mark.parametrize(
    "params, output, expected",
    [
        (SamplingParams(temperature=0), [0], 0),
        (SamplingParams(temperature=0, repetition_penalty=2.0), [0], 1),  # 3/2 < 2
        (SamplingParams(temperature=0, presence_penalty=1.5), [0], 1),
        (SamplingParams(temperature=0, frequency_penalty=0.25), [0, 0], 0),  # 2.5 > 2: still 0
        (SamplingParams(temperature=0, frequency_penalty=0.25), [0, 0, 0, 0, 0], 1),  # 1.75 < 2
    ],
)
def test_penalties_change_the_greedy_choice(params, output, expected):
    assert sample_one([3.0, 2.0], params, output=output).token_id == expected


def test_penalty_token_ids_must_fit_the_vocabulary():
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\)"):
        sample_one([3.0, 2.0], SamplingParams(repetition_penalty=1.2), output=[5])


# --- min_tokens -----------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_ids_until_enough_tokens_are_out():
    logits = [0.0, 1.0, 5.0, 6.0]
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sample_one(logits, params, output=[0], eos=[3]).token_id == 1
    assert sample_one(logits, params, output=[0, 0], eos=[3]).token_id == 3
    ignore_eos = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,), ignore_eos=True)
    assert sample_one(logits, ignore_eos, output=[0], eos=[3]).token_id == 3


# --- logprobs -------------------------------------------------------------------------------------

def test_logprobs_are_raw_top_n_sorted_best_first():
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0)
    token = sample_one(LOGITS, params, output=[0])
    # The penalty moves the choice to token 1, but the logprobs are the model's own.
    assert token.token_id == 1
    assert token.logprob == pytest.approx(math.log(0.3), abs=1e-6)
    assert [t for t, _ in token.top_logprobs] == [0, 1, 2]
    assert [lp for _, lp in token.top_logprobs] == pytest.approx([math.log(p) for p in PROBS[:3]], abs=1e-6)


@pytest.mark.parametrize("logprobs, expected_ids", [(0, []), (1, [0]), (20, [0, 1, 2, 3])])
def test_logprobs_count(logprobs, expected_ids):
    token = sample_one(LOGITS, SamplingParams(logprobs=logprobs), seed=2)
    assert [t for t, _ in token.top_logprobs] == expected_ids
    assert token.logprob == pytest.approx(math.log(PROBS[token.token_id]), abs=1e-6)


def test_rows_without_logprobs_get_none_and_leave_the_others_exact():
    """Only rows that ask are scored; a row that asks gets the same figures as when sampled alone."""
    asking = SamplingParams(temperature=0, logprobs=2)
    logits = torch.cat([LOGITS, LOGITS.flip(1)])  # row 1 prefers token 3
    requests = [request(SamplingParams(temperature=0)), request(asking)]
    plain, scored = Sampler().sample(logits, requests)
    alone = Sampler().sample(logits[1:], requests[1:])[0]
    assert (plain.token_id, plain.logprob, plain.top_logprobs) == (0, None, [])
    assert (scored.token_id, scored.logprob, scored.top_logprobs) == (alone.token_id, alone.logprob, alone.top_logprobs)
    assert scored.token_id == 3
    assert scored.logprob == pytest.approx(math.log(PROBS[0]), abs=1e-6)
    assert [t for t, _ in scored.top_logprobs] == [3, 2]


def test_logprobs_ties_are_listed_lowest_id_first():
    token = sample_one([1.0, 2.0, 2.0, 2.0], SamplingParams(temperature=0, logprobs=3))
    assert [t for t, _ in token.top_logprobs] == [1, 2, 3]


# --- batch shape ----------------------------------------------------------------------------------

def test_batch_shape_must_match_the_requests():
    with pytest.raises(ValueError, match=r"logits of shape \(2, 4\) do not match 1 requests"):
        Sampler().sample(torch.zeros(2, 4), [request(SamplingParams())])
    assert Sampler().sample(torch.zeros(0, 4), []) == []


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**63 - 1),
    st.integers(0, 4096),
    st.floats(0.1, 2.0),
    st.integers(-1, 8),
    st.floats(0.05, 1.0),
    st.floats(0.0, 1.0),
)
def test_a_drawn_token_always_has_positive_probability(seed, position, temperature, top_k, top_p, min_p):
    logits = random_logits(1, 32, seed=position)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    params.validate()
    token = sample_one(logits, params, seed=seed, position=position)
    assert sampling_probs(logits.clone(), [params])[0, token.token_id] > 0
