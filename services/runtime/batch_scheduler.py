"""Iteration-level batching: which sequences run in the next step, and how many tokens each.

Running sequences go first, in arrival order, one chunk each (a decode token or the next
prompt chunk); a prompt chunk leaves one token of the budget for every decode behind it, so a long
prompt admitted before them never takes a step from the decodes. Waiting sequences are admitted
after them while the token budget, the sequence cap and the free blocks allow. With a step target
(the scheduler's ITL target, services/scheduler/batch_policy.py) prompt chunks also share only the
time the step's decodes leave under it (less a fixed headroom for the token's delivery), less the
margin by which recent steps overran their prediction, priced by the worker's step-cost model from
the decodes' actual contexts and each chunk's position, in steps of at most twice the tokens of the
largest step the model was fitted on (past that the fit is an extrapolation); and a waiting
sequence is admitted only while the decodes' steps, its own included, leave `min_prefill_tokens`
of room (so the running set is sized from actual contexts, not a typical one). A step without
decodes gives prompts at least that minimum, so they always progress; a step whose decodes fill the
target gives new prompts nothing, since a minimum chunk deep in a long prompt cost as much as the whole
target, but a prompt already under way keeps `StepTarget.floor_ms` of prompt time while the step stays
within the first-gap budget below (on a hybrid decode worker, which aims under that budget, a prompt
placed there is never starved by the decodes that arrive from the prefill worker). A sequence whose KV
was imported (its first token sampled on a prefill worker) waits for the step in progress and then its
own first decode step: while a KV import is under way, prompt chunks leave room for the step that will
admit it (the hand-off's allowance and that step's predicted decodes within the first-gap budget,
`StepTarget.gap_ms`), and the step that decodes its first token ends within that budget of its arrival;
so its first gap, which the client sees, stays within the ITL target like every other. When a running
sequence needs a block and none is free, the most recently admitted running sequence is preempted: its
blocks are released and it waits at the head of the queue to be recomputed (its tokens so far become its
prompt for the KV).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.common.blocks import ceil_div
from services.common.step_cost import STEP_HEADROOM, StepCost, StepCostFit, aimed_step_ms
from services.runtime.block_manager import BlockManager
from services.runtime.counters import EngineCounters
from services.runtime.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes(self) -> bool:
        """After this chunk every token has KV, so the next token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    chunk_size: int
    enable_prefix_cache: bool


# A step may compute at most this many times the tokens of the largest step its cost model was fitted
# on: the first fit, over steps of the 41-token minimum chunk, priced a 267-token step at 183 ms and it
# took 409 (the precision's kernels change with the row count, which a linear fit of small steps misses).
TRUSTED_GROWTH = 2
# What an imported sequence's hand-off takes from its first token's arrival here to the step boundary that
# admits it (its last layers read from shared memory and the engine call queued): 5-20 ms from the prefill
# worker's first token to the admission call in traced c16-long runs on the 2-core AMD EPYC.
HANDOFF_ALLOWANCE_MS = 10.0


@dataclass(frozen=True, slots=True)
class StepTarget:
    """Prompt chunks fit a step predicted (by `cost`) to end within `sizing_ms`: `step_ms` less
    `margin_ms` (how far recent steps overran their prediction), the margin at most half the target, in
    steps of at most `max_step_tokens` tokens (None: the token budget alone). A sequence is admitted while
    the decodes' steps, its own included, leave `min_prefill_tokens` room, and a step without decodes
    gives prompts at least that many. Without a cost model yet (a fresh worker) prompts get only the
    minimum, and admission only the caps. `gap_ms` (None: `step_ms`) is the first-gap budget of an
    imported sequence: from its first token's arrival, through the step in progress, to the end of the
    step that decodes its next token (the ITL target less the delivery's headroom)."""

    step_ms: float
    min_prefill_tokens: int
    cost: StepCost | None
    margin_ms: float = 0.0
    max_step_tokens: int | None = None
    gap_ms: float | None = None

    @property
    def margin_used_ms(self) -> float:
        return min(self.margin_ms, self.step_ms / 2)

    @property
    def sizing_ms(self) -> float:
        return self.step_ms - self.margin_used_ms

    @property
    def floor_ms(self) -> float:
        """The prompt time a step keeps for a prompt under way however long its decodes, within the
        first-gap budget: that budget's excess over the aimed step (0 where they are one, as on a
        colocated worker)."""
        return 0.0 if self.gap_ms is None else max(0.0, self.gap_ms - self.step_ms)

    @property
    def gap_sizing_ms(self) -> float:
        """The first-gap budget less the same margin."""
        return (self.step_ms if self.gap_ms is None else self.gap_ms) - self.margin_used_ms

    @classmethod
    def of(cls, itl_ms: float, min_prefill_tokens: int, steps: StepCostFit,
           headroom: float = STEP_HEADROOM) -> StepTarget:
        """The target for steps under the ITL target `itl_ms` less `headroom`, with the worker's fit of
        its `steps`, the margin they overran it by and the most tokens they trust it for; with no cost model
        when the fit prices no prompt token (noise on a loaded machine fitted 0 ms a token and 0 a KV
        entry: such a fit would size chunks without bound)."""
        step_ms = aimed_step_ms(itl_ms, headroom)
        fit = steps.fit()
        if fit is None or (fit.per_token_ms <= 0 and fit.per_context_token_ms <= 0):
            return cls(step_ms, min_prefill_tokens, None)
        return cls(step_ms, min_prefill_tokens, fit, steps.overrun_ms(fit),
                   TRUSTED_GROWTH * steps.largest_step_tokens(), max(step_ms, aimed_step_ms(itl_ms, STEP_HEADROOM)))


