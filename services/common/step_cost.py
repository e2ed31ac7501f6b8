"""A worker's step-time cost model, fitted by least squares over its recent engine steps, outliers left out.

One engine step that computes `new_tokens` tokens (decode tokens plus prompt-chunk tokens), whose
prompt chunks' attention reads `context_tokens` KV entries and whose decodes read
`decode_context_tokens`, takes about

    step_ms = fixed_ms + per_token_ms * new_tokens
              + per_context_token_ms * context_tokens + per_decode_context_ms * decode_context_tokens

`fixed_ms` is what every step pays whatever its size (Python, launch, sampling overhead),
`per_token_ms` the weight GEMMs per row. The two KV-read rates differ tenfold on a CPU: a prompt
chunk's attention runs as matrix products (about 0.0005 ms an entry), a decode gathers its paged KV
one sequence at a time (about 0.005 ms), so one rate for both mispriced every step. A decode at
position p reads p + 1 entries; so does a prompt token at position p. The scheduler turns this model
and its SLOs into the worker's batching policy (services/scheduler/batch_policy.py), and the worker's
batch scheduler sizes each step's prompt chunks with it (services/runtime/batch_scheduler.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np


# The share of the ITL target a step leaves unused. A client sees a token after its step and its
# delivery (gateway, HTTP: a client's gap less its one step, p99 10-30 ms in four traced c16-long runs),
# and one step past the target delays every decode in it, a dozen of the run's inter-token gaps: steps
# sized to the whole target (200 ms) ran 190-225 ms on a quiet 2-core AMD EPYC, and the ITL p99 then
# landed either side of 250 ms run to run.
STEP_HEADROOM = 0.2
# A hybrid decode worker's (tandem decode --hybrid) headroom. A client's request meets the ITL target only
# if its longest gap does (64 tokens: the p99 of its gaps is the longest), and one long step stretches
# the gap of every request decoding in it. Such a worker has a prefill worker beside it for the prompts
# its steps have no room for, so it sizes its local prompt chunks with more room for error: in a quiet
# c16-long pair its steps sized to 80% of the target gave gaps to 237 ms (on one core, the steps ran up
# to 1.5x their prediction), and under load (load average 5.5) 213-350 ms, in most of its requests.
HYBRID_STEP_HEADROOM = 0.4


def aimed_step_ms(itl_ms: float, headroom: float = STEP_HEADROOM) -> float:
    """The time a step is sized to under the ITL target `itl_ms`: the target less the headroom
    (`HYBRID_STEP_HEADROOM` on a hybrid decode worker). The one definition both sides use: the worker
    sizes its steps to it (services/runtime/batch_scheduler.py, services/worker/runtime.py), and the
    scheduler prices a hybrid decode worker's local prefill with it (services/scheduler/prefill_placement.py)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"a step headroom is a share of the ITL target in [0, 1), got {headroom}")
    return itl_ms * (1 - headroom)


@dataclass(frozen=True, slots=True)
class StepCost:
    fixed_ms: float
    per_token_ms: float
    per_context_token_ms: float  # a prompt chunk's KV entry read
    per_decode_context_ms: float = 0.0  # a decode's KV entry read

    def step_ms(self, new_tokens: int, context_tokens: int, decode_context_tokens: int = 0) -> float:
        """Predicted time of one step."""
        return (self.fixed_ms + self.per_token_ms * new_tokens + self.per_context_token_ms * context_tokens
                + self.per_decode_context_ms * decode_context_tokens)

    def decode_ms(self, context_tokens: int) -> float:
        """What one decode reading `context_tokens` KV entries adds to a step."""
        return self.per_token_ms + self.per_decode_context_ms * context_tokens

    def chunk_ms(self, start: int, tokens: int) -> float:
        """What a prompt chunk of `tokens` tokens from position `start` adds to a step (token p reads p + 1)."""
        return self.per_token_ms * tokens + self.per_context_token_ms * chunk_reads(start, tokens)

    def largest_chunk(self, start: int, ms: float) -> int:
        """The most prompt tokens from position `start` whose chunk adds at most `ms` to a step."""
        if ms <= 0:
            return 0
        if self.per_token_ms <= 0 and self.per_context_token_ms <= 0:
            raise ValueError(f"a step cost with no per-token term cannot size a chunk: {self}")
        a = self.per_context_token_ms / 2
        b = self.per_token_ms + self.per_context_token_ms * (start + 0.5)
        tokens = math.floor(ms / b if a == 0 else (math.sqrt(b * b + 4 * a * ms) - b) / (2 * a))
        while tokens > 0 and self.chunk_ms(start, tokens) > ms:  # the root's rounding
            tokens -= 1
        return tokens


def chunk_reads(start: int, tokens: int) -> int:
    """The KV entries a prompt chunk of `tokens` tokens from position `start` reads (token p reads p + 1)."""
    return tokens * start + tokens * (tokens + 1) // 2


@dataclass(frozen=True, slots=True)
class StepSample:
    new_tokens: int
    context_tokens: int
    decode_context_tokens: int
    ms: float


