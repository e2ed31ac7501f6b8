"""The in-process engine: requests in, tokens out, one iteration per `step()`.

Colocated mode runs it alone; a prefill worker runs it with `stop_after_prefill`, and a decode
worker admits requests whose KV was imported. Moving KV between engines is the hand-off's
(services/runtime/kv_handoff.py); the engine only gives up a prefilled sequence and takes in an
imported one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.blocks import ceil_div
from services.runtime.attention import select_backend
from services.runtime.batch_scheduler import IterationScheduler, ScheduledChunk, SchedulerLimits
from services.runtime.block_manager import BlockManager
from services.runtime.counters import EngineCounters
from services.runtime.grammar import GrammarCompiler
from services.runtime.kv_cache import PagedKVCache, kv_memory_budget
from services.runtime.lora import LoraManager
from services.runtime.model import CausalLM
from services.runtime.model_runner import ModelRunner, order_for_batch
from services.runtime.precision import Precision
from services.runtime.sampler import SampledToken, SampleRequest, Sampler, SamplingParams, resolve_seed, score_tokens
from services.runtime.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_bytes: int | None = 1 << 30  # None: kv_cache.kv_memory_budget sizes it from the device
    kv_memory_fraction: float = 0.9  # of the GPU memory free after the weights, when kv_memory_bytes is None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    chunk_size: int | None = None
    enable_prefix_cache: bool = True
    max_model_len: int | None = None
    device: str = "cpu"
    precision: Precision = Precision()  # activations' and KV dtype, weights' format (runtime/precision.py)
    attention_backend: str = "auto"
    num_threads: int | None = None
    max_loras: int = 4  # LoRA adapters loaded at once (runtime/lora.py)
    served_name: str = ""  # the model's name on a worker: its prefix cache's hash-chain key (block_manager.py)

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.dtype


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # On the first output of a request asking for them: each prompt token's after the first.
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(frozen=True, slots=True)
class IterationWork:
    """One request's share of an iteration: the tokens whose KV it computed, the tokens its first
    chunk found in the prefix cache (0 on later chunks), its preemptions so far, and the KV entries
    its new tokens' attention read (token at position p reads p + 1: the step-cost model's input)."""

    num_new_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_context_tokens: int = 0


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig, grammars: GrammarCompiler | None = None,
                 loras: LoraManager | None = None) -> None:
        """`grammars` compiles structured-output constraints; without it they are refused. `loras`
        serves requests that name an adapter; without it they are refused."""
        self.config = config
        self.loras = loras
        self.grammars = grammars
        self.model = model
        self.model_config = model.config
        num_blocks = config.num_kv_blocks or PagedKVCache.blocks_for_budget(
            model.config, kv_memory_budget(config.kv_memory_bytes, config.kv_memory_fraction, model.device),
            config.block_size, config.dtype
        )
        self.cache = PagedKVCache(model.config, num_blocks, config.block_size, config.dtype, model.device)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_cache, config.served_name)
        self.counters = EngineCounters()
        self.last_work: dict[str, IterationWork] = {}  # request id -> its share of the last step
        self.scheduler = IterationScheduler(self.blocks, self.counters, SchedulerLimits(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            chunk_size=config.chunk_size or config.max_num_batched_tokens,
            enable_prefix_cache=config.enable_prefix_cache,
        ), on_allocate=self.cache.initialize)
        self.runner = ModelRunner(model, self.cache, loras)
        self.sampler = Sampler()
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        self._requests: dict[str, Sequence] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig | None = None,
                       lora_sources: dict[str, Path] | None = None) -> Engine:
        """`lora_sources` (served name -> adapter directory, `lora.lora_sources`) are the adapters
        requests may name."""
        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = torch.device(config.device)
        backend = select_backend(config.attention_backend, device, config.block_size)
        model = CausalLM.from_model_dir(model_dir, backend, config.precision, device)
        grammars = GrammarCompiler(Path(model_dir), model.config.vocab_size, model.config.eos_token_ids)
        loras = LoraManager(lora_sources, config.max_loras, model.config, config.dtype, device) if lora_sources else None
        return cls(model, config, grammars, loras)

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        salt: str = "",
        stop_after_prefill: bool = False,
        seed: int | None = None,
        lora: str = "",
    ) -> None:
        """`lora` names the adapter (LoraManager's served name) the request runs under; "" for none."""
        self._check_new(request_id, prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, resolve_seed(seed if seed is not None else params.seed),
                       salt=salt, lora=lora, stop_after_prefill=stop_after_prefill)
        self._attach_grammar(seq)
        self._track(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drops the request wherever it is in the engine and frees its blocks at once; False if unknown."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._forget(seq)
        self.scheduler.remove(seq)
        self.scheduler.release_blocks(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # -- the iteration ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        chunks = order_for_batch(self.scheduler.schedule())
        if not chunks:
            return []
        self._record_batch(chunks)
        logits = self.runner.run(chunks)
        completing = [c for c in chunks if c.completes]
        sampled = self.sampler.sample(logits, [self._sample_request(c.seq) for c in completing])
        for chunk in chunks:
            self._advance(chunk)
        return [self._append(c.seq, token) for c, token in zip(completing, sampled)]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Runs prompts to completion together; returns each one's output token ids."""
        ids = [f"generate-{i}-{id(prompts)}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        while self.has_unfinished():
            for out in self.step():
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[rid] for rid in ids]

    def _record_batch(self, chunks: list[ScheduledChunk]) -> None:
        self.last_work = {c.seq.request_id: _work(c) for c in chunks}
        self.counters.record_batch(len(chunks))

    def _sample_request(self, seq: Sequence) -> SampleRequest:
        return SampleRequest(seq.params, seq.seed, seq.num_tokens, seq.prompt_token_ids, seq.output_token_ids,
                             self.model_config.eos_token_ids, seq.grammar)

    def _advance(self, chunk: ScheduledChunk) -> None:
        """Counts the chunk's tokens as computed and indexes the blocks it filled in the prefix cache."""
        seq = chunk.seq
        seq.num_computed_tokens += chunk.num_new_tokens
        size = self.blocks.block_size
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // size):
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = self.blocks.hash_next(parent, tokens, seq.salt, seq.lora)
            seq.block_hashes.append(block_hash)
            self.blocks.commit(seq.block_table[index], block_hash, tokens)

    def _append(self, seq: Sequence, token: SampledToken) -> RequestOutput:
        first = seq.num_output_tokens == 0 and seq.params.prompt_logprobs is not None
        prompt_logprobs = self._prompt_logprobs(seq) if first else None
        seq.token_ids.append(token.token_id)
        seq.output_logprobs.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token.token_id)
        self.counters.generated_tokens += 1
        seq.status = self._status_after(seq, token.token_id)
        if seq.status.is_finished:
            self.scheduler.remove(seq)
            self.scheduler.release_blocks(seq)
            self._forget(seq)
        elif seq.stop_after_prefill:
            seq.status = SequenceStatus.PREFILLED
            self.scheduler.remove(seq)
        return RequestOutput(seq.request_id, [token.token_id], [token], seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens, prompt_logprobs)

    def _prompt_logprobs(self, seq: Sequence) -> list[SampledToken]:
        """The prompt's logprobs, teacher-forced in one pass over the whole prompt (its chunks kept
        only their last row's logits). The pass rewrites the prompt's KV into the sequence's own
        blocks with the same tokens' values; they are its own, as such a request skips the prefix
        cache, and no other request reads them before the next step."""
        prompt = seq.prompt_token_ids
        logits = self.runner.prompt_logits(prompt, seq.block_table, seq.lora)[:-1]
        return score_tokens(logits, prompt[1:], seq.params.prompt_logprobs or 0)

    def _status_after(self, seq: Sequence, token_id: int) -> SequenceStatus:
        params = seq.params
        if seq.grammar is not None and seq.grammar.is_finished:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.model_config.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return SequenceStatus.RUNNING

    def _check_new(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty; a request needs at least one prompt token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the model's context is {self.max_model_len}")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        params.validate()
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        generated = params.structured.num_generated_prompt_tokens if params.structured else 0
        if generated >= len(prompt_token_ids):
            raise ValueError(f"structured.num_generated_prompt_tokens must be below the prompt's {len(prompt_token_ids)} "
                             f"tokens, got {generated}")

    def _attach_grammar(self, seq: Sequence) -> None:
        """The sequence's grammar matcher, advanced past every token generated under it so far (a
        migrated continuation's prompt tail, the first token a decode worker receives)."""
        structured = seq.params.structured
        if structured is None:
            return
        if self.grammars is None:
            raise ValueError("this engine has no tokenizer to compile grammars with; structured outputs need one")
        start = seq.num_prompt_tokens - structured.num_generated_prompt_tokens
        seq.grammar = self.grammars.matcher(structured, seq.token_ids[start:])

    def _track(self, seq: Sequence) -> None:
        """The engine holds `seq` from now on, and its adapter stays loaded until `_forget`."""
        if seq.lora:
            if self.loras is None:
                raise ValueError(f"request {seq.request_id!r} names LoRA adapter {seq.lora!r} but this engine serves "
                                 "no adapters; start the worker with --lora NAME=DIR")
            self.loras.acquire(seq.lora)
        self._requests[seq.request_id] = seq

    def _forget(self, seq: Sequence) -> None:
        del self._requests[seq.request_id]
        if seq.lora:
            self.loras.release(seq.lora)

    # -- the KV hand-off (services/runtime/kv_handoff.py) ----------------------------------

    def take_prefilled(self, request_id: str) -> Sequence:
        """Hands a prefilled request (first token sampled, blocks held) over; the engine forgets it."""
        seq = self._requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.PREFILLED:
            raise KeyError(f"request {request_id!r} has no prefilled KV to export")
        self._forget(seq)
        return seq

    def add_running(self, seq: Sequence, arrived_at: float | None = None) -> None:
        """A sequence whose KV is already in its blocks (imported) decodes from the next step on;
        `arrived_at`: when its first token reached this worker (the batch scheduler's clock)."""
        if seq.request_id in self._requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self._attach_grammar(seq)
        self._track(seq)
        self.scheduler.add_running(seq, arrived_at)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.blocks.block_size)


def _work(chunk: ScheduledChunk) -> IterationWork:
    """A chunk as the iteration's record; only a prompt's first chunk starts at its cached tokens."""
    seq = chunk.seq
    first = seq.num_computed_tokens == seq.num_cached_tokens
    new, start = chunk.num_new_tokens, seq.num_computed_tokens
    return IterationWork(new, seq.num_cached_tokens if first else 0, seq.num_preemptions,
                         new * start + new * (new + 1) // 2)
