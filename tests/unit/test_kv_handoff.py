"""The KV hand-off's prefix reuse on the decode side: a reservation takes the prompt's leading
blocks from the decode worker's prefix cache, the prefill side ships only the blocks after them,
and the request continues the same tokens; a chunk aimed at a reused block is refused."""

from __future__ import annotations

import pytest

from services.common.model_config import ModelConfig
from services.runtime.block_manager import NoFreeBlocksError
from services.runtime.engine import EngineConfig
from services.runtime.kv_handoff import KvHandoff, LayerStream, PromptKey
from services.runtime.kv_transfer import KvChunk
from services.runtime.sampler import SamplingParams
from services.worker.sim_engine import SimEngine, SimTiming, sim_token

VOCAB = 1000
BLOCK = 16
FIRST_TURN = list(range(10, 50))  # 40 tokens: 2 full blocks


def engine(num_blocks: int = 32) -> SimEngine:
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": 2,
    })
    return SimEngine(config, EngineConfig(num_kv_blocks=num_blocks, block_size=BLOCK), SimTiming(step_ms=0.0))


def expected(prompt: list[int], count: int) -> list[int]:
    tokens, previous = [], prompt[-1]
    for position in range(len(prompt), len(prompt) + count):
        previous = sim_token(previous, position, VOCAB)
        tokens.append(previous)
    return tokens


def second_turn() -> list[int]:
    """The first turn, its 7 output tokens and a new question: 40 + 7 + 23 = 70 tokens, 5 blocks."""
    return FIRST_TURN + expected(FIRST_TURN, 7) + list(range(100, 123))


def served_first_turn() -> SimEngine:
    decode = engine()
    decode.generate([FIRST_TURN], SamplingParams(max_tokens=8))  # KV of 47 tokens: 2 full blocks cached
    assert decode.blocks.num_cached_blocks == 2
    return decode


def prefilled(prompt: list[int], params: SamplingParams) -> tuple[SimEngine, list[int]]:
    prefill = engine()
    prefill.add_request("r", prompt, params, stop_after_prefill=True)
    first = [t for _ in range(10) for out in prefill.step() for t in out.new_token_ids]
    return prefill, first


def test_a_reservation_reuses_the_cached_prefix_and_only_the_rest_is_shipped() -> None:
    decode, prompt, params = served_first_turn(), second_turn(), SamplingParams(max_tokens=5)
    receiving = KvHandoff(decode)
    reservation = receiving.reserve("r", len(prompt) + 1, PromptKey(prompt))
    assert reservation.reused_blocks == 2 and len(reservation.block_ids) == 5
    assert [decode.blocks.ref_count(b) for b in reservation.block_ids[:2]] == [1, 1]
    assert decode.blocks.num_cached_blocks == 0  # the hits left the evictable pool

    prefill, first = prefilled(prompt, params)
    exported = KvHandoff(prefill).export("r", 1 << 20, skip_blocks=2)
    chunks = list(exported.chunks)
    assert (exported.num_blocks, exported.num_chunks, exported.skipped_blocks) == (3, 1, 2)  # one layer
    assert [(c.layer, c.first_block, c.num_blocks) for c in chunks] == [(0, 2, 3)]
    for chunk in chunks:
        assert receiving.import_chunk(reservation, chunk)
    receiving.admit("r", prompt, first, params, seed=0)
    rest = [t for _ in range(4) for out in decode.step() for t in out.new_token_ids]
    assert first + rest == expected(prompt, 5)
    assert decode.blocks.num_referenced_blocks == 0 and not decode.has_unfinished()


def test_the_shipped_blocks_alone_are_counted_as_sent() -> None:
    prompt = second_turn()
    prefill, _ = prefilled(prompt, SamplingParams(max_tokens=5))
    handoff = KvHandoff(prefill)
    list(handoff.export("r", 1 << 20, skip_blocks=2).chunks)
    handoff.release_export("r")
    assert prefill.counters.kv_bytes_sent == 3 * prefill.cache.block_bytes
    assert prefill.blocks.num_referenced_blocks == 0


def test_a_chunk_into_a_reused_block_is_refused_and_writes_nothing() -> None:
    decode, prompt = served_first_turn(), second_turn()
    receiving = KvHandoff(decode)
    reservation = receiving.reserve("r", len(prompt) + 1, PromptKey(prompt))
    shape = (2, 1, *decode.cache.block_shape)
    chunk = KvChunk(0, 1, 1, "float32", shape, b"\1" * (decode.cache.layer_block_bytes))
    with pytest.raises(ValueError, match="KV chunk starts at block 1, but this worker reused the first 2 blocks "
                                         "from its prefix cache; ship blocks from 2 on"):
        receiving.import_chunk(reservation, chunk)
    assert reservation.received_bytes == 0 and not decode.cache.k[0, reservation.block_ids[1]].any()


@pytest.mark.parametrize("key, reused", [
    (PromptKey(second_turn(), salt="tenant-b"), 0),  # another tenant's chain
    (PromptKey(second_turn(), lora="adapter"), 0),  # another adapter's chain
    (PromptKey(FIRST_TURN[:32] + [999]), 2),
    (PromptKey(FIRST_TURN[:32]), 1),  # the block of the last prompt token is always shipped
    (PromptKey(FIRST_TURN[:16] + [999] * 40), 1),  # the cached run ends where the tokens differ
])
def test_only_the_same_chain_is_reused_and_never_the_last_prompt_block(key: PromptKey, reused: int) -> None:
    reservation = KvHandoff(served_first_turn()).reserve("r", len(key.token_ids) + 1, key)
    assert reservation.reused_blocks == reused


