"""Which scheduler replica a request goes to: the one its leading prefix ranks first (rendezvous
hashing of its model, tenant salt, adapter and first KEY_TOKENS prompt tokens over the replicas),
so the requests of one prefix family meet the same replica, whose own view of its placements (the
prefills it queued, the workers it chose) routes the family as a single scheduler would.

Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): a replica that took
more than LOAD_FACTOR times its fair share of the gateway's last WINDOW submissions (and at least
MIN_SHARE of them) is passed over for the key's next replica, so one hot family cannot swamp a
replica; so is one whose channel is failing (its families spread over the others in their own
orders). A scheduler's work is per request routed, so the share of submissions is its load.
Gateways given the same `--scheduler` list rank alike, so they agree on a family's replica.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable, Sequence

KEY_TOKENS = 16  # one KV block at the workers' default block size: what a prefix family shares first
LOAD_FACTOR = 1.25
WINDOW = 256  # the gateway's recent submissions a replica's share is counted over
MIN_SHARE = 8  # a replica's bound is never below this many of them: light traffic keeps its families whole


def prefix_key(model: str, cache_salt: str, lora: str, token_ids: Sequence[int]) -> bytes:
    """What a request's replica is chosen by: the model and tenant keys and its first KEY_TOKENS
    tokens (requests sharing those would share KV blocks on a worker)."""
    head = ",".join(map(str, token_ids[:KEY_TOKENS]))
    return hashlib.blake2b(f"{model}\0{cache_salt}\0{lora}\0{head}".encode(), digest_size=16).digest()


def rendezvous_order(key: bytes, replicas: int) -> list[int]:
    """The replicas (indexes) best first for `key`: by the hash of the key with each index, highest first."""
    def weight(replica: int) -> bytes:
        return hashlib.blake2b(key + replica.to_bytes(4, "big"), digest_size=8).digest()

    return sorted(range(replicas), key=weight, reverse=True)


class ReplicaChoice:
    """Call `choose` once per request; it counts the choice in the window (not thread-safe: the
    gateway's event loop calls it)."""

    def __init__(self, replicas: int, *, window: int = WINDOW, load_factor: float = LOAD_FACTOR,
                 min_share: int = MIN_SHARE) -> None:
        if replicas < 1:
            raise ValueError("the gateway needs at least one scheduler replica to choose from")
        if load_factor < 1:
            raise ValueError(f"load_factor is {load_factor}; give 1 or more (the bound over a fair share)")
        self.replicas = replicas
        self._load_factor = load_factor
        self._min_share = min_share
        self._recent: deque[int] = deque(maxlen=window)
        self._counts = [0] * replicas

    def choose(self, key: bytes, available: Callable[[int], bool] = lambda replica: True) -> int:
        """The first replica in the key's order that is available and within its bound (the key's
        first one when none is available: a failed call then moves on as for any other)."""
        if self.replicas == 1:
            return 0
        order = rendezvous_order(key, self.replicas)
        candidates = [replica for replica in order if available(replica)] or order
        bound = max(self._min_share, math.ceil(self._load_factor * (len(self._recent) + 1) / len(candidates)))
        # The bounds over the candidates sum to more than the window holds: one is always under its own.
        chosen = next(replica for replica in candidates if self._counts[replica] < bound)
        self._count(chosen)
        return chosen

    def share(self, replica: int) -> int:
        """The replica's count among the window's submissions."""
        return self._counts[replica]

    def _count(self, replica: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._counts[self._recent[0]] -= 1
        self._recent.append(replica)
        self._counts[replica] += 1
