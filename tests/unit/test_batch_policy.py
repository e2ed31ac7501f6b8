"""Batching policy numbers from a given step-cost model and SLOs."""

import pytest

from services.common.step_cost import StepCost
from services.common.store import WorkerRole
import math

from services.scheduler.batch_policy import (
    BatchPolicyNumbers,
    ServiceTargets,
    SloPolicy,
    policy_for,
    prefill_ms,
    prompt_share,
    token_budget,
)

COST = StepCost(fixed_ms=10.0, per_token_ms=0.05, per_context_token_ms=0.0001)


def targets(ttft_ms: float, itl_ms: float) -> ServiceTargets:
    return ServiceTargets(ttft_ms=ttft_ms, itl_ms=itl_ms, context_tokens=1024, typical_prompt_tokens=512,
                          max_seqs_cap=256, block_size=16)


def test_policy_numbers_from_cost_and_slos() -> None:
    # budget floor(40 / (0.05 + 0.1024)) = 262; prompts' share ceil(512 * 50 / 1000) = 26, so at most
    # 236 sequences; chunk 256 (16 whole blocks); window = fixed cost 10 ms
    assert policy_for(COST, targets(ttft_ms=1000, itl_ms=50)) == BatchPolicyNumbers(
        max_num_batched_tokens=262, max_num_seqs=236, chunk_size=256, batch_window_ms=10)


def test_a_step_full_of_decodes_leaves_prompts_enough_to_meet_the_ttft_target() -> None:
    goal = targets(ttft_ms=1000, itl_ms=50)
    policy = policy_for(COST, goal)
    left = policy.max_num_batched_tokens - policy.max_num_seqs
    assert left == prompt_share(goal) == 26
    assert math.ceil(512 / left) * 50 <= 1000 < math.ceil(512 / (left - 1)) * 50


def test_a_budget_too_small_for_both_targets_keeps_half_for_prompts() -> None:
    goal = targets(ttft_ms=100, itl_ms=50)
    assert prompt_share(goal) == 256
    assert policy_for(COST, goal) == BatchPolicyNumbers(
        max_num_batched_tokens=262, max_num_seqs=131, chunk_size=256, batch_window_ms=10)


def test_the_scheduler_cap_bounds_the_sequences() -> None:
    goal = ServiceTargets(ttft_ms=1000, itl_ms=50, context_tokens=1024, typical_prompt_tokens=512, max_seqs_cap=64,
                          block_size=16)
    assert policy_for(COST, goal).max_num_seqs == 64


def test_window_is_the_ttft_slack_when_smaller_than_a_step() -> None:
    assert prefill_ms(COST, 512, 256) == pytest.approx(20 + 25.6 + 13.1328)
    assert policy_for(COST, targets(ttft_ms=65, itl_ms=50)).batch_window_ms == 6
    assert policy_for(COST, targets(ttft_ms=50, itl_ms=50)).batch_window_ms == 0


def test_full_budget_step_meets_the_itl_target() -> None:
    policy = policy_for(COST, targets(ttft_ms=1000, itl_ms=50))
    assert COST.step_ms(policy.max_num_batched_tokens, policy.max_num_batched_tokens * 1024) <= 50
    assert COST.step_ms(policy.max_num_batched_tokens + 1, (policy.max_num_batched_tokens + 1) * 1024) > 50


def test_an_itl_target_the_worker_cannot_meet_gets_steps_whose_tokens_cost_the_fixed_cost() -> None:
    assert token_budget(COST, itl_ms=5, context_tokens=1024) == 0
    # ceil(10 / 0.1524) = 66 tokens; chunk 64; prompts' share ceil(512 * 5 / 1000) = 3
    assert policy_for(COST, targets(ttft_ms=1000, itl_ms=5)) == BatchPolicyNumbers(
        max_num_batched_tokens=66, max_num_seqs=63, chunk_size=64, batch_window_ms=10)
    assert token_budget(COST, itl_ms=11, context_tokens=1024) == 6  # under a block: the target is lost too
    assert policy_for(COST, targets(ttft_ms=1000, itl_ms=11)).max_num_batched_tokens == 66
    assert policy_for(COST, targets(ttft_ms=1000, itl_ms=12.5)).max_num_batched_tokens == 16


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
