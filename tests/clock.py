"""A clock that moves only when a test says, for the code that takes `clock` (monotonic seconds).

Liveness (heartbeat TTLs, store retries) measured on it cannot lapse because a loaded machine
starved a process of CPU: time passes exactly when, and as far as, the test advances it.
"""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
