"""Routing costs, as pure functions over candidate workers (lower cost wins; ties: fewer running, then id).

Prefill (and colocated) workers: cost = (prompt_tokens - cached_tokens_on_worker) + queued_prefill_tokens,
the prompt tokens the worker must still compute before this request's first token. A worker's cached
tokens are its leading prompt blocks in the prefix index, times the block size, less the last prompt
token, which is always computed to get the first token's logits. Degraded routing (no prefix index)
counts no cached tokens: the least loaded worker wins.

Decode workers: the most free KV blocks wins, counting blocks reserved since the worker last reported
as used; cost = -free_blocks. A worker with fewer free blocks than the request needs is ranked last.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from operator import itemgetter
from typing import NamedTuple

from services.common.blocks import ceil_div
from tandem.v1 import scheduler_pb2


class Candidate(NamedTuple):
    """A worker as routing sees it: its last reported load with this scheduler's own requests on top.
    (Candidates and scores are named tuples: a route builds one of each per worker, and a tuple costs a
    third of a frozen dataclass to build.)"""

    worker_id: str
    block_size: int = 16
    free_blocks: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    cached_blocks: int = 0


class Score(NamedTuple):
    """A candidate's cost and its inputs (the wire's WorkerScore)."""

    worker_id: str
    cost: float
    cached_blocks: int = 0
    queued_prefill_tokens: int = 0
    free_blocks: int = 0
    running: int = 0

    def to_pb(self) -> scheduler_pb2.WorkerScore:
        return scheduler_pb2.WorkerScore(
            worker_id=self.worker_id, cost=self.cost, cached_blocks=self.cached_blocks,
            queued_prefill_tokens=self.queued_prefill_tokens, free_blocks=self.free_blocks, running=self.running)


# Build a Candidate or Score from one tuple of its fields, in order: tuple.__new__ straight from C, without
# the Python frame of a named tuple's __new__ (routing builds one of each per worker on every request).
new_candidate = partial(tuple.__new__, Candidate)
_new_score = partial(tuple.__new__, Score)


def cached_tokens(cached_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens a worker can take from its cache: whole cached blocks, never the last prompt token."""
    return max(0, min(cached_blocks * block_size, prompt_tokens - 1))


def prefill_cost(prompt_tokens: int, cached: int, queued_prefill_tokens: int) -> int:
    return (prompt_tokens - cached) + queued_prefill_tokens


def blocks_for(num_tokens: int, block_size: int) -> int:
    return ceil_div(num_tokens, block_size)


_PREFILL_ORDER = itemgetter(1, 5, 0)  # Score: cost, running, worker_id


def rank_prefill(candidates: Iterable[Candidate], prompt_tokens: int, use_prefix: bool = True) -> list[Score]:
    """Prefill (or colocated) candidates, best first."""
    scores = []
    for worker_id, block_size, _, running, queued, cached_blocks in candidates:
        matched = cached_blocks if use_prefix else 0
        cached = cached_tokens(matched, block_size, prompt_tokens) if matched else 0
        scores.append(_new_score((worker_id, float(prefill_cost(prompt_tokens, cached, queued)), matched, queued, 0,
                                  running)))
    scores.sort(key=_PREFILL_ORDER)
    return scores


def rank_decode(candidates: Iterable[Candidate], num_tokens: int) -> list[Score]:
    """Decode candidates for a request whose KV spans `num_tokens`, best first."""
    ranked = [(c.free_blocks < blocks_for(num_tokens, c.block_size), -c.free_blocks, c.running, c.worker_id,
               Score(c.worker_id, float(-c.free_blocks), 0, 0, c.free_blocks, c.running)) for c in candidates]
    ranked.sort()  # short last, then cost, running, id (ids are unique: the scores are never compared)
    return [entry[4] for entry in ranked]
