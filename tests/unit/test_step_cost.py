"""The step-cost model's least-squares fit over recent steps."""

import numpy as np
import pytest

from services.common.step_cost import StepCost, StepCostFit


def test_fit_recovers_exact_coefficients() -> None:
    truth = StepCost(fixed_ms=12.0, per_token_ms=0.25, per_context_token_ms=0.002)
    fit = StepCostFit(window=64, min_samples=16, warmup=2)
    fit.record(1, 1, 5000.0)  # warm-up steps: left out
    fit.record(9, 9, 7000.0)
    for i in range(20):
        new, context = 1 + 7 * i, 100 + 313 * (i % 5)
        fit.record(new, context, truth.step_ms(new, context))
    cost = fit.fit()
    assert cost is not None
    assert cost.fixed_ms == pytest.approx(12.0)
    assert cost.per_token_ms == pytest.approx(0.25)
    assert cost.per_context_token_ms == pytest.approx(0.002)


def fit_of_mixed_steps(truth: StepCost, slow_ms: dict[int, float] | None = None) -> StepCost | None:
    """The fit of 24 steps of decodes and prompt chunks of varied sizes, each taking `truth`'s time,
    step i `slow_ms[i]` more."""
    fit = StepCostFit(window=64, min_samples=16, warmup=0)
    for i in range(24):
        new, context, decode_context = 8 + 13 * (i % 4), 2000 * (i % 3), 150 * (1 + i % 7)
        fit.record(new, context, truth.step_ms(new, context, decode_context) + (slow_ms or {}).get(i, 0.0),
                   decode_context)
    return fit.fit()


def test_fit_tells_the_decode_kv_rate_from_the_prompt_chunks() -> None:
    cost = fit_of_mixed_steps(
        StepCost(fixed_ms=46.0, per_token_ms=1.1, per_context_token_ms=0.0005, per_decode_context_ms=0.005))
    assert cost is not None
    assert (cost.fixed_ms, cost.per_token_ms) == (pytest.approx(46.0), pytest.approx(1.1))
    assert cost.per_context_token_ms == pytest.approx(0.0005)
    assert cost.per_decode_context_ms == pytest.approx(0.005)


def test_a_rate_whose_reads_never_happened_fits_as_zero() -> None:
    truth = StepCost(fixed_ms=12.0, per_token_ms=0.25, per_context_token_ms=0.002)
    fit = StepCostFit(window=64, min_samples=16, warmup=0)
    for i in range(20):  # a prefill worker: no decodes
        new, context = 16 + 16 * (i % 5), 500 + 313 * (i % 3)
        fit.record(new, context, truth.step_ms(new, context))
    cost = fit.fit()
    assert cost is not None
    assert cost.per_decode_context_ms == 0.0
    assert cost.per_context_token_ms == pytest.approx(0.002)


def test_chunk_cost_and_the_largest_chunk_within_a_time() -> None:
    cost = StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.01, per_decode_context_ms=0.1)
    # positions 31..55 read 32..56 entries: 25 + 0.01 * (25 * 31 + 25 * 26 / 2)
    assert cost.chunk_ms(31, 25) == pytest.approx(36.0)
    assert cost.largest_chunk(31, 37.0) == 25  # 26 tokens: 37.57 ms
    assert cost.largest_chunk(0, 37.2) == 31  # 32 tokens: 37.28 ms
    assert cost.largest_chunk(0, 0.5) == 0 and cost.largest_chunk(5, -1.0) == 0
    assert cost.decode_ms(40) == pytest.approx(5.0)
    assert StepCost(fixed_ms=1.0, per_token_ms=0.5, per_context_token_ms=0.0).largest_chunk(100, 10.0) == 20


def test_no_fit_until_enough_varied_steps() -> None:
    fit = StepCostFit(window=64, min_samples=16, warmup=0)
    for _ in range(15):
        fit.record(4, 400, 10.0)
    assert fit.fit() is None
    fit.record(4, 400, 10.0)
    assert fit.fit() is None  # 16 steps, all alike: the terms cannot be told apart


def test_negative_term_is_dropped_and_the_rest_refitted() -> None:
    fit = StepCostFit(window=64, min_samples=16, warmup=0)
    for i in range(20):
        new, context = 1 + i, 50 + 37 * (i % 3)
        fit.record(new, context, 5.0 + 0.5 * new - 0.001 * context)
    cost = fit.fit()
    assert cost is not None
    assert cost.per_context_token_ms == 0.0
    assert cost.fixed_ms >= 0 and cost.per_token_ms > 0


