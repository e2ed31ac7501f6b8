"""Iteration-level batching: which sequences a step runs, and how many tokens each (exact chunks)."""

from collections.abc import Callable
from dataclasses import replace

import pytest

from services.common.step_cost import StepCost, StepCostFit
from services.runtime.batch_scheduler import IterationScheduler, ScheduledChunk, SchedulerLimits, StepTarget
from services.runtime.block_manager import BlockManager
from services.runtime.counters import EngineCounters
from services.runtime.sampler import SamplingParams
from services.runtime.sequence import Sequence


def scheduler(budget: int, chunk: int, max_seqs: int = 8) -> IterationScheduler:
    limits = SchedulerLimits(max_num_batched_tokens=budget, max_num_seqs=max_seqs, chunk_size=chunk,
                             enable_prefix_cache=False)
    return IterationScheduler(BlockManager(64, 4, enable_prefix_cache=False), EngineCounters(), limits)


def seq(name: str, prompt_tokens: int) -> Sequence:
    return Sequence(name, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=8), seed=0)


def run(chunks: list[ScheduledChunk]) -> list[tuple[str, int]]:
    """What the engine does with a step's chunks: their tokens get KV; a completed one samples a token."""
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.num_new_tokens
        if chunk.seq.num_computed_tokens == chunk.seq.num_tokens:
            chunk.seq.token_ids.append(7)
    return [(chunk.seq.request_id, chunk.num_new_tokens) for chunk in chunks]


def test_a_prompt_chunk_leaves_a_token_for_each_decode_behind_it() -> None:
    batches = scheduler(budget=16, chunk=10)
    for name, tokens in (("long", 40), ("a", 3), ("b", 3)):
        batches.add(seq(name, tokens))
    assert run(batches.schedule()) == [("long", 10), ("a", 3), ("b", 3)]
    batches.limits = replace(batches.limits, max_num_batched_tokens=10)
    # The long prompt was admitted first, but the decodes behind it keep one token each of the budget.
    assert run(batches.schedule()) == [("long", 8), ("a", 1), ("b", 1)]
    assert run(batches.schedule()) == [("long", 8), ("a", 1), ("b", 1)]


def test_decodes_ahead_of_a_prompt_take_their_token_first() -> None:
    batches = scheduler(budget=16, chunk=16)
    batches.add(seq("a", 3))
    batches.add(seq("long", 40))
    assert run(batches.schedule()) == [("a", 3), ("long", 13)]
    batches.add(seq("b", 2))
    assert run(batches.schedule()) == [("a", 1), ("long", 15)]
    assert batches.waiting[0].request_id == "b"  # the budget is spent: b waits for the next step


def test_a_budget_the_decodes_fill_gives_the_prompt_nothing() -> None:
    batches = scheduler(budget=16, chunk=8)
    for name, tokens in (("long", 40), ("a", 2), ("b", 2)):
        batches.add(seq(name, tokens))
    assert run(batches.schedule()) == [("long", 8), ("a", 2), ("b", 2)]
    batches.limits = replace(batches.limits, max_num_batched_tokens=2)
    assert run(batches.schedule()) == [("a", 1), ("b", 1)]


# A decode at position p costs 1 + 0.1 (p + 1) ms; a prompt chunk n + 0.01 * (its KV reads) ms; 10 ms a step.
COST = StepCost(fixed_ms=10.0, per_token_ms=1.0, per_context_token_ms=0.01, per_decode_context_ms=0.1)


def with_two_decodes() -> IterationScheduler:
    """Decodes a and b (4 tokens each: their next token reads 4 KV entries), and no target yet."""
    batches = scheduler(budget=64, chunk=64)
    batches.add(seq("a", 3))
    batches.add(seq("b", 3))
    assert run(batches.schedule()) == [("a", 3), ("b", 3)]
    return batches


def test_prompt_chunks_fill_the_time_the_decodes_leave_under_the_step_target() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST)
    batches.add(seq("long", 40))
    # 50 - 10 - 2 * 1.4 = 37.2 ms: 31 tokens from position 0 (32 would take 37.28)
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 31)]
    # 50 - 10 - 2 * 1.5 = 37 ms: from position 31 the chunk's reads cost more, 25 tokens fit but 9 are left
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 9)]


def test_a_running_prompt_chunk_is_priced_from_its_position() -> None:
    batches = scheduler(budget=64, chunk=64)
    batches.target = StepTarget(step_ms=47.0, min_prefill_tokens=4, cost=COST)
    batches.add(seq("long", 80))
    assert run(batches.schedule()) == [("long", 31)]  # 37 ms: 31 tokens from position 0 take 35.96
    assert run(batches.schedule()) == [("long", 25)]  # from position 31: 36 ms; 26 would take 37.57


