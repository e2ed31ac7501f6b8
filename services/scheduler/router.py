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
from dataclasses import dataclass

from services.common.blocks import ceil_div
from tandem.v1 import scheduler_pb2


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as routing sees it: its last reported load with this scheduler's own requests on top."""

    worker_id: str
    block_size: int = 16
    free_blocks: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    cached_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Score:
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


def cached_tokens(cached_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens a worker can take from its cache: whole cached blocks, never the last prompt token."""
    return max(0, min(cached_blocks * block_size, prompt_tokens - 1))


def prefill_cost(prompt_tokens: int, cached: int, queued_prefill_tokens: int) -> int:
    return (prompt_tokens - cached) + queued_prefill_tokens


def blocks_for(num_tokens: int, block_size: int) -> int:
    return ceil_div(num_tokens, block_size)


def rank_prefill(candidates: Iterable[Candidate], prompt_tokens: int, use_prefix: bool = True) -> list[Score]:
    """Prefill (or colocated) candidates, best first."""
    scores = []
    for c in candidates:
        matched = c.cached_blocks if use_prefix else 0
        cost = prefill_cost(prompt_tokens, cached_tokens(matched, c.block_size, prompt_tokens),
                            c.queued_prefill_tokens)
        scores.append(Score(c.worker_id, float(cost), cached_blocks=matched,
                            queued_prefill_tokens=c.queued_prefill_tokens, running=c.running))
    return sorted(scores, key=lambda s: (s.cost, s.running, s.worker_id))


def rank_decode(candidates: Iterable[Candidate], num_tokens: int) -> list[Score]:
    """Decode candidates for a request whose KV spans `num_tokens`, best first."""
    scores, short = [], set()
    for c in candidates:
        scores.append(Score(c.worker_id, float(-c.free_blocks), free_blocks=c.free_blocks, running=c.running))
        if c.free_blocks < blocks_for(num_tokens, c.block_size):
            short.add(c.worker_id)
    return sorted(scores, key=lambda s: (s.worker_id in short, s.cost, s.running, s.worker_id))
