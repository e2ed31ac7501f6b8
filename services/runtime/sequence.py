"""A request as the engine tracks it: its tokens, how many have KV computed, and its blocks.

There is no separate prefill or decode phase: each step brings `num_computed_tokens` closer to
`num_tokens`; when they meet, the next token is sampled. That one rule covers chunked prefill,
prefix-cache hits, decode, and recompute after preemption.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.common.block_hash import BlockHash
from services.runtime.grammar import GrammarMatcher
from services.runtime.sampler import SampledToken, SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREFILLED = 2  # first token sampled on a prefill-only engine; blocks held until exported
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PREFILLED = "prefilled"  # handed to a decode worker; not an end of the request


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    SequenceStatus.PREFILLED: FinishReason.PREFILLED,
}


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    salt: str = ""
    lora: str = ""  # the LoRA adapter's served name; "" for the base model alone
    stop_after_prefill: bool = False
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[SampledToken] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    grammar: GrammarMatcher | None = None  # set by the engine when params.structured is

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)
