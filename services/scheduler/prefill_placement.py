"""Conditional disaggregation: prefill a request on its decode worker (local) or on a prefill worker (remote).

Model: a local prefill shares the decode worker's steps with the sequences it is decoding, so it
costs them inter-token latency, while a remote one costs a KV transfer and a prefill worker's
queue. By the decode worker's step-cost model (services/common/step_cost.py), its next step with
the prompt's uncached tokens and the prompt tokens already queued there (P in all) takes

    fixed + R * decode_ms(context) + chunk_ms(0, P)     R: its running sequences

its decodes each reading `context` KV entries at the decode rate, the prompt's P * (P + 1) / 2 at
the prompt chunks' rate. When that stays within the ITL target
(--slo-itl-ms) the request prefills locally and its KV never moves; otherwise a prefill worker
takes it. Until the decode worker reports a cost model, or without an ITL target, the prompt-length
rule stands in: locally when P is at most `local_tokens`. With no prefill worker, always locally.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.step_cost import StepCost
from services.common.tracing import Attr


class PrefillSite(enum.StrEnum):
    LOCAL = "local"
    REMOTE = "remote"


class Reason(enum.StrEnum):
    """Why the site was chosen (the `reason` label of tandem:prefill_placement_total)."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    WITHIN_ITL = "within_itl"  # the cost model's next step with the prefill meets the ITL target
    OVER_ITL = "over_itl"
    SHORT_PROMPT = "short_prompt"  # no cost model or no ITL target: the prompt-length rule
    LONG_PROMPT = "long_prompt"


@dataclass(frozen=True, slots=True)
class PrefillInputs:
    """What the decision reads about one request and its decode worker."""

    uncached_tokens: int  # prompt tokens the decode worker would compute (its prefix-cache hit taken off)
    queued_tokens: int  # prompt tokens already queued to prefill on the decode worker
    running: int  # sequences generating on the decode worker
    remote_available: bool  # a live prefill worker serves the model

    @property
    def prefill_tokens(self) -> int:
        return self.queued_tokens + self.uncached_tokens


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    site: PrefillSite
    reason: Reason
    inputs: PrefillInputs
    step_ms: float | None = None  # the predicted next step with the prefill (None: no cost model was used)

    def span_attributes(self) -> dict[str, str | int | float]:
        """The decision and what it was made from, for the request's span."""
        attributes: dict[str, str | int | float] = {
            Attr.PREFILL_PLACEMENT: self.site.value, Attr.PREFILL_PLACEMENT_REASON: self.reason.value,
            Attr.PREFILL_UNCACHED_TOKENS: self.inputs.uncached_tokens,
            Attr.PREFILL_QUEUED_TOKENS: self.inputs.queued_tokens, Attr.PREFILL_DECODE_RUNNING: self.inputs.running}
        if self.step_ms is not None:
            attributes[Attr.PREFILL_PREDICTED_STEP_MS] = round(self.step_ms, 3)
        return attributes


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """`itl_ms`: the scheduler's --slo-itl-ms (0: none, the prompt-length rule decides);
    `context_tokens`: KV entries a running decode reads (--slo-context-tokens); `local_tokens`:
    the prompt-length rule's limit (--local-prefill-tokens)."""

    itl_ms: float = 0.0
    context_tokens: int = 1024
    local_tokens: int = 256

    def __post_init__(self) -> None:
        if self.itl_ms < 0 or self.context_tokens < 1 or self.local_tokens < 0:
            raise ValueError(f"need itl_ms >= 0, context_tokens >= 1 and local_tokens >= 0, got {self}")

    def decide(self, inputs: PrefillInputs, cost: StepCost | None) -> PrefillDecision:
        if not inputs.remote_available:
            return PrefillDecision(PrefillSite.LOCAL, Reason.NO_PREFILL_WORKER, inputs)
        if cost is None or self.itl_ms <= 0:
            short = inputs.prefill_tokens <= self.local_tokens
            return PrefillDecision(PrefillSite.LOCAL if short else PrefillSite.REMOTE,
                                   Reason.SHORT_PROMPT if short else Reason.LONG_PROMPT, inputs)
        step = self.next_step_ms(cost, inputs)
        within = step <= self.itl_ms
        return PrefillDecision(PrefillSite.LOCAL if within else PrefillSite.REMOTE,
                               Reason.WITHIN_ITL if within else Reason.OVER_ITL, inputs, step)

    def next_step_ms(self, cost: StepCost, inputs: PrefillInputs) -> float:
        """The decode worker's next step with its running decodes and the whole local prefill in it."""
        return (cost.fixed_ms + inputs.running * cost.decode_ms(self.context_tokens)
                + cost.chunk_ms(0, inputs.prefill_tokens))


class PrefillPlacement:
    """The policy, and the step-cost model each worker reported on its last heartbeat (none before
    it has one): the scheduler's servicer observes them, routing decides with them."""

    def __init__(self, policy: PlacementPolicy = PlacementPolicy()) -> None:
        self.policy = policy
        self._costs: dict[str, StepCost] = {}

    def observe(self, worker_id: str, cost: StepCost | None) -> None:
        if cost is None:
            self._costs.pop(worker_id, None)
        else:
            self._costs[worker_id] = cost

    def decide(self, worker_id: str, inputs: PrefillInputs) -> PrefillDecision:
        return self.policy.decide(inputs, self._costs.get(worker_id))
