"""A request's deadline: the earlier of the Submit call's gRPC deadline and its `deadline_unix_ms`,
kept on the monotonic clock so that every downstream call gets the time that is left."""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.common.errors import DeadlineExceeded


@dataclass(frozen=True, slots=True)
class Deadline:
    """`at` is a time.monotonic() instant, None when the request has no deadline."""

    at: float | None = None

    @classmethod
    def of(cls, call_remaining: float | None, deadline_unix_ms: int = 0) -> Deadline:
        """From the call's time_remaining() (seconds or None) and the request's absolute deadline (0: none)."""
        now = time.monotonic()
        limits = []
        if call_remaining is not None:
            limits.append(now + call_remaining)
        if deadline_unix_ms > 0:
            limits.append(now + deadline_unix_ms / 1000 - time.time())
        return cls(min(limits) if limits else None)

    def remaining(self) -> float | None:
        """Seconds left (0 once passed), None without a deadline."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def timeout(self, default: float) -> float:
        """The timeout for a downstream call: the time left, capped at `default`.

        Raises DeadlineExceeded once the deadline has passed, so no call starts without time to finish.
        """
        remaining = self.remaining()
        if remaining is None:
            return default
        if remaining <= 0:
            raise DeadlineExceeded("the request's deadline passed in the scheduler")
        return min(remaining, default)