def test_decodes_that_leave_no_time_give_the_prompts_nothing_and_a_step_without_decodes_the_minimum() -> None:
    batches = scheduler(budget=64, chunk=8)
    for name, tokens in (("a", 3), ("b", 3), ("long", 40)):
        batches.add(seq(name, tokens))
    assert run(batches.schedule()) == [("a", 3), ("b", 3), ("long", 8)]
    batches.target = StepTarget(step_ms=12.0, min_prefill_tokens=5, cost=COST)
    batches.add(seq("c", 20))
    # 12 - 10 - 2 * 1.4 < 0: the step holds to its target, the running prompt waits, and c is not admitted
    assert run(batches.schedule()) == [("a", 1), ("b", 1)]
    batches.remove(batches.running[0])
    batches.remove(batches.running[0])
    # No decodes: 2 ms have room for 1 token from position 8, but the prompt takes the 5-token minimum;
    # c would decode at 3 ms, and 10 + 3 + 5.15 (5 prompt tokens) > 12
    assert run(batches.schedule()) == [("long", 5)]
    assert [s.request_id for s in batches.waiting] == ["c"]


def test_the_margin_recent_steps_overran_by_comes_off_the_step_target_at_most_half_of_it() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=60.0, min_prefill_tokens=4, cost=COST, margin_ms=10.0)
    batches.add(seq("long", 80))
    # 60 - 10 margin - 10 - 2 * 1.4 = 37.2 ms: 31 tokens, as with a 50 ms target and no margin
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 31)]
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST, margin_ms=100.0)
    # the margin is held to 25 ms: 25 - 10 - 2 * 1.5 = 12 ms; from position 31, 8 tokens take 10.84 (9: 12.24)
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 8)]


def test_a_sequence_is_admitted_while_the_decodes_leave_the_minimum_prompt_chunk() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST)
    batches.add(seq("x", 200))
    batches.add(seq("y", 150))
    # x decodes from 200 entries at 21 ms: 10 + 2.8 + 21 + 4.1 (4 prompt tokens) <= 50; y's 16 ms more would not fit
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("x", 31)]
    assert [s.request_id for s in batches.waiting] == ["y"]


def test_before_the_worker_has_a_cost_model_prompts_take_only_the_minimum() -> None:
    batches = scheduler(budget=64, chunk=64)
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=6, cost=None)
    batches.add(seq("long", 40))
    batches.add(seq("short", 3))
    assert run(batches.schedule()) == [("long", 6)]
    assert run(batches.schedule()) == [("long", 6)]  # the minimum is spent: short waits
    assert [s.request_id for s in batches.waiting] == ["short"]


def fitted(times: Callable[[int, int], float]) -> StepCostFit:
    """A fit over 16 steps of 1-16 tokens, each a prompt chunk from position 0 (`times(tokens, reads)` ms)."""
    steps = StepCostFit(window=64, min_samples=16, warmup=0, recent=16)
    for tokens in range(1, 17):
        steps.record(tokens, tokens * (tokens + 1) // 2, times(tokens, tokens * (tokens + 1) // 2))
    return steps


def test_the_target_leaves_the_headroom_and_trusts_the_fit_for_twice_its_largest_step() -> None:
    steps = fitted(lambda tokens, reads: COST.step_ms(tokens, reads))
    target = StepTarget.of(200.0, 41, steps)
    assert (target.step_ms, target.min_prefill_tokens, target.max_step_tokens) == (160.0, 41, 32)
    assert target.cost.per_token_ms == pytest.approx(1.0) and target.margin_ms == pytest.approx(0.0, abs=1e-9)


def test_a_fit_that_prices_no_prompt_token_gives_the_minimum_instead_of_unbounded_chunks() -> None:
    noise = fitted(lambda tokens, reads: 100.0 - 0.5 * tokens)  # faster with more tokens: fits 0 ms a token
    assert noise.fit().per_token_ms == 0.0
    assert StepTarget.of(200.0, 41, noise) == StepTarget(160.0, 41, None)
    assert StepTarget.of(200.0, 41, StepCostFit()) == StepTarget(160.0, 41, None)  # no fit yet


def test_prompt_chunks_stay_within_the_tokens_the_fit_is_trusted_for() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST, max_step_tokens=12)
    batches.add(seq("long", 40))
    batches.add(seq("short", 3))
    # the time would hold 31 prompt tokens (as without the cap), the fit's trust 12 - 2 decodes = 10;
    # short is not admitted: no trusted token is left for its chunk
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 10)]
    assert [s.request_id for s in batches.waiting] == ["short"]
    batches.remove(batches.running[0])
    batches.remove(batches.running[0])
    batches.target = replace(batches.target, max_step_tokens=2)
    # no decodes: the minimum prompt chunk goes through whatever the trust
    assert run(batches.schedule()) == [("long", 4)]


