"""Conditional disaggregation: prefill a request on its decode worker (local) or on a prefill worker (remote).

Model: a local prefill shares the decode worker's steps with the sequences it is decoding, so it
costs them inter-token latency, while a remote one costs a KV transfer and a wait in the prefill
worker's queue. By the decode worker's step-cost model (services/common/step_cost.py), its next step
with the prompt's uncached tokens and the prompt tokens already queued there (P in all) takes

    fixed + R * per_token + per_decode_context * C + chunk_ms(0, P)     R: its running sequences

its decodes reading C KV entries at the decode rate (the prompts of the requests this scheduler has
generating there, or `context` each), the prompt's P * (P + 1) / 2 at the prompt chunks' rate. When
that stays within the step a hybrid decode worker aims at (`aimed = aimed_step_ms(itl,
HYBRID_STEP_HEADROOM)`: the ITL target, --slo-itl-ms, less the headroom such a worker keeps for the
token's delivery and the steps' errors; services/common/step_cost.py)
the request prefills locally in one step and its KV never moves. Otherwise, with a TTFT target
(--slo-ttft-ms), the two first-token times decide. Under the SLO policy the decode worker cuts prompts
into chunks that keep each step within that aimed step, so a local prefill's work W (the queued
prompts' and this one's tokens and chunk KV reads at its rates) goes in the room its decodes leave a step,

    local TTFT  = ceil(W / (aimed - fixed - R * per_token - per_decode_context * C)) * aimed

and a remote one waits for the prompts queued on the prefill worker, then computes, at that
worker's rates (the decode worker's until it has reported its own: the same model)

    remote TTFT = fixed + W_remote

The request prefills locally, in chunks, when that meets the TTFT target sooner than the prefill
worker would; else remotely: a prompt that misses the target either way goes where it leaves the
decode steps short. (The prefill worker's queue behind long prompts was where hybrid lost its
goodput: short prompts sent there waited seconds while the decode worker had room.) Until the
decode worker reports a cost model, or without an ITL target, the prompt-length rule stands in:
locally when P is at most `local_tokens`, or, with a TTFT target, when the prompt alone is and fewer
prompt tokens are queued on the decode worker than on the prefill worker (a short prompt joins the
shorter queue). With no prefill worker, always locally.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from services.common.step_cost import HYBRID_STEP_HEADROOM, StepCost, aimed_step_ms, chunk_reads
from services.common.tracing import Attr


class PrefillSite(enum.StrEnum):
    LOCAL = "local"
    REMOTE = "remote"


class Reason(enum.StrEnum):
    """Why the site was chosen (the `reason` label of tandem:prefill_placement_total)."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    WITHIN_ITL = "within_itl"  # the cost model's next step with the whole prefill fits the step aimed at under the ITL target
    OVER_ITL = "over_itl"  # it does not, and no TTFT target weighs the two sites
    LOCAL_SOONER = "local_sooner"  # chunked locally it meets the TTFT target, sooner than the prefill worker
    REMOTE_SOONER = "remote_sooner"  # the prefill worker's first token comes no later than a local one
    OVER_TTFT = "over_ttft"  # neither site meets the TTFT target: remote, the decode steps kept short
    SHORT_PROMPT = "short_prompt"  # no cost model or no ITL target: the prompt-length rule
    LONG_PROMPT = "long_prompt"


