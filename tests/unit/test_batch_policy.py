"""Batching policy numbers from a given step-cost model and SLOs."""

import math

import pytest

from services.common.step_cost import StepCost
from services.common.store import WorkerRole

from services.scheduler.batch_policy import (
    BatchPolicyNumbers,
    ServiceTargets,
    SloPolicy,
    policy_for,
    prefill_ms,
    prompt_share,
)

COST = StepCost(fixed_ms=10.0, per_token_ms=0.05, per_context_token_ms=0.0001, per_decode_context_ms=0.001)


def targets(ttft_ms: float, itl_ms: float) -> ServiceTargets:
    return ServiceTargets(ttft_ms=ttft_ms, itl_ms=itl_ms, context_tokens=1024, typical_prompt_tokens=512,
                          max_seqs_cap=256, block_size=16)


def test_policy_numbers_from_cost_and_slos() -> None:
    # A chunk alone: the most tokens with 0.05 n + 0.0001 n (n + 1) / 2 <= 50 - 10 is 524, so 512 (whole blocks).
    # Prompts' share ceil(512 * 50 / 1000) = 26 tokens a step; the sequences: the cap (the worker admits by time).
    assert policy_for(COST, targets(ttft_ms=1000, itl_ms=50)) == BatchPolicyNumbers(
        max_num_batched_tokens=512 + 256, max_num_seqs=256, chunk_size=512, batch_window_ms=10, step_target_ms=50,
        min_prefill_tokens=26)


def test_the_prompt_share_prefills_a_typical_prompt_within_the_ttft_target() -> None:
    share = policy_for(COST, targets(ttft_ms=1000, itl_ms=50)).min_prefill_tokens
    assert math.ceil(512 / share) * 50 <= 1000 < math.ceil(512 / (share - 1)) * 50
    assert policy_for(COST, targets(ttft_ms=55, itl_ms=50)).min_prefill_tokens == 466


def test_a_registering_worker_gets_the_step_target_before_its_cost_model() -> None:
    slo = SloPolicy(ttft_ms=5000, itl_ms=200, context_tokens=1024, max_seqs_cap=64)
    # ceil(1024 * 200 / 5000) = 41 prompt tokens a step; the batch limits stay the worker's flags
    assert slo.before_fit(WorkerRole.COLOCATED) == slo.before_fit(WorkerRole.DECODE) == BatchPolicyNumbers(
        max_num_batched_tokens=0, max_num_seqs=0, chunk_size=0, batch_window_ms=0, step_target_ms=200,
        min_prefill_tokens=41)
    assert slo.before_fit(WorkerRole.PREFILL) is None


def test_window_is_the_ttft_slack_when_smaller_than_a_step() -> None:
    assert prefill_ms(COST, 512, 256) == pytest.approx(20 + 25.6 + 13.1328)
    assert policy_for(COST, targets(ttft_ms=65, itl_ms=50)).batch_window_ms == 10
    assert policy_for(COST, targets(ttft_ms=55, itl_ms=50)).batch_window_ms == 6  # 55 - 48.7328
    assert policy_for(COST, targets(ttft_ms=48, itl_ms=50)).batch_window_ms == 0


def test_an_itl_target_the_worker_cannot_meet_gets_steps_whose_tokens_cost_the_fixed_cost() -> None:
    # 11 ms leaves 1 ms beside the fixed cost: less than one decode (1.074) and a block of prompt (0.8136).
    # ceil(10 / 1.074) = 10 tokens, under a block: 16; half for prompts; no step target.
    assert policy_for(COST, targets(ttft_ms=1000, itl_ms=11)) == BatchPolicyNumbers(
        max_num_batched_tokens=16, max_num_seqs=8, chunk_size=16, batch_window_ms=10)
    slow = StepCost(fixed_ms=100.0, per_token_ms=0.05, per_context_token_ms=0.0001, per_decode_context_ms=0.001)
    # ceil(100 / 1.074) = 94 tokens, chunk 80; window: the slack 1000 - (7 * 100 + 38.7328) caps at the fixed cost
    assert policy_for(slow, targets(ttft_ms=1000, itl_ms=50)) == BatchPolicyNumbers(
        max_num_batched_tokens=94, max_num_seqs=47, chunk_size=80, batch_window_ms=100)


def test_a_cost_model_without_a_per_token_term_is_refused() -> None:
    with pytest.raises(ValueError, match="a step cost with no per-token term cannot size a budget"):
        policy_for(StepCost(fixed_ms=10.0, per_token_ms=0.0, per_context_token_ms=0.0), targets(1000, 50))


def test_a_prefill_worker_keeps_its_own_flags() -> None:
    slo = SloPolicy(ttft_ms=1000, itl_ms=50, context_tokens=512, max_seqs_cap=256)
    assert slo.for_worker(COST, 16, WorkerRole.PREFILL) is None
    expected = policy_for(COST, ServiceTargets(ttft_ms=1000, itl_ms=50, context_tokens=512, typical_prompt_tokens=512,
                                               max_seqs_cap=256, block_size=16))
    assert slo.for_worker(COST, 16, WorkerRole.DECODE) == slo.for_worker(COST, 16, WorkerRole.COLOCATED) == expected


def test_a_fit_without_a_per_token_cost_leaves_the_policy_as_it_is() -> None:
    slo = SloPolicy(ttft_ms=1000, itl_ms=50, context_tokens=512, max_seqs_cap=256)
    assert slo.for_worker(StepCost(fixed_ms=40.0, per_token_ms=0.0, per_context_token_ms=0.0), 16,
                          WorkerRole.COLOCATED) is None


def test_nonpositive_target_is_refused() -> None:
    with pytest.raises(ValueError, match="itl_ms must be > 0, got 0"):
        targets(ttft_ms=1000, itl_ms=0)
