"""A worker's step-time cost model, fitted by least squares over its recent engine steps.

One engine step that computes `new_tokens` tokens (decode tokens plus prefill chunk tokens)
whose attention reads `context_tokens` KV entries in all takes about

    step_ms = fixed_ms + per_token_ms * new_tokens + per_context_token_ms * context_tokens

`fixed_ms` is what every step pays whatever its size (Python, launch, sampling overhead),
`per_token_ms` the weight GEMMs per row, `per_context_token_ms` the attention reads. The
scheduler turns this model and its SLOs into the worker's batching policy
(services/scheduler/batch_policy.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed_ms: float
    per_token_ms: float
    per_context_token_ms: float

    def step_ms(self, new_tokens: int, context_tokens: int) -> float:
        """Predicted time of one step."""
        return self.fixed_ms + self.per_token_ms * new_tokens + self.per_context_token_ms * context_tokens


@dataclass(frozen=True, slots=True)
class StepSample:
    new_tokens: int
    context_tokens: int
    ms: float


class StepCostFit:
    """The cost model over the last `window` steps; `fit()` is None until the steps vary enough
    (at least `min_samples` of them, and both token counts not constant) to tell the terms apart.
    The first `warmup` steps are not recorded: they pay one-time costs (first touch of the KV pool,
    kernel selection) that took a fresh CPU worker's fitted fixed cost to 900 ms."""

    def __init__(self, window: int = 256, min_samples: int = 16, warmup: int = 8) -> None:
        if min_samples < 3 or window < min_samples or warmup < 0:
            raise ValueError(f"need window >= min_samples >= 3 steps and warmup >= 0, got window={window}, "
                             f"min_samples={min_samples}, warmup={warmup}")
        self._samples: deque[StepSample] = deque(maxlen=window)
        self._min_samples = min_samples
        self._skip = warmup

    def record(self, new_tokens: int, context_tokens: int, ms: float) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        self._samples.append(StepSample(new_tokens, context_tokens, ms))

    def fit(self) -> StepCost | None:
        if len(self._samples) < self._min_samples:
            return None
        design = np.array([[1.0, s.new_tokens, s.context_tokens] for s in self._samples])
        if np.linalg.matrix_rank(design) < 3:
            return None
        times = np.array([s.ms for s in self._samples])
        coefficients = _nonnegative_least_squares(design, times)
        return StepCost(*(float(c) for c in coefficients))


def _nonnegative_least_squares(design: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Least squares, then again without any term that came out negative (noise on a loaded machine
    can make a small term negative, and no cost is)."""
    keep = np.ones(design.shape[1], dtype=bool)
    coefficients = np.zeros(design.shape[1])
    for _ in range(design.shape[1]):
        solved, *_ = np.linalg.lstsq(design[:, keep], times, rcond=None)
        coefficients[:] = 0.0
        coefficients[keep] = solved
        if (coefficients >= 0).all():
            break
        keep &= coefficients > 0
    return np.clip(coefficients, 0.0, None)
