"""Conditional disaggregation: prefill a request on a prefill worker, or on its decode worker.

As Dynamo's disaggregated router does, a prompt whose uncached part is short prefills where it
will decode (no KV hand-off), and a long one goes to a prefill worker so its prefill does not
share steps with the decode worker's running sequences. With one step-cost model
(services/common/step_cost.py) both choices get an estimated time to first token:

    local  = prefill_ms(queued prefill tokens on the decode worker) + prefill_ms(prompt - local prefix hit)
    remote = prefill_ms(queued prefill tokens on the prefill worker) + prefill_ms(prompt - remote prefix hit)
             + transfer_ms_per_token * prompt

The request prefills locally when its uncached part fits `max_local_prefill_tokens` (one policy
chunk: a single step, which the token budget keeps under the ITL target) and local is not
slower than remote; with no prefill worker it always prefills locally.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.step_cost import StepCost
from services.scheduler.batch_policy import prefill_ms


class PrefillSite(enum.Enum):
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class PrefillInputs:
    prompt_tokens: int
    local_hit_tokens: int
    remote_hit_tokens: int
    local_queued_tokens: int
    remote_queued_tokens: int
    remote_available: bool


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    site: PrefillSite
    local_ttft_ms: float
    remote_ttft_ms: float

    def span_attributes(self, inputs: PrefillInputs) -> dict[str, str | int | float | bool]:
        """The decision and what it was made from, for the routing span."""
        return {"tandem.prefill.site": self.site.value, "tandem.prefill.local_ttft_ms": round(self.local_ttft_ms, 3),
                "tandem.prefill.remote_ttft_ms": round(self.remote_ttft_ms, 3),
                "tandem.prefill.prompt_tokens": inputs.prompt_tokens,
                "tandem.prefill.local_hit_tokens": inputs.local_hit_tokens,
                "tandem.prefill.remote_hit_tokens": inputs.remote_hit_tokens,
                "tandem.prefill.local_queued_tokens": inputs.local_queued_tokens,
                "tandem.prefill.remote_queued_tokens": inputs.remote_queued_tokens,
                "tandem.prefill.remote_available": inputs.remote_available}


@dataclass(frozen=True, slots=True)
class PlacementModel:
    cost: StepCost
    chunk_size: int
    max_local_prefill_tokens: int
    transfer_ms_per_token: float

    def decide(self, inputs: PrefillInputs) -> PrefillDecision:
        local = self._ttft(inputs.local_queued_tokens, inputs.prompt_tokens - inputs.local_hit_tokens)
        remote = (self._ttft(inputs.remote_queued_tokens, inputs.prompt_tokens - inputs.remote_hit_tokens)
                  + self.transfer_ms_per_token * inputs.prompt_tokens)
        short = inputs.prompt_tokens - inputs.local_hit_tokens <= self.max_local_prefill_tokens
        site = PrefillSite.LOCAL if not inputs.remote_available or (short and local <= remote) else PrefillSite.REMOTE
        return PrefillDecision(site=site, local_ttft_ms=local, remote_ttft_ms=remote)

    def _ttft(self, queued_tokens: int, uncached_tokens: int) -> float:
        return self._prefill(queued_tokens) + self._prefill(max(1, uncached_tokens))

    def _prefill(self, tokens: int) -> float:
        return prefill_ms(self.cost, tokens, self.chunk_size) if tokens > 0 else 0.0
