"""How one request picks its tokens: `SamplingParams` and the ranges it must respect.

Torch-free, so the gateway validates a request before any work; the sampler in
`services/runtime/sampler.py` applies these parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.structured_output import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; larger biases are clamped to it


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens; the ranges follow vLLM's (see `validate`)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives to return; 0: only the chosen token's
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (teacher forcing)
    repetition_penalty: float = 1.0  # on prompt and output tokens
    presence_penalty: float = 0.0  # on output tokens
    frequency_penalty: float = 0.0  # on output tokens
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    structured: StructuredOutput | None = None  # a grammar the output must follow
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to the logits

    @property
    def clamped_logit_bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias with each bias clamped to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI does."""
        return tuple((t, min(max(b, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)) for t, b in self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first field out of its range, or the grammar that does not compile."""
        for name, ok, rule in self._rules():
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        if self.structured is not None:
            try:
                self.structured.validate()
            except ValueError as exc:
                raise ValueError(f"structured {exc}") from None

    def _rules(self) -> list[tuple[str, bool, str]]:
        # Chained comparisons are False for NaN, so NaN fails every range below.
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", 0 <= self.temperature < math.inf, "must be a finite number >= 0 (0 means greedy)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1] (1 turns it off)"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "must be -1 or 0 (off) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1] (0 turns it off)"),
            ("seed", self.seed is None or _is_int(self.seed), "must be an integer or unset"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "must be token ids >= 0"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"must be in [0, {MAX_LOGPROBS}] or unset"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"must be in [0, {MAX_LOGPROBS}] or unset"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "must be a finite number > 0 (1 is off)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "must be an integer in [0, max_tokens]"),
            ("logit_bias", all(_is_int(t) and t >= 0 and -math.inf < b < math.inf for t, b in self.logit_bias),
             "must map token ids >= 0 to finite numbers"),
        ]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
