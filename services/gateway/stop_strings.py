"""Stop strings over streamed text: cut exactly at the first match, even when it spans deltas.

The matcher holds back the shortest text it must: the longest tail of the unsent text that could
still grow into a stop string. Everything before it is safe to send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    """What `StopStringMatcher.push` lets through: `text` to send, and the stop string that ended
    the output (None while it runs on)."""

    text: str
    stop: str | None = None


class StopStringMatcher:
    """Finds the first stop string in text that arrives in pieces.

    "First" is the match that completes first, as a reader of the stream one character at a time
    would see it; among matches ending at the same character, the longest. So the result never
    depends on how the text was split. The stop string itself is cut unless `include_stop`.
    After a match, `push` returns nothing more.
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(stops)
        self._include_stop = include_stop
        self._pending = ""  # received, not yet sent: a possible start of a stop string
        self.stopped: str | None = None

    @property
    def searches(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def push(self, text: str, check: bool = True) -> StopMatch:
        """Adds text; returns what may be sent now. `check=False` lets text through unsearched
        (before min_tokens, as vLLM does)."""
        if self.stopped is not None:
            return StopMatch("")
        if not self._stops:
            return StopMatch(text)  # nothing to hold back
        self._pending += text
        if not check:
            return StopMatch(self.flush())
        match = self._first_match()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop else start
            sent, self._pending, self.stopped = self._pending[:end], "", stop
            return StopMatch(sent, stop)
        keep = self._held_length()
        sent = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(sent) :]
        return StopMatch(sent)

    def flush(self) -> str:
        """The held-back text, at the end of the output (it matched no stop string)."""
        sent, self._pending = self._pending, ""
        return sent

    def _first_match(self) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first, the longest among those ending together."""
        found = [(start + len(stop), -len(stop), start, stop)
                 for stop in self._stops if (start := self._pending.find(stop)) >= 0]
        if not found:
            return None
        _, _, start, stop = min(found)
        return start, stop

    def _held_length(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        longest = min(len(self._pending), max((len(s) for s in self._stops), default=1) - 1)
        for length in range(longest, 0, -1):
            tail = self._pending[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