def test_overrun_is_a_quantile_of_the_recent_steps_excess_over_the_prediction() -> None:
    truth = StepCost(fixed_ms=12.0, per_token_ms=0.25, per_context_token_ms=0.002)
    fit = StepCostFit(window=64, min_samples=16, warmup=0, recent=4)
    for i in range(15):
        fit.record(1 + i, 100, truth.step_ms(1 + i, 100) + 50.0)
    assert fit.overrun_ms(truth) == 0.0  # fewer than min_samples steps
    fit.record(4, 100, truth.step_ms(4, 100) - 5.0)
    assert fit.overrun_ms(truth, quantile=1.0) == pytest.approx(50.0)
    for extra in (10.0, 20.0, 30.0, 40.0):  # only the last 4 steps count
        fit.record(8, 300, truth.step_ms(8, 300) + extra)
    assert fit.overrun_ms(truth, quantile=0.5) == pytest.approx(25.0)
    assert fit.overrun_ms(truth, quantile=1.0) == pytest.approx(40.0)
    for _ in range(4):
        fit.record(8, 300, truth.step_ms(8, 300) - 3.0)
    assert fit.overrun_ms(truth) == 0.0  # faster than predicted: no margin, never a negative one


def test_steps_far_from_the_fit_are_left_out_and_the_rest_fitted_exactly() -> None:
    slow = {5: 1500.0, 11: 1500.0, 17: 1500.0}  # another process held the cores: 10-25x the step
    cost = fit_of_mixed_steps(
        StepCost(fixed_ms=20.0, per_token_ms=1.2, per_context_token_ms=0.0015, per_decode_context_ms=0.01), slow)
    assert cost is not None
    assert (cost.fixed_ms, cost.per_token_ms) == (pytest.approx(20.0), pytest.approx(1.2))
    assert cost.per_context_token_ms == pytest.approx(0.0015)
    assert cost.per_decode_context_ms == pytest.approx(0.01)


def test_steps_within_a_few_ms_of_the_fit_all_count() -> None:
    fit = StepCostFit(window=64, min_samples=16, warmup=0)
    tokens = np.arange(10, 30)
    times = 20.0 + tokens + np.where(tokens % 2 == 1, 1.0, -1.0)  # 1 ms either way: under the 2 ms floor
    for new, ms in zip(tokens, times):
        fit.record(int(new), 0, float(ms))
    cost = fit.fit()
    assert cost is not None
    everything, *_ = np.linalg.lstsq(np.column_stack([np.ones(20), tokens]), times, rcond=None)
    assert (cost.fixed_ms, cost.per_token_ms) == (pytest.approx(everything[0]), pytest.approx(everything[1]))


def test_the_largest_step_is_the_most_tokens_a_recorded_step_computed_within_the_window() -> None:
    fit = StepCostFit(window=16, min_samples=16, warmup=1, recent=16)
    assert fit.largest_step_tokens() == 0
    fit.record(500, 0, 9000.0)  # a warm-up step: left out
    fit.record(40, 100, 50.0)
    fit.record(7, 100, 20.0)
    assert fit.largest_step_tokens() == 40
    for _ in range(14):
        fit.record(9, 100, 21.0)
    assert fit.largest_step_tokens() == 40  # 16 steps: the 40-token one is the window's oldest
    fit.record(9, 100, 21.0)
    assert fit.largest_step_tokens() == 9


def test_window_smaller_than_min_samples_is_refused() -> None:
    with pytest.raises(ValueError, match="need window >= min_samples >= 3 steps, warmup >= 0 and 0 < recent"):
        StepCostFit(window=4, min_samples=8)
    with pytest.raises(ValueError, match="recent=300"):
        StepCostFit(window=256, recent=300)


def test_steps_of_one_chunk_fit_with_the_fixed_cost_folded_into_the_tokens_when_asked() -> None:
    # A prefill worker's steps: always 512 tokens, the chunk's KV reads growing with its position.
    truth = StepCost(fixed_ms=51.2, per_token_ms=0.9, per_context_token_ms=0.0045)
    steps, folded = StepCostFit(min_samples=6, warmup=0), StepCostFit(min_samples=6, warmup=0, fold_fixed=True)
    for start in (0, 512, 0, 512, 1024, 0):
        reads = 512 * start + 512 * 513 // 2
        for fit in (steps, folded):
            fit.record(512, reads, truth.step_ms(512, reads))
    assert steps.fit() is None  # the fixed cost and the per-token one cannot be told apart
    fit = folded.fit()
    assert (fit.fixed_ms, fit.per_token_ms, fit.per_context_token_ms) == (
        0.0, pytest.approx(0.9 + 51.2 / 512), pytest.approx(0.0045))
    assert fit.chunk_ms(0, 512) == pytest.approx(truth.step_ms(512, 512 * 513 // 2))
    folded.record(100, 100 * 101 // 2, truth.step_ms(100, 100 * 101 // 2))  # the tokens vary: the fixed term again
    assert folded.fit().fixed_ms == pytest.approx(51.2)