def test_a_reservation_without_room_holds_nothing() -> None:
    decode = served_first_turn()
    decode.blocks.allocate(decode.blocks.num_free_blocks - 2)  # only the 2 cached blocks stay available
    with pytest.raises(NoFreeBlocksError):
        KvHandoff(decode).reserve("r", len(second_turn()) + 1, PromptKey(second_turn()))
    assert decode.blocks.num_cached_blocks == 2 and decode.blocks.num_free_blocks == 2


def test_skipping_every_block_is_refused_and_the_blocks_still_come_back() -> None:
    prefill, _ = prefilled(FIRST_TURN, SamplingParams(max_tokens=5))
    handoff = KvHandoff(prefill)
    with pytest.raises(ValueError, match="cannot skip 3 of the request's 3 KV blocks; the receiver may hold at most 2"):
        handoff.export("r", 1 << 20, skip_blocks=3)
    assert handoff.free("r") and prefill.blocks.num_referenced_blocks == 0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tests.unit.test_model_tiny import make_tiny

    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama", directory)
    return directory


def tiny_engine(model_dir):
    from services.runtime.attention import TorchAttention
    from services.runtime.engine import Engine
    from services.runtime.model import CausalLM

    config = EngineConfig(block_size=4, num_kv_blocks=32, chunk_size=8, max_num_batched_tokens=8)
    return Engine(CausalLM.from_model_dir(model_dir, TorchAttention()), config)


def prefill_to_first_token(prefill, prompt: list[int]) -> list[int]:
    prefill.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0), stop_after_prefill=True)
    return [t for _ in range(10) for out in prefill.step() for t in out.new_token_ids]


def test_layers_streamed_during_the_last_prompt_chunk_are_the_bytes_an_export_gathers(tiny_model_dir) -> None:
    from tests.unit.test_model_tiny import PROMPT

    prompt = PROMPT[:18]  # 5 blocks of 4, prefilled in chunks of 8: the last chunk completes it
    exporting, streaming = tiny_engine(tiny_model_dir), tiny_engine(tiny_model_dir)
    layers = exporting.cache.num_layers
    exported = memoryview(bytearray(3 * exporting.cache.block_bytes))
    first = prefill_to_first_token(exporting, prompt)
    (chunk,) = KvHandoff(exporting).export("r", 1 << 20, skip_blocks=2, into=exported).chunks
    assert (chunk.layer, chunk.num_layers, chunk.first_block, chunk.num_blocks) == (0, layers, 2, 3)

    handoff, streamed, seen = KvHandoff(streaming), memoryview(bytearray(len(exported))), []
    streaming.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0), stop_after_prefill=True)
    handoff.stream_layers("r", LayerStream(2, streamed, seen.append))
    steps = []
    while not (outputs := streaming.step()):
        steps.append(list(seen))
    assert steps == [[], []]  # the chunks before the last gather nothing
    assert seen == list(range(1, layers + 1)) and [t for out in outputs for t in out.new_token_ids] == first
    assert streaming.runner.after_layer is not None
    assert handoff.hold_streamed("r", skip_blocks=2) == 3
    assert streaming.runner.after_layer is None  # no stream left: the forward pass calls nothing
    assert bytes(streamed) == bytes(exported)
    handoff.release_export("r")
    assert streaming.blocks.num_referenced_blocks == 0


def test_a_stream_stopped_midway_gathers_no_later_layer(tiny_model_dir) -> None:
    from tests.unit.test_model_tiny import PROMPT

    engine_, seen = tiny_engine(tiny_model_dir), []
    handoff = KvHandoff(engine_)
    streamed = memoryview(bytearray(b"\xff" * (2 * engine_.cache.block_bytes)))

    def stop_after_the_first(count: int) -> None:
        seen.append(count)
        handoff.stop_stream("r")  # as an abort does, on the engine thread, between two layers

    engine_.add_request("r", PROMPT[:8], SamplingParams(max_tokens=4, temperature=0.0), stop_after_prefill=True)
    handoff.stream_layers("r", LayerStream(0, streamed, stop_after_the_first))
    assert engine_.step()
    layer_bytes = 2 * engine_.cache.layer_block_bytes
    assert seen == [1] and bytes(streamed[layer_bytes:]) == b"\xff" * (len(streamed) - layer_bytes)
    assert engine_.runner.after_layer is None


def test_a_stream_whose_buffer_is_gone_fails_alone_and_the_engine_steps_on(tiny_model_dir) -> None:
    from tests.unit.test_model_tiny import PROMPT

    engine_, seen = tiny_engine(tiny_model_dir), []
    handoff = KvHandoff(engine_)
    streamed = memoryview(bytearray(2 * engine_.cache.block_bytes))
    engine_.add_request("r", PROMPT[:8], SamplingParams(max_tokens=4, temperature=0.0), stop_after_prefill=True)
    handoff.stream_layers("r", LayerStream(0, streamed, seen.append))
    streamed.release()  # as a sender that let its segment go too early
    (output,) = engine_.step()
    assert output.request_id == "r" and seen == [] and engine_.runner.after_layer is None