@dataclass(slots=True)
class PromptTime:
    """One step under its target: `decodes_ms` the running decodes cost a step (the admitted ones' from
    the next), `left_ms` what this step has left for prompt chunks, `left_tokens` the prompt tokens the
    fit is trusted for (None: any), `floor_tokens` what it still owes them."""

    target: StepTarget
    decodes_ms: float
    left_ms: float
    left_tokens: int | None
    floor_tokens: int
    admit_ms: float | None = None  # the step a sequence's admission is judged against (None: the sizing time)

    def room(self, start: int) -> int:
        """Prompt tokens from position `start` this step still has room for."""
        cost = self.target.cost
        if cost is None:
            return self.floor_tokens
        timed = cost.largest_chunk(start, self.left_ms)
        return max(timed if self.left_tokens is None else min(timed, self.left_tokens), self.floor_tokens)

    def spend(self, start: int, tokens: int) -> None:
        if self.target.cost is not None:
            self.left_ms -= self.target.cost.chunk_ms(start, tokens)
        if self.left_tokens is not None:
            self.left_tokens = max(0, self.left_tokens - tokens)
        self.floor_tokens = max(0, self.floor_tokens - tokens)

    def admits(self, context_tokens: int) -> bool:
        """Whether a sequence decoding from `context_tokens` leaves its later steps the minimum prompt chunk."""
        cost = self.target.cost
        if cost is None:
            return True
        decodes_ms = self.decodes_ms + cost.decode_ms(context_tokens)
        limit_ms = self.target.sizing_ms if self.admit_ms is None else self.admit_ms
        return cost.fixed_ms + decodes_ms + cost.chunk_ms(0, self.target.min_prefill_tokens) <= limit_ms

    def admit(self, context_tokens: int) -> None:
        self.admit_ms = None  # one prompt under way at a time takes the floor
        if self.target.cost is not None:
            self.decodes_ms += self.target.cost.decode_ms(context_tokens)