def test_a_budget_of_one_chunk_prefills_prompts_in_arrival_order_the_next_one_in_the_room_left() -> None:
    # A prefill worker's steps (services/prefill/main.py): its prompts leave the engine once prefilled.
    batches = scheduler(budget=8, chunk=8)
    for name, tokens in (("first", 20), ("second", 20), ("short", 5)):
        batches.add(seq(name, tokens))
    steps = []
    while batches.has_work():
        steps.append(run(batches.schedule()))
        for done in [s for s in batches.running if s.num_uncomputed_tokens == 1]:
            batches.remove(done)
    assert steps == [[("first", 8)], [("first", 8)], [("first", 4), ("second", 4)], [("second", 8)],
                     [("second", 8)], [("short", 5)]]


def imported(batches: IterationScheduler, name: str, prompt_tokens: int) -> Sequence:
    """A sequence whose prompt KV came from a prefill worker with its first token: it decodes next."""
    arrived = seq(name, prompt_tokens)
    arrived.token_ids.append(9)
    arrived.num_computed_tokens = prompt_tokens
    arrived.block_table = batches.blocks.allocate(-(-arrived.num_tokens // batches.blocks.block_size))
    return arrived


def test_the_step_that_decodes_an_imported_sequence_first_ends_within_the_gap_budget_of_its_arrival() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST, gap_ms=60.0)
    batches.clock = lambda: 100.0
    batches.add(seq("long", 80))
    batches.add_running(imported(batches, "r", 7), arrived_at=99.97)  # its first token came 30 ms ago
    # 60 - 30 ms = 30 ms for the step: 30 - 10 - (1.4 + 1.4 + 1.8 for the decodes) = 15.4 ms, 14 prompt tokens
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("r", 1), ("long", 14)]
    # r's first gap is closed: the step target again, 50 - 10 - (1.5 + 1.5 + 1.9) = 35.1 ms, 27 tokens from 14
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("r", 1), ("long", 27)]


def test_an_arrival_past_its_gap_budget_gets_a_step_of_decodes_alone() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST, gap_ms=60.0)
    batches.clock = lambda: 100.0
    batches.add(seq("long", 80))
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 31)]
    batches.add_running(imported(batches, "r", 7), arrived_at=99.9)  # 100 ms ago: the budget is spent
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("r", 1)]


def test_while_a_kv_import_is_under_way_a_step_leaves_room_for_the_hand_off_and_the_step_that_admits_it() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=50.0, min_prefill_tokens=4, cost=COST, gap_ms=60.0)
    batches.incoming = lambda: [8]
    batches.add(seq("long", 80))
    # 60 - 10 (hand-off) - (10 + 2.8 + 1.8: the next step with the newcomer) = 35.4 ms for this step:
    # 35.4 - 10 - 2.8 = 22.6 ms of prompt, 20 tokens (without the import: 31)
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 20)]
    batches.incoming = list
    # 50 - 10 - 2 * 1.5 = 37 ms from position 20: 27 tokens (28 would take 37.66)
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 27)]


def test_decodes_that_fill_the_aimed_step_leave_a_prompt_the_first_gap_budgets_excess() -> None:
    batches = with_two_decodes()
    batches.target = StepTarget(step_ms=12.0, min_prefill_tokens=4, cost=COST, gap_ms=22.0)
    batches.add(seq("long", 80))
    # 12 - 10 - 2.8 < 0 leaves no prompt time; with no prompt under way, long is admitted while its steps
    # stay within the 22 ms budget: 10 + 2.8 + 9 (its decode from 80) + 4.06 (4 tokens) > 22, not yet
    assert run(batches.schedule()) == [("a", 1), ("b", 1)]
    batches.target = StepTarget(step_ms=12.0, min_prefill_tokens=4, cost=COST, gap_ms=32.0)
    # 10 + 3 + 9 + 4.06 <= 32: admitted; the step keeps 20 ms (32 - 12) of prompt time, 10 + 3 + 20 held
    # to 32: 19 ms from position 0, 17 tokens (18 would take 19.71)
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 17)]
    # under way: 32 - 10 - 3.2 = 18.8 ms from position 17, 15 tokens (16 would take 20.08)
    assert run(batches.schedule()) == [("a", 1), ("b", 1), ("long", 15)]
    batches.target = StepTarget(step_ms=12.0, min_prefill_tokens=4, cost=COST)  # no budget beyond the step
    assert run(batches.schedule()) == [("a", 1), ("b", 1)]