class StepCostFit:
    """The cost model over the last `window` steps; `fit()` is None until the steps vary enough
    (at least `min_samples` of them, and the token counts not constant) to tell the terms apart. A
    KV-read term whose count was zero in every step (a prefill worker runs no decodes) fits as 0.
    The first `warmup` steps are not recorded: they pay one-time costs (first touch of the KV pool,
    kernel selection) that took a fresh CPU worker's fitted fixed cost to 900 ms.

    `fold_fixed`: when every step computed the same number of tokens, fit without the fixed term (folded
    into the per-token one) instead of giving no model. A prefill worker's steps hold one chunk
    (services/prefill/main.py), so a busy one's steps all have 512 tokens and differ only in their KV
    reads: it had no model, and the scheduler priced its queue at the decode worker's rates (3.5 ms a
    token in a loaded c16-long run, against its own 0.87 ms and 0.0045 ms a KV read). Its model prices
    whole prompts, where the folded fixed cost is the per-chunk one.

    `overrun_ms(cost)` says how far the last `recent` steps ran past what `cost` predicts: a fit over
    `window` steps follows the mean, and its steps ran up to 2.6x their prediction when the machine's
    speed moved (other processes on the cores, the VM), which is what a step target must leave room for."""

    def __init__(self, window: int = 256, min_samples: int = 16, warmup: int = 8, recent: int = 64,
                 fold_fixed: bool = False) -> None:
        if min_samples < 3 or window < min_samples or warmup < 0 or not 0 < recent <= window:
            raise ValueError(f"need window >= min_samples >= 3 steps, warmup >= 0 and 0 < recent <= window, got "
                             f"window={window}, min_samples={min_samples}, warmup={warmup}, recent={recent}")
        self._samples: deque[StepSample] = deque(maxlen=window)
        self._min_samples = min_samples
        self._skip = warmup
        self._recent = recent
        self._fold_fixed = fold_fixed

    def record(self, new_tokens: int, context_tokens: int, ms: float, decode_context_tokens: int = 0) -> None:
        if self._skip > 0:
            self._skip -= 1
            return
        self._samples.append(StepSample(new_tokens, context_tokens, decode_context_tokens, ms))

    def fit(self) -> StepCost | None:
        if len(self._samples) < self._min_samples:
            return None
        design = np.array([[1.0, s.new_tokens, s.context_tokens, s.decode_context_tokens] for s in self._samples])
        used = design.any(axis=0)
        used[:2] = True
        if self._fold_fixed and np.ptp(design[:, 1]) == 0:
            used[0] = False
        if np.linalg.matrix_rank(design[:, used]) < used.sum():
            return None
        times = np.array([s.ms for s in self._samples])
        coefficients = np.zeros(design.shape[1])
        coefficients[used] = _trimmed_least_squares(design[:, used], times)
        return StepCost(*(float(c) for c in coefficients))

    def largest_step_tokens(self) -> int:
        """The most tokens one recorded step computed (0 before any): the fit knows steps up to that size,
        and the cost of larger ones is an extrapolation."""
        return max((s.new_tokens for s in self._samples), default=0)

    def overrun_ms(self, cost: StepCost, quantile: float = 0.95) -> float:
        """The `quantile` of (actual - predicted) step time over the last `recent` steps, at least 0; 0 with
        fewer than `min_samples` steps recorded."""
        if len(self._samples) < self._min_samples:
            return 0.0
        recent = list(self._samples)[-self._recent:]
        errors = [s.ms - cost.step_ms(s.new_tokens, s.context_tokens, s.decode_context_tokens) for s in recent]
        return max(0.0, float(np.quantile(errors, quantile)))


# A step is left out of the fit when its time lies more than OUTLIER_MADS scaled median absolute
# deviations (at least OUTLIER_FLOOR_MS) from the fit's prediction, the fit redone up to OUTLIER_ROUNDS
# times. Under load some steps ran 5-30x their prediction (another process held a core while a thread
# spun at a barrier); least squares followed them, predicting the ordinary steps 70-75 ms slow at the
# median (three traced c16-long runs replayed, 2-core AMD EPYC): the chunks then came out too small.
# Without them the median error was -4 to -5 ms; how far steps run past the fit is the margin's business.
OUTLIER_MADS = 3.5
OUTLIER_FLOOR_MS = 2.0
OUTLIER_ROUNDS = 3


def _trimmed_least_squares(design: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Nonnegative least squares, refitted without the steps far from its prediction (as above), as long
    as the steps kept still tell every term apart."""
    keep = np.ones(len(times), dtype=bool)
    coefficients = _nonnegative_least_squares(design, times)
    for _ in range(OUTLIER_ROUNDS):
        residuals = times - design @ coefficients
        centre = float(np.median(residuals[keep]))
        spread = max(OUTLIER_MADS * 1.4826 * float(np.median(np.abs(residuals[keep] - centre))), OUTLIER_FLOOR_MS)
        inliers = np.abs(residuals - centre) <= spread
        if (inliers == keep).all() or np.linalg.matrix_rank(design[inliers]) < design.shape[1]:
            break
        keep = inliers
        coefficients = _nonnegative_least_squares(design[keep], times[keep])
    return coefficients


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
