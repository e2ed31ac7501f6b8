"""Measure the grammar engines for structured outputs on the default model's tokenizer.

For xgrammar, llguidance and outlines-core: the time to compile a JSON schema, and the cost of one
decode step's token masks at batch 1 and 32 (every row's mask computed, then the row advanced by a
token of a valid answer). Only llguidance is a dependency: `pip install xgrammar==0.2.8
outlines-core==0.2.14` first, then `python scripts/bench_grammar.py [--model-dir DIR]`. It prints
one line per engine; the README's table comes from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from services.common.paths import tandem_home

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poetry"], '
          '"address": {"city": "London", "zip": "W1"}}')
BATCHES = (1, 32)


def bench_llguidance(tokenizer: PreTrainedTokenizerFast, vocab: int, answer: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    compile_ms = _ms(lambda: llguidance.LLMatcher(ll_tokenizer, grammar))
    executor = llguidance.LLExecutor()

    def steps(batch: int) -> float:
        matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in range(batch)]
        bitmask = lnp.allocate_token_bitmask(batch, vocab)
        times = []
        for token in answer:
            start = time.perf_counter()
            lnp.fill_next_token_bitmask_par(executor, list(zip(matchers, range(batch))), bitmask)
            times.append(time.perf_counter() - start)
            for m in matchers:
                m.consume_token(token)
        assert all(m.is_accepting() for m in matchers), "the answer must be valid under the schema"
        return statistics.median(times) * 1e3

    return {"compile_ms": compile_ms, **{f"step_ms_b{b}": steps(b) for b in BATCHES}}


def bench_xgrammar(tokenizer: PreTrainedTokenizerFast, vocab: int, answer: list[int]) -> dict[str, float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    compiled = []
    compile_ms = _ms(lambda: compiled.append(compiler.compile_json_schema(json.dumps(SCHEMA))))

    def steps(batch: int) -> float:
        matchers = [xgrammar.GrammarMatcher(compiled[0]) for _ in range(batch)]
        bitmask = xgrammar.allocate_token_bitmask(batch, vocab)
        batched = xgrammar.BatchGrammarMatcher()
        times = []
        for token in answer:
            start = time.perf_counter()
            batched.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append(time.perf_counter() - start)
            for m in matchers:
                m.accept_token(token)
        return statistics.median(times) * 1e3

    return {"compile_ms": compile_ms, **{f"step_ms_b{b}": steps(b) for b in BATCHES}}


def bench_outlines_core(tokenizer: PreTrainedTokenizerFast, vocab: int, answer: list[int]) -> dict[str, float]:
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary, json_schema

    eos = tokenizer.eos_token_id
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    decoded: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != eos and token not in tokenizer.all_special_tokens:
            decoded.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
    vocabulary = Vocabulary(eos, decoded)
    regex = json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = []
    compile_ms = _ms(lambda: index.append(Index(regex, vocabulary)))

    def steps(batch: int) -> float:
        guides = [Guide(index[0]) for _ in range(batch)]
        mask = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
        times = []
        for token in answer:
            start = time.perf_counter()
            for row, guide in enumerate(guides):
                guide.write_mask_into(mask[row].ctypes.data, mask[row].size, mask.itemsize)
            times.append(time.perf_counter() - start)
            for guide in guides:
                guide.advance(token)
        return statistics.median(times) * 1e3

    return {"compile_ms": compile_ms, **{f"step_ms_b{b}": steps(b) for b in BATCHES}}


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=tandem_home() / "models" / "SmolLM2-135M-Instruct")
    args = parser.parse_args()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.model_dir))
    vocab = len(tokenizer)
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    print(f"vocab {vocab}, answer {len(answer)} tokens; median over the answer's steps")
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines-core", bench_outlines_core)):
        result = bench(tokenizer, vocab, answer)
        print(f"{name:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
