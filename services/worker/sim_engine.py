"""A model-free engine for simulated workers (`tandem sim-worker`): the real `Engine` — iteration
scheduler, block manager, prefix cache, stop rules, KV hand-off — with the model call replaced by a
sleep and sampling by a fixed function of the token history.

So a simulated worker speaks the real worker protocol through the real worker code (registration,
load reports, block events with real prefix hashes, token streams, KV transfer of a tiny cache),
and costs its host almost no CPU: each iteration sleeps `step_ms`, plus the prompt tokens it
computes at `prefill_tokens_per_s`. Every running request gets one token per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.common.model_config import ModelConfig
from services.runtime.batch_scheduler import ScheduledChunk
from services.runtime.engine import Engine, EngineConfig
from services.runtime.sampler import SampledToken, SampleRequest


@dataclass(frozen=True, slots=True)
class SimTiming:
    """How long a simulated iteration takes: `step_ms`, plus its prompt tokens at
    `prefill_tokens_per_s` (0: prompt tokens cost nothing beyond the step)."""

    step_ms: float = 20.0
    prefill_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.step_ms < 0 or self.prefill_tokens_per_s < 0:
            raise ValueError(f"step_ms ({self.step_ms}) and prefill_tokens_per_s ({self.prefill_tokens_per_s}) "
                             "must be >= 0")

    def step_s(self, chunks: list[ScheduledChunk]) -> float:
        prompt_tokens = sum(c.num_new_tokens for c in chunks if c.num_new_tokens > 1)
        prefill_s = prompt_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        return self.step_ms / 1000 + prefill_s


def sim_token(previous: int, position: int, vocab_size: int) -> int:
    """The token a simulated worker samples at `position` after token `previous`.

    A fixed function of the two, so a request's tokens do not depend on batching, on which worker
    runs it, or on a hand-off or migration between workers. The ids stay in the middle half of the
    vocabulary, away from the special and end-of-sequence tokens at its ends.
    """
    band = max(1, vocab_size // 2)
    return vocab_size // 4 + (previous * 7919 + position * 104729) % band


class SimEngine(Engine):
    """`Engine` with a sleeping runner and `sim_token` as its sampler. The KV cache has the model's
    block count and block size but one layer of one head of width one: KV transfers move real,
    tiny chunks. The vocabulary, end-of-sequence ids and context length are the model's."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, timing: SimTiming) -> None:
        super().__init__(_Shapes(_tiny(model_config)), config)
        self.runner = _SleepingRunner(timing)
        self.sampler = _HistorySampler(model_config.vocab_size)

    @classmethod
    def for_model_dir(cls, model_dir: Path, num_blocks: int, timing: SimTiming,
                      max_batched_tokens: int = 2048, max_seqs: int = 64, chunk_size: int = 512,
                      served_name: str = "") -> SimEngine:
        """Reads only the model's config.json: no weights are loaded."""
        config = EngineConfig(num_kv_blocks=num_blocks, max_num_batched_tokens=max_batched_tokens,
                              max_num_seqs=max_seqs, chunk_size=chunk_size, served_name=served_name)
        return cls(ModelConfig.from_model_dir(model_dir), config, timing)


def _tiny(config: ModelConfig) -> ModelConfig:
    return replace(config, num_layers=1, num_kv_heads=1, head_dim=1)


@dataclass(frozen=True, slots=True)
class _Shapes:
    """What `Engine.__init__` reads of a model: its config and device."""

    config: ModelConfig
    device: torch.device = torch.device("cpu")


@dataclass(slots=True)
class _SleepingRunner:
    timing: SimTiming
    after_layer: Callable[[list[ScheduledChunk], int], None] | None = None  # as ModelRunner's, for its one layer

    def run(self, chunks: list[ScheduledChunk]) -> None:
        time.sleep(self.timing.step_s(chunks))
        if self.after_layer is not None:
            self.after_layer(chunks, 0)


@dataclass(frozen=True, slots=True)
class _HistorySampler:
    vocab_size: int

    def sample(self, logits: None, requests: list[SampleRequest]) -> list[SampledToken]:
        return [SampledToken(sim_token(_last(r), r.position, self.vocab_size), 0.0) for r in requests]


def _last(request: SampleRequest) -> int:
    return request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
