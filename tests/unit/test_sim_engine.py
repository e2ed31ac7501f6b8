"""The simulated engine: the real Engine's blocks, prefix cache and KV hand-off, with tokens that are a
fixed function of the history, so a hand-off between workers continues the same sequence."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.model_config import ModelConfig
from services.runtime.engine import EngineConfig
from services.runtime.kv_handoff import KvHandoff
from services.runtime.sampler import SamplingParams
from services.worker.sim_engine import SimEngine, SimTiming, sim_token

VOCAB = 1000
PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks of 16


def engine(num_blocks: int = 32) -> SimEngine:
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    })
    return SimEngine(config, EngineConfig(num_kv_blocks=num_blocks), SimTiming(step_ms=0.0))


def expected(prompt: list[int], count: int) -> list[int]:
    tokens, previous = [], prompt[-1]
    for position in range(len(prompt), len(prompt) + count):
        previous = sim_token(previous, position, VOCAB)
        tokens.append(previous)
    return tokens


def test_tokens_follow_the_history_and_stay_in_the_middle_of_the_vocabulary() -> None:
    assert sim_token(49, 40, VOCAB) == 250 + (49 * 7919 + 40 * 104729) % 500 == 441
    tokens = engine().generate([PROMPT, PROMPT], SamplingParams(max_tokens=6))
    assert tokens == [expected(PROMPT, 6)] * 2
    assert all(250 <= t < 750 for t in tokens[0])


def test_blocks_are_cached_after_a_request_and_hit_by_its_repeat() -> None:
    sim = engine()
    sim.generate([PROMPT], SamplingParams(max_tokens=7))
    assert (sim.blocks.num_cached_blocks, sim.blocks.num_referenced_blocks, sim.blocks.num_free_blocks) == (2, 0, 32)
    assert len(sim.blocks.drain_events()[0]) == 2  # the stored hashes a worker reports
    sim.generate([PROMPT], SamplingParams(max_tokens=1))
    assert (sim.counters.prefix_queried_tokens, sim.counters.prefix_hit_tokens) == (80, 32)


def test_a_handoff_from_prefill_to_decode_continues_the_same_tokens() -> None:
    prefill, decode = engine(), engine()
    params = SamplingParams(max_tokens=5)
    prefill.add_request("r", PROMPT, params, stop_after_prefill=True)
    first = prefill.step()[0].new_token_ids
    exported = KvHandoff(prefill).export("r", 1 << 20)
    receiving = KvHandoff(decode)
    reservation = receiving.reserve("r", len(PROMPT) + 1)
    for chunk in exported.chunks:
        assert receiving.import_chunk(reservation, chunk)
    receiving.admit("r", PROMPT, first, params, seed=0)
    rest = [t for _ in range(4) for out in decode.step() for t in out.new_token_ids]
    assert first + rest == expected(PROMPT, 5)
    assert decode.blocks.num_referenced_blocks == 0 and not decode.has_unfinished()


def test_timing_refuses_negative_values() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        SimTiming(step_ms=-1.0)


def test_the_model_directory_gives_only_the_shapes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "rms_norm_eps": 1e-5, '
        '"max_position_embeddings": 256}')
    sim = SimEngine.for_model_dir(tmp_path, 8, SimTiming(step_ms=0.0))
    assert (sim.blocks.num_blocks, sim.max_model_len, sim.cache.num_layers, sim.cache.block_bytes) == (8, 256, 1, 128)