@dataclass(frozen=True, slots=True)
class PrefillInputs:
    """What the decision reads about one request, its decode worker and its best prefill worker.
    `*_reads`: the KV entries the queued prompts' chunks read (a chunk's token at position p reads p + 1)."""

    uncached_tokens: int  # prompt tokens the decode worker would compute (its prefix-cache hit taken off)
    queued_tokens: int  # prompt tokens already queued to prefill on the decode worker
    running: int  # sequences generating on the decode worker
    remote_available: bool  # a live prefill worker serves the model
    running_context: int | None = None  # the KV entries their decodes read (None: `context_tokens` each)
    queued_reads: int = 0
    remote_tokens: int = 0  # prompt tokens the prefill worker would compute (its prefix-cache hit taken off)
    remote_queued_tokens: int = 0  # prompt tokens queued on the prefill worker
    remote_queued_reads: int = 0

    @property
    def prefill_tokens(self) -> int:
        return self.queued_tokens + self.uncached_tokens


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    site: PrefillSite
    reason: Reason
    inputs: PrefillInputs
    step_ms: float | None = None  # the predicted next step with the prefill (None: no cost model was used)
    local_ttft_ms: float | None = None  # the predicted first-token times (None: not weighed)
    remote_ttft_ms: float | None = None

    def span_attributes(self) -> dict[str, str | int | float]:
        """The decision and what it was made from, for the request's span."""
        attributes: dict[str, str | int | float] = {
            Attr.PREFILL_PLACEMENT: self.site.value, Attr.PREFILL_PLACEMENT_REASON: self.reason.value,
            Attr.PREFILL_UNCACHED_TOKENS: self.inputs.uncached_tokens,
            Attr.PREFILL_QUEUED_TOKENS: self.inputs.queued_tokens, Attr.PREFILL_DECODE_RUNNING: self.inputs.running}
        if self.step_ms is not None:
            attributes[Attr.PREFILL_PREDICTED_STEP_MS] = round(self.step_ms, 3)
        if self.local_ttft_ms is not None and self.remote_ttft_ms is not None:
            attributes[Attr.PREFILL_REMOTE_QUEUED_TOKENS] = self.inputs.remote_queued_tokens
            attributes[Attr.PREFILL_LOCAL_TTFT_MS] = _rounded(self.local_ttft_ms)
            attributes[Attr.PREFILL_REMOTE_TTFT_MS] = _rounded(self.remote_ttft_ms)
        return attributes


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """`itl_ms`: the scheduler's --slo-itl-ms (0: none, the prompt-length rule decides); `ttft_ms`:
    its --slo-ttft-ms (0: none, a prefill over the ITL target in one step goes remote);
    `context_tokens`: KV entries a running decode reads (--slo-context-tokens); `local_tokens`:
    the prompt-length rule's limit (--local-prefill-tokens)."""

    itl_ms: float = 0.0
    context_tokens: int = 1024
    local_tokens: int = 256
    ttft_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.itl_ms < 0 or self.ttft_ms < 0 or self.context_tokens < 1 or self.local_tokens < 0:
            raise ValueError(f"need itl_ms >= 0, ttft_ms >= 0, context_tokens >= 1 and local_tokens >= 0, got {self}")

    def decide(self, inputs: PrefillInputs, cost: StepCost | None,
               remote_cost: StepCost | None = None) -> PrefillDecision:
        """`cost`: the decode worker's model; `remote_cost`: the prefill worker's (None: priced as `cost`)."""
        if not inputs.remote_available:
            return PrefillDecision(PrefillSite.LOCAL, Reason.NO_PREFILL_WORKER, inputs)
        if cost is None or self.itl_ms <= 0:
            short = inputs.prefill_tokens <= self.local_tokens or (
                self.ttft_ms > 0 and inputs.uncached_tokens <= self.local_tokens
                and inputs.queued_tokens <= inputs.remote_queued_tokens)
            return PrefillDecision(PrefillSite.LOCAL if short else PrefillSite.REMOTE,
                                   Reason.SHORT_PROMPT if short else Reason.LONG_PROMPT, inputs)
        step = self.next_step_ms(cost, inputs)
        if step <= self.aimed_step_ms:
            return PrefillDecision(PrefillSite.LOCAL, Reason.WITHIN_ITL, inputs, step)
        if self.ttft_ms <= 0:
            return PrefillDecision(PrefillSite.REMOTE, Reason.OVER_ITL, inputs, step)
        local, remote = self.local_ttft_ms(cost, inputs), self.remote_ttft_ms(remote_cost or cost, inputs)
        if local <= self.ttft_ms and local < remote:
            site, reason = PrefillSite.LOCAL, Reason.LOCAL_SOONER
        else:
            site, reason = PrefillSite.REMOTE, Reason.REMOTE_SOONER if remote <= local else Reason.OVER_TTFT
        return PrefillDecision(site, reason, inputs, step, local, remote)

    @property
    def aimed_step_ms(self) -> float:
        """The step a hybrid decode worker sizes its local prompt chunks to under the ITL target."""
        return aimed_step_ms(self.itl_ms, HYBRID_STEP_HEADROOM)

    def next_step_ms(self, cost: StepCost, inputs: PrefillInputs) -> float:
        """The decode worker's next step with its running decodes and the whole local prefill in it."""
        return cost.fixed_ms + self.decodes_ms(cost, inputs) + cost.chunk_ms(0, inputs.prefill_tokens)

    def decodes_ms(self, cost: StepCost, inputs: PrefillInputs) -> float:
        """What the decode worker's running decodes add to each step."""
        context = inputs.running * self.context_tokens if inputs.running_context is None else inputs.running_context
        return inputs.running * cost.per_token_ms + context * cost.per_decode_context_ms

    def local_ttft_ms(self, cost: StepCost, inputs: PrefillInputs) -> float:
        """The first token of a local prefill chunked into the room the decodes leave each step within
        the step the worker aims at (inf: they leave none), each such step taking that aimed time."""
        aimed = self.aimed_step_ms
        room = aimed - cost.fixed_ms - self.decodes_ms(cost, inputs)
        work = _prefill_ms(cost, inputs.queued_tokens, inputs.queued_reads, inputs.uncached_tokens)
        if room <= 0:
            return math.inf
        return math.ceil(work / room) * aimed

    @staticmethod
    def remote_ttft_ms(cost: StepCost, inputs: PrefillInputs) -> float:
        """The first token of a remote prefill once the prompts queued on the prefill worker are done."""
        return cost.fixed_ms + _prefill_ms(cost, inputs.remote_queued_tokens, inputs.remote_queued_reads,
                                           inputs.remote_tokens)


def _prefill_ms(cost: StepCost, queued_tokens: int, queued_reads: int, tokens: int) -> float:
    """The prompt work of the queued prompts and then `tokens` more (their chunks' token and KV-read terms)."""
    return (cost.per_token_ms * (queued_tokens + tokens)
            + cost.per_context_token_ms * (queued_reads + chunk_reads(0, tokens)))


def _rounded(ms: float) -> float:
    return round(ms, 1) if math.isfinite(ms) else -1.0


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

    def decide(self, worker_id: str, inputs: PrefillInputs, prefill_worker_id: str = "") -> PrefillDecision:
        """`worker_id`: the decode worker; `prefill_worker_id`: the best ranked prefill worker, if any."""
        return self.policy.decide(inputs, self._costs.get(worker_id), self._costs.get(prefill_worker_id))