class IterationScheduler:
    def __init__(self, blocks: BlockManager, counters: EngineCounters, limits: SchedulerLimits,
                 on_allocate: Callable[[list[int]], None] = lambda block_ids: None) -> None:
        """`on_allocate(block_ids)` sees every block handed to a sequence (the KV cache readies them);
        preemptions and prefix-cache lookups are counted in `counters`."""
        self.blocks = blocks
        self.counters = counters
        self.limits = limits
        self._on_allocate = on_allocate
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.target: StepTarget | None = None  # set by the worker from the scheduler's policy and its cost fit
        # The KV entries each imported sequence on its way here will decode from (the KV hand-off sets it).
        self.incoming: Callable[[], list[int]] = list
        self.clock: Callable[[], float] = time.monotonic
        self._arrivals: dict[str, float] = {}  # imported, first decode not yet scheduled: request id -> clock()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, arrived_at: float | None = None) -> None:
        """A sequence whose KV is already in its blocks (imported); it decodes from the next step.
        `arrived_at` (`clock()` time): when its first token reached this worker, the start of the gap to
        its next token, which the step that decodes it keeps within the first-gap budget."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if arrived_at is not None:
            self._arrivals[seq.request_id] = arrived_at

    def remove(self, seq: Sequence) -> None:
        self._arrivals.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.limits.max_num_batched_tokens
        prompts = self._prompt_time()
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an earlier one's blocks
                continue
            start, is_prompt = seq.num_computed_tokens, seq.num_uncomputed_tokens > 1
            room = min(budget - self._decodes_behind(seq), self._prompt_room(prompts, start)) if is_prompt else budget
            num_new = min(seq.num_uncomputed_tokens, room, self.limits.chunk_size)
            if num_new <= 0 or not self._ensure_blocks(seq, num_new):
                continue
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            if is_prompt and prompts is not None:
                prompts.spend(start, num_new)
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            if prompts is not None and self.running and not prompts.admits(self.waiting[0].num_tokens):
                break
            chunk = self._admit(self.waiting[0], budget, prompts)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(chunk.seq)
            chunks.append(chunk)
            budget -= chunk.num_new_tokens
        for chunk in chunks:
            self._arrivals.pop(chunk.seq.request_id, None)
        return chunks

    def _prompt_time(self) -> PromptTime | None:
        """The step's sizing time less the fixed cost and the running decodes' (a decode at position p reads
        p + 1 entries), its trusted tokens less the decodes'; the minimum prompt chunk only in a step
        without decodes."""
        target = self.target
        if target is None:
            return None
        if target.cost is None:
            return PromptTime(target, 0.0, 0.0, None, target.min_prefill_tokens)
        decodes = [seq.num_tokens for seq in self.running if seq.num_uncomputed_tokens == 1]
        decodes_ms = sum(target.cost.decode_ms(context) for context in decodes)
        left_tokens = None if target.max_step_tokens is None else max(0, target.max_step_tokens - len(decodes))
        step_ms = target.sizing_ms
        under_way = any(seq.num_computed_tokens > 0 and seq.num_uncomputed_tokens > 1 for seq in self.running)
        if under_way or self.waiting:
            # A prompt under way, or the next one, is not starved by decodes that fill the aimed step: it may
            # take the room between that step and the first-gap budget (a hybrid decode worker's 40 ms under 200).
            step_ms = max(step_ms, min(target.gap_sizing_ms, target.cost.fixed_ms + decodes_ms + target.floor_ms))
        step_ms = min(step_ms, self._first_gap_step_ms(target, target.cost, decodes_ms))
        # With none under way, the next prompt is admitted while its steps stay within the first-gap budget.
        return PromptTime(target, decodes_ms, step_ms - target.cost.fixed_ms - decodes_ms, left_tokens,
                          0 if decodes else target.min_prefill_tokens, None if under_way else target.gap_sizing_ms)

    def _first_gap_step_ms(self, target: StepTarget, cost: StepCost, decodes_ms: float) -> float:
        """The longest this step may take for imported sequences' first gaps (inf: none is concerned).
        One that arrived decodes its first token in it: the step ends within the first-gap budget of the
        earliest arrival. While imports are under way, this step may be the one in progress when one
        arrives: it leaves the hand-off's allowance and the next step (these decodes and the newcomers')."""
        if self._arrivals:
            waited_ms = (self.clock() - min(self._arrivals.values())) * 1000
            return target.gap_sizing_ms - waited_ms
        incoming = self.incoming()
        if not incoming:
            return math.inf
        next_step_ms = cost.fixed_ms + decodes_ms + sum(cost.decode_ms(context) for context in incoming)
        return target.gap_sizing_ms - HANDOFF_ALLOWANCE_MS - next_step_ms

    @staticmethod
    def _prompt_room(prompts: PromptTime | None, start: int) -> int:
        return prompts.room(start) if prompts is not None else 1 << 30

    def _decodes_behind(self, seq: Sequence) -> int:
        """Running sequences after `seq` whose next chunk is a single token."""
        behind = self.running[self.running.index(seq) + 1 :]
        return sum(1 for other in behind if other.num_uncomputed_tokens == 1)

    def _ensure_blocks(self, seq: Sequence, num_new: int) -> bool:
        """Finds room for `seq`'s next chunk, preempting from the tail; False if `seq` itself was preempted."""
        needed = self._blocks_needed(seq, num_new)
        while not self.blocks.can_allocate(needed):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        seq.block_table.extend(self._allocate(needed))
        return True

    def _admit(self, seq: Sequence, budget: int, prompts: PromptTime | None) -> ScheduledChunk | None:
        # A request for prompt logprobs computes its whole prompt: cached blocks have no logits.
        looked_up = self.limits.enable_prefix_cache and not seq.block_table and seq.params.prompt_logprobs is None
        hits = self._match_prefix(seq) if looked_up else []
        seq.num_computed_tokens = len(hits) * self.blocks.block_size
        start = seq.num_computed_tokens
        num_new = min(seq.num_uncomputed_tokens, budget, self.limits.chunk_size, self._prompt_room(prompts, start))
        needed = self._blocks_needed(seq, num_new) - len(hits)
        if num_new <= 0 or not self.blocks.can_allocate(needed):
            self.blocks.release(hits)
            seq.num_computed_tokens = 0
            return None
        seq.block_table = hits + self._allocate(needed)
        if looked_up:  # counted once admitted: a sequence that must wait for blocks looks again later
            self.counters.prefix_queried_tokens += seq.num_tokens
            self.counters.prefix_hit_tokens += len(hits) * self.blocks.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        if prompts is not None:
            prompts.spend(start, num_new)
            prompts.admit(seq.num_tokens)
        return ScheduledChunk(seq, num_new)

    def _allocate(self, n: int) -> list[int]:
        block_ids = self.blocks.allocate(n)
        self._on_allocate(block_ids)
        return block_ids

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Acquires the cached blocks of `seq`'s longest cached prefix, always leaving a token to compute."""
        usable = (seq.num_tokens - 1) // self.blocks.block_size
        hits, seq.block_hashes = self.blocks.match_tokens(seq.token_ids, usable, seq.salt, seq.lora)
        self.blocks.acquire(hits)
        return hits

    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        total = ceil_div(seq.num_computed_tokens + num_new, self.blocks.block_size)
        return max(0, total - len(seq.block_table))

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._arrivals.pop(seq.request_id, None)
        self.release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(seq)

    def release_blocks(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
