"""A worker's batching policy from its step-cost model and the scheduler's TTFT and ITL targets.

The model (services/common/step_cost.py) prices a step from its tokens, its prompt chunks' KV reads
and its decodes' KV reads. Every step gives each running decode its token before prompt chunks
share what is left (services/runtime/batch_scheduler.py), and the worker sizes those chunks each step
with its own cost model so the step is predicted to end within the ITL target (the step target, less
the headroom the worker keeps for the token's delivery), from its decodes' actual contexts. The
policy sets the rest, for a decode reading `context` entries and a typical prompt's chunks:

    prompt share  P = ceil(typical prompt * itl / ttft)   prompt tokens every step computes at least,
                      so a typical prompt prefills within the TTFT target in steps of the ITL target
    chunk size    C = the largest chunk a step holds alone within the ITL target, whole blocks
    max sequences S = the scheduler's cap: the worker admits a sequence only while the decodes' steps,
                      priced from their actual contexts, leave P prompt tokens room
    token budget    C + S
    window          = min(fixed, TTFT slack of a typical prompt)

A worker registering gets the step target and P before it has fitted a cost model, and prefills P
tokens a step until it has (a fresh worker's first long prompt took a whole step of 2,048 tokens).

A target the worker cannot meet even with one decode and one block of prompt per step (its fixed
cost alone is about the target, as on an oversubscribed CPU) is lost whatever the chunks, so it sets
no step target and lets the steps' tokens cost about their fixed cost: steps of one block paid the
fixed cost for a few tokens each (a fixed cost fitted at 3.3 s under load gave 16-token steps, 2.3
tokens/s in the long-prompt mix). Waiting to form a prefill batch saves at most one step's fixed
cost, so the window never exceeds it, and it never spends more than the slack the typical prompt's
prefill leaves under the TTFT target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.step_cost import StepCost
from services.common.store import WorkerRole


@dataclass(frozen=True, slots=True)
class ServiceTargets:
    ttft_ms: float
    itl_ms: float
    context_tokens: int
    typical_prompt_tokens: int
    max_seqs_cap: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms", "context_tokens", "typical_prompt_tokens", "max_seqs_cap", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class BatchPolicyNumbers:
    max_num_batched_tokens: int
    max_num_seqs: int
    chunk_size: int
    batch_window_ms: int
    step_target_ms: int = 0  # 0: the token budget alone bounds a step
    min_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SloPolicy:
    """The scheduler's --slo-ttft-ms and --slo-itl-ms: every worker that reports a cost model gets
    the policy that meets them. `context_tokens`: KV entries a decode token is taken to read (also
    the typical prompt); `max_seqs_cap`: the scheduler's --max-running."""

    ttft_ms: float
    itl_ms: float
    context_tokens: int
    max_seqs_cap: int

    def for_worker(self, cost: StepCost, block_size: int, role: WorkerRole) -> BatchPolicyNumbers | None:
        """None for a prefill worker: its steps hold no decodes, so no ITL target bounds them, and its own
        flags size them for throughput (an ITL-sized budget cut its prompts into several times more steps).
        None too for a fit with no per-token cost (noise on a loaded machine): it sizes nothing, and the
        worker keeps the policy it has."""
        if role is WorkerRole.PREFILL or cost.per_token_ms <= 0:
            return None
        return policy_for(cost, self._targets(block_size))

    def before_fit(self, role: WorkerRole) -> BatchPolicyNumbers | None:
        """What a registering colocated or decode worker gets before it has a cost model: the step target
        and the prompt share, its own flags otherwise."""
        if role is WorkerRole.PREFILL:
            return None
        return BatchPolicyNumbers(max_num_batched_tokens=0, max_num_seqs=0, chunk_size=0, batch_window_ms=0,
                                  step_target_ms=math.floor(self.itl_ms),
                                  min_prefill_tokens=prompt_share(self._targets(block_size=1)))

    def _targets(self, block_size: int) -> ServiceTargets:
        return ServiceTargets(ttft_ms=self.ttft_ms, itl_ms=self.itl_ms, context_tokens=self.context_tokens,
                              typical_prompt_tokens=self.context_tokens, max_seqs_cap=self.max_seqs_cap,
                              block_size=block_size)


def policy_for(cost: StepCost, targets: ServiceTargets) -> BatchPolicyNumbers:
    if cost.per_token_ms <= 0:
        raise ValueError(f"a step cost with no per-token term cannot size a budget: {cost}")
    block, context = targets.block_size, targets.context_tokens
    room_ms = targets.itl_ms - cost.fixed_ms
    if room_ms < cost.decode_ms(context) + cost.chunk_ms(0, block):
        return _unreachable_policy(cost, targets)
    chunk = max(block, cost.largest_chunk(0, room_ms) // block * block)
    seqs = targets.max_seqs_cap
    return BatchPolicyNumbers(max_num_batched_tokens=chunk + seqs, max_num_seqs=seqs, chunk_size=chunk,
                              batch_window_ms=_window_ms(cost, targets, chunk), step_target_ms=math.floor(targets.itl_ms),
                              min_prefill_tokens=prompt_share(targets))


def _unreachable_policy(cost: StepCost, targets: ServiceTargets) -> BatchPolicyNumbers:
    """Steps whose tokens cost about their fixed cost, half of them for prompts: the target is lost anyway."""
    budget = max(targets.block_size, math.ceil(cost.fixed_ms / cost.decode_ms(targets.context_tokens)))
    chunk = budget // targets.block_size * targets.block_size
    return BatchPolicyNumbers(max_num_batched_tokens=budget, max_num_seqs=min(budget - budget // 2, targets.max_seqs_cap),
                              chunk_size=chunk, batch_window_ms=_window_ms(cost, targets, chunk))


def _window_ms(cost: StepCost, targets: ServiceTargets, chunk: int) -> int:
    slack = targets.ttft_ms - prefill_ms(cost, targets.typical_prompt_tokens, chunk)
    return math.floor(max(0.0, min(cost.fixed_ms, slack)))


def prompt_share(targets: ServiceTargets) -> int:
    """Tokens of every step prompts need for a typical one to prefill within the TTFT target when
    each step takes the ITL target."""
    return math.ceil(targets.typical_prompt_tokens * targets.itl_ms / targets.ttft_ms)


def prefill_ms(cost: StepCost, prompt_tokens: int, chunk_size: int) -> float:
    """Time to prefill a prompt alone in chunks of `chunk_size`: token i reads i + 1 KV entries."""
    return math.ceil(prompt_tokens / chunk_size) * cost.fixed_ms + cost.chunk_ms(0, prompt_tokens)
