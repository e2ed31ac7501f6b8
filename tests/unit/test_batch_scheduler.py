"""Iteration-level batching: which sequences a step runs, and how many tokens each (exact chunks)."""

from dataclasses import replace

from services.runtime.batch_scheduler import IterationScheduler, ScheduledChunk, SchedulerLimits
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
