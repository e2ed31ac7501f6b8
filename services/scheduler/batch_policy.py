"""A worker's batching policy from its step-cost model and the scheduler's TTFT and ITL targets.

The model (services/common/step_cost.py) says what a step of `n` tokens, each reading about
`context` KV entries, costs. Every step gives each running decode its token before a prompt chunk
takes what is left of the token budget (services/runtime/batch_scheduler.py), so a budget whose
full step fits the ITL target keeps every colocated decode step under it, however long the prompt
being prefilled. A step full of decodes would leave prompts nothing, so the sequence cap keeps a
share of every step for them, enough to prefill a typical prompt within the TTFT target in steps
of the ITL target:

    token budget  B = floor((itl - fixed) / (per_token + per_context * context))
                      (below one block: ceil(fixed / (per_token + per_context * context)))
    prompt share  P = ceil(typical prompt * itl / ttft), at most B / 2
    max sequences   = min(B - P, cap)
    chunk size      = B rounded down to whole blocks (a chunk ends on a block edge)
    window          = min(fixed, TTFT slack of a typical prompt)

A target the worker cannot meet even with one block of tokens per step (its fixed cost alone is
about the target, as on an oversubscribed CPU) is lost whatever the budget, so the steps' tokens get
to cost as much as their fixed cost: steps of one block paid the fixed cost for a few tokens each (a
fixed cost fitted at 3.3 s under load gave 16-token steps, 2.3 tokens/s in the long-prompt mix). A budget too
small for both targets keeps half of it for prompts: the decodes still meet the ITL target, and
prompts still progress. Waiting to form a prefill batch saves at most one step's fixed cost, so the
window never exceeds it, and it never spends more than the slack the typical prompt's prefill leaves
under the TTFT target.
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
        if role is WorkerRole.PREFILL or cost.per_token_ms + cost.per_context_token_ms <= 0:
            return None
        return policy_for(cost, ServiceTargets(ttft_ms=self.ttft_ms, itl_ms=self.itl_ms,
                                               context_tokens=self.context_tokens,
                                               typical_prompt_tokens=self.context_tokens,
                                               max_seqs_cap=self.max_seqs_cap, block_size=block_size))


def policy_for(cost: StepCost, targets: ServiceTargets) -> BatchPolicyNumbers:
    budget = token_budget(cost, targets.itl_ms, targets.context_tokens)
    if budget < targets.block_size:
        budget = max(targets.block_size, math.ceil(cost.fixed_ms / _token_ms(cost, targets.context_tokens)))
    chunk = budget // targets.block_size * targets.block_size
    slack = targets.ttft_ms - prefill_ms(cost, targets.typical_prompt_tokens, chunk)
    window = max(0.0, min(cost.fixed_ms, slack))
    share = min(prompt_share(targets), budget // 2)
    return BatchPolicyNumbers(max_num_batched_tokens=budget, max_num_seqs=min(budget - share, targets.max_seqs_cap),
                              chunk_size=chunk, batch_window_ms=math.floor(window))


def prompt_share(targets: ServiceTargets) -> int:
    """Tokens of every step prompts need for a typical one to prefill within the TTFT target when
    each step takes the ITL target."""
    return math.ceil(targets.typical_prompt_tokens * targets.itl_ms / targets.ttft_ms)


def token_budget(cost: StepCost, itl_ms: float, context_tokens: int) -> int:
    """The most tokens one step may compute and still end within `itl_ms` (0 when even one cannot)."""
    return max(0, math.floor((itl_ms - cost.fixed_ms) / _token_ms(cost, context_tokens)))


def _token_ms(cost: StepCost, context_tokens: int) -> float:
    """What one more token costs a step when it reads `context_tokens` KV entries."""
    per_token = cost.per_token_ms + cost.per_context_token_ms * context_tokens
    if per_token <= 0:
        raise ValueError(f"a step cost with no per-token term cannot size a budget: {cost}")
    return per_token


def prefill_ms(cost: StepCost, prompt_tokens: int, chunk_size: int) -> float:
    """Time to prefill a prompt alone in chunks of `chunk_size`: token i reads i + 1 KV entries."""
    steps = math.ceil(prompt_tokens / chunk_size)
    context = prompt_tokens * (prompt_tokens + 1) / 2
    return steps * cost.fixed_ms + cost.per_token_ms * prompt_tokens + cost.per_context_token_ms * context
