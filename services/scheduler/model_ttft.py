"""The time to first token this scheduler observes per model (from a request's arrival to its first
token), over a recent window: the last WINDOW first requests of each model. Its p90 is what cost
placement's --replicate-ttft-ms compares (model_placement.rebalance). A window that holds fewer
than MIN_SAMPLES says nothing, so one cold start alone never makes a model hot.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 32
MIN_SAMPLES = 8


class ModelTtft:
    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples} and {window}")
        self._window = window
        self._min_samples = min_samples
        self._seen: dict[str, deque[float]] = {}

    def observe(self, model: str, ttft_ms: float) -> None:
        """A request for `model` got its first token `ttft_ms` after it arrived."""
        self._seen.setdefault(model, deque(maxlen=self._window)).append(ttft_ms)

    def p90(self) -> dict[str, float]:
        """Model -> the 90th percentile (nearest rank) of its window, for the models with MIN_SAMPLES."""
        return {model: _nearest_rank(sorted(seen), 0.9) for model, seen in self._seen.items()
                if len(seen) >= self._min_samples}

    def forget(self, model: str) -> None:
        """Start the model's window afresh (a copy was added: what came before no longer says how it serves)."""
        self._seen.pop(model, None)


def _nearest_rank(ordered: list[float], quantile: float) -> float:
    return ordered[max(math.ceil(quantile * len(ordered)) - 1, 0)]
