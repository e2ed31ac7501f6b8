"""The queue's drain rate, and the Retry-After hint a refused request gets from it.

The rate is the running requests that ended per second over a sliding window (shorter while the
scheduler is younger than the window). A refused request may find room once the queue ahead of it
and one more slot have drained: retry_after = (waiting + 1) / rate, clamped to [MIN, MAX] seconds.
A queue that has not drained at all in the window gets the longest hint.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 30.0
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


class DrainRate:
    """`clock` (monotonic seconds) is injectable for tests."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._started = clock()
        self._ended: deque[float] = deque()

    def record(self) -> None:
        """A running request ended (finished, failed or aborted): its slot is free."""
        self._ended.append(self._clock())

    def per_second(self) -> float:
        now = self._clock()
        while self._ended and self._ended[0] <= now - self._window_s:
            self._ended.popleft()
        span = min(self._window_s, now - self._started)
        return len(self._ended) / span if span > 0 else 0.0

    def retry_after(self, waiting: int) -> float:
        """Seconds until a request refused behind `waiting` others may find room."""
        rate = self.per_second()
        if rate <= 0:
            return MAX_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, (waiting + 1) / rate))
