"""Greedy output of the in-process engine equals HF transformers, token for token, under every
batching condition: plain, chunked prefill, prefix-cache hits, preemption, and the KV hand-off
from a prefill engine to a decode engine."""

from __future__ import annotations

import pytest

from services.common.blocks import ceil_div
from services.runtime.engine import Engine, EngineConfig
from services.runtime.kv_handoff import KvHandoff
from services.runtime.sampler import SamplingParams
from services.runtime.sequence import FinishReason
from tests.hf_reference import MAX_NEW_TOKENS, assert_matches

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)


def make_engine(model_dir, **overrides) -> Engine:
    return Engine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=overrides.pop("num_kv_blocks", 1024), **overrides))


def run_all(engine: Engine, prompts: list[list[int]], tag: str) -> tuple[list[list[int]], dict[str, int]]:
    """Submits every prompt at once, steps to the end; returns tokens and cached-token counts."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    return [tokens[rid] for rid in ids], cached


def assert_all_match(outputs, references, label):
    for i, (got, ref) in enumerate(zip(outputs, references)):
        assert_matches(got, ref, f"{label} prompt {i}")


def assert_no_referenced_blocks(engine: Engine) -> None:
    assert engine.blocks.num_referenced_blocks == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_prompts_cover_the_required_lengths(parity_prompts):
    lengths = sorted(len(p) for p in parity_prompts)
    assert len(parity_prompts) >= 8 and lengths[0] == 1 and lengths[-1] > 300


def test_batched_greedy_matches_hf(default_model_dir, parity_prompts, parity_references):
    engine = make_engine(default_model_dir)
    outputs, _ = run_all(engine, parity_prompts, "plain")
    assert_all_match(outputs, parity_references, "batched")
    assert engine.counters.max_batch_size == len(parity_prompts)
    assert_no_referenced_blocks(engine)


def test_chunked_prefill_matches_hf(default_model_dir, parity_prompts, parity_references):
    engine = make_engine(default_model_dir, max_num_batched_tokens=32)
    outputs, _ = run_all(engine, parity_prompts, "chunked")
    assert_all_match(outputs, parity_references, "chunked prefill")
    assert_no_referenced_blocks(engine)


def test_prefix_cache_hits_match_hf(default_model_dir, parity_prompts, parity_references):
    engine = make_engine(default_model_dir)
    first, cached_first = run_all(engine, parity_prompts, "cold")
    second, cached_second = run_all(engine, parity_prompts, "warm")
    assert_all_match(first, parity_references, "cold cache")
    assert_all_match(second, parity_references, "warm cache")
    assert all(count == 0 for count in cached_first.values())
    expected = {f"warm-{i}": (len(p) - 1) // 16 * 16 for i, p in enumerate(parity_prompts)}
    assert cached_second == expected
    assert_no_referenced_blocks(engine)


def test_preemption_by_recompute_matches_hf(default_model_dir, parity_prompts, parity_references):
    longest = max(len(p) for p in parity_prompts) + MAX_NEW_TOKENS
    engine = make_engine(default_model_dir, num_kv_blocks=longest // 16 + 8, enable_prefix_cache=False)
    outputs, _ = run_all(engine, parity_prompts, "tight")
    assert engine.counters.preemptions > 0
    assert_all_match(outputs, parity_references, "preempted")
    assert_no_referenced_blocks(engine)


def test_kv_handoff_from_a_prefill_engine_matches_hf(default_model_dir, parity_prompts, parity_references):
    source, target = make_engine(default_model_dir), make_engine(default_model_dir)
    exporter, importer = KvHandoff(source), KvHandoff(target)
    tokens: dict[str, list[int]] = {f"m-{i}": [] for i in range(len(parity_prompts))}
    prefilled: list[str] = []
    for i, prompt in enumerate(parity_prompts):
        source.add_request(f"m-{i}", prompt, GREEDY, stop_after_prefill=True, seed=7)
    while source.has_unfinished():
        for out in source.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is FinishReason.PREFILLED:
                prefilled.append(out.request_id)
    assert len(prefilled) == len(parity_prompts) - 1  # the one whose first token is EOS ends on the prefill side
    for rid in prefilled:
        prompt = parity_prompts[int(rid.split("-")[1])]
        reservation = importer.reserve(rid, len(prompt) + 1)
        export = exporter.export(rid, max_chunk_bytes=64 * 1024)
        chunks = list(export.chunks)
        assert export.num_chunks == len(chunks) and export.num_blocks == ceil_div(len(prompt), 16)
        for chunk in chunks:
            assert importer.import_chunk(reservation, chunk)
        importer.admit(rid, prompt, tokens[rid], GREEDY, seed=7)
        exporter.release_export(rid)
        assert len(reservation.block_ids) == ceil_div(len(prompt) + 1, 16)
    assert importer.reserved_blocks == 0 and exporter.num_in_flight == 0
    while target.has_unfinished():
        for out in target.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert_all_match([tokens[f"m-{i}"] for i in range(len(parity_prompts))], parity_references, "handed off")
    assert_no_referenced_blocks(source)
    assert_no_referenced_blocks(target)


def test_finish_reasons_and_usage(default_model_dir, parity_prompts, parity_references):
    engine = make_engine(default_model_dir)
    engine.add_request("length", parity_prompts[5], SamplingParams(max_tokens=3, temperature=0.0))
    engine.add_request("eos", parity_prompts[1], SamplingParams(max_tokens=3, temperature=0.0))
    outputs: dict[str, list] = {"length": [], "eos": []}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert [o.finish_reason for o in outputs["length"]] == [None, None, FinishReason.LENGTH]
    assert [o.new_token_ids[0] for o in outputs["length"]] == parity_references[5].tokens[:3]
    assert (outputs["length"][-1].num_output_tokens, outputs["length"][-1].num_prompt_tokens) == (3, 4)
    # Without its chat template the question's most likely continuation is the end-of-sequence token.
    assert parity_references[1].tokens == [2]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs["eos"]] == [([2], FinishReason.STOP)]


def test_abort_frees_blocks_at_once(default_model_dir, parity_prompts):
    engine = make_engine(default_model_dir)
    engine.add_request("a", parity_prompts[2], GREEDY)
    engine.step()
    assert engine.blocks.num_referenced_blocks == ceil_div(len(parity_prompts[2]), 16)
    assert engine.abort("a")
    assert engine.blocks.num_referenced_blocks == 0
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        engine.add_request("b", [], GREEDY)


def test_admit_refused_by_the_engine_returns_the_reserved_blocks(default_model_dir, parity_prompts):
    engine = make_engine(default_model_dir)
    handoff = KvHandoff(engine)
    prompt = parity_prompts[2]
    handoff.reserve("r", len(prompt) + 1)
    assert engine.blocks.num_referenced_blocks == ceil_div(len(prompt) + 1, 16)
    with pytest.raises(ValueError, match="names LoRA adapter 'nope' but this engine serves no adapters"):
        handoff.admit("r", prompt, [7], GREEDY, seed=7, lora="nope")
    assert_no_referenced_blocks(engine)
    assert handoff.reservation("r") is None
    assert not engine.has_request("r")
