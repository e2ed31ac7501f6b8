"""Structured outputs in the engine: grammars compiled once per constraint for the model's
tokenizer, and a matcher per request that masks its logits row and advances with each token.

Model: a request's grammar state is a function of the tokens it generated, so a worker that takes
a request over (the decode worker after the KV hand-off, a migrated continuation) rebuilds it by
feeding those tokens to a fresh matcher; nothing but token ids crosses the wire. EOS is in the mask
only while the grammar is complete; a grammar that can take no more tokens ends the request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from services.common.structured_output import StructuredOutput

MAX_CACHED_GRAMMARS = 128


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and can take no more tokens (only EOS)."""
        return self._matcher.is_stopped()

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token. The mask admits only tokens the grammar takes, so a refusal
        is a broken invariant, not bad input."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (one bit per token id, 32 to an int32)."""
        llnp.fill_next_token_bitmask(self._matcher, bitmask, row)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and caches them (LRU, by grammar text).

    The llguidance tokenizer takes about a second to build, so it is built on the first
    constrained request, not at startup. Thread-safe: the engine thread and request admission
    may both ask for matchers.
    """

    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer_dir = tokenizer_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, structured: StructuredOutput, generated: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher for the constraint, advanced past the tokens already `generated` under it.
        ValueError when the grammar does not compile or those tokens do not follow it."""
        with self._lock:
            compiled = self._compile(structured.grammar())
        matcher = compiled.deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise ValueError(f"the tokens generated so far do not follow the {structured.kind} constraint: "
                             f"{matcher.get_error()}")
        return GrammarMatcher(matcher)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
        self._compiled[grammar] = compiled
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not (self._tokenizer_dir / "tokenizer.json").is_file():
                raise ValueError(f"{self._tokenizer_dir} has no tokenizer.json, which structured outputs need")
            hf = PreTrainedTokenizerFast.from_pretrained(str(self._tokenizer_dir))
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size,
                                                           eos_token=list(self._eos_token_ids))
        return self._tokenizer


def disallowed_tokens(matchers: list[GrammarMatcher], vocab_size: int,
                      eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Tokens each matcher forbids next, as booleans [len(matchers), vocab_size]. A row that allows
    nothing (a matcher in an error state) allows EOS, so the request ends instead of drawing from
    an empty distribution."""
    bitmask = llnp.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(bitmask, row)
    words = bitmask.view(np.uint32)  # bit t % 32 of word t // 32 is token t
    for row in np.flatnonzero(~words.any(axis=1)):
        for token_id in eos_token_ids:
            words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))
    bits = np.unpackbits((~words).view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)
