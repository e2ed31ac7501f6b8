"""EngineLoop on a tiny model: calls run in the engine thread at iteration boundaries, each step's
outputs reach the asyncio loop, and the tokens are the ones the engine produces on its own."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.common.block_hash import hash_chain
from services.runtime.counters import EngineCounters
from services.runtime.engine import Engine, EngineConfig, IterationWork
from services.runtime.sampler import SamplingParams
from services.worker.engine_loop import EngineLoop, StepResult
from tests.unit.test_model_tiny import PROMPT, make_tiny
from tests.waiting import eventually

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(block_size=4, num_kv_blocks=32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("tiny-llama")
    make_tiny("llama", directory)
    return directory


async def test_calls_run_in_the_engine_thread_and_steps_reach_the_loop(model_dir):
    engine = Engine.from_model_dir(model_dir, CONFIG)
    expected = Engine.from_model_dir(model_dir, CONFIG).generate([PROMPT, PROMPT[:7]], GREEDY)
    steps: list[StepResult] = []
    done = asyncio.Event()

    def on_step(step: StepResult) -> None:
        steps.append(step)
        if any(o.finish_reason for o in step.outputs) and not engine.has_unfinished():
            done.set()

    loop = EngineLoop(engine, on_step)
    loop.start()
    assert await loop.call(lambda e: threading.current_thread().name) == "engine"
    # Both in one call: a second call could land after "a" ran all its steps (a loaded event loop), and
    # "a" alone finishing would end the wait before "b" ran at all.
    await loop.call(lambda e: (e.add_request("a", PROMPT, GREEDY), e.add_request("b", PROMPT[:7], GREEDY)))
    await asyncio.wait_for(done.wait(), 30)

    tokens = {"a": [], "b": []}
    for step in steps:
        for output in step.outputs:
            tokens[output.request_id].extend(output.new_token_ids)
    assert [tokens["a"], tokens["b"]] == expected
    assert [s.iteration for s in steps] == sorted({s.iteration for s in steps})
    assert max(s.batch_size for s in steps) == 2
    stored = {h for s in steps for h in s.stored}
    assert set(hash_chain(PROMPT, 4)) <= stored
    assert loop.snapshot.referenced_blocks == 0 and loop.snapshot.running == 0
    counters = loop.snapshot.counters
    assert counters.generated_tokens == 12 and counters.max_batch_size == 2
    assert counters.iterations == steps[-1].iteration and sum(counters.batch_sizes.values()) == counters.iterations
    await loop.stop()


def test_counters_grow_by_what_happened_since_a_copy():
    counters = EngineCounters(preemptions=2, prefix_hit_tokens=16)
    before = counters.copy()
    counters.record_batch(3)
    counters.record_batch(1)
    counters.preemptions += 1
    grown = counters.since(before)
    assert (grown.iterations, grown.preemptions, grown.prefix_hit_tokens) == (2, 1, 0)
    assert (grown.last_batch_size, grown.max_batch_size, grown.batch_sizes) == (1, 3, {3: 1, 1: 1})
    assert before.batch_sizes == {} and before.preemptions == 2


async def test_each_step_says_what_each_request_computed(model_dir):
    engine = Engine.from_model_dir(model_dir, EngineConfig(block_size=4, num_kv_blocks=32, chunk_size=8))
    steps: list[StepResult] = []
    loop = EngineLoop(engine, steps.append)
    loop.start()
    two_tokens = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    await loop.call(lambda e: e.add_request("cold", PROMPT, two_tokens))  # 19 tokens: chunks of 8, 8, 3
    await eventually(lambda: any(o.finish_reason for s in steps for o in s.outputs), "the cold request's end")
    await loop.call(lambda e: e.add_request("warm", PROMPT, two_tokens))  # 4 blocks of 4 tokens cached
    await eventually(lambda: sum(bool(o.finish_reason) for s in steps for o in s.outputs) == 2,
                     "the warm request's end")
    await loop.stop()
    stepped = [s for s in steps if s.work]
    # context: a chunk of n tokens from position c reads n*c + n(n+1)/2 KV entries
    assert [(s.work, s.batch_size) for s in stepped] == [
        ({"cold": IterationWork(8, 0, 0, 36)}, 1), ({"cold": IterationWork(8, 0, 0, 100)}, 1),
        ({"cold": IterationWork(3, 0, 0, 54)}, 1), ({"cold": IterationWork(1, 0, 0, 20)}, 1),
        ({"warm": IterationWork(3, 16, 0, 54)}, 1), ({"warm": IterationWork(1, 0, 0, 20)}, 1)]
    assert all(s.started_ns < s.ended_ns for s in stepped)
    assert all(s.batch_size == 0 and not s.outputs for s in steps if not s.work)


async def test_prompts_arriving_within_the_batching_window_prefill_in_one_step(model_dir):
    engine = Engine.from_model_dir(model_dir, CONFIG)
    steps: list[StepResult] = []
    loop = EngineLoop(engine, steps.append)
    loop.batch_window_s = 2.0  # far longer than two calls take, even on a loaded machine
    loop.start()
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first_call = asyncio.ensure_future(loop.call(lambda e: e.add_request("a", PROMPT, one_token)))
    await asyncio.sleep(0)  # the call is queued
    await eventually(lambda: not loop._calls, "the engine thread took the first call")  # without a window it steps now
    await asyncio.gather(first_call, loop.call(lambda e: e.add_request("b", PROMPT[:5], one_token)))
    await eventually(lambda: sum(bool(o.finish_reason) for s in steps for o in s.outputs) == 2, "both requests' ends")
    await loop.stop()
    first = next(s for s in steps if s.work)
    assert sorted(first.work) == ["a", "b"] and first.batch_size == 2


async def test_exceptions_reach_the_caller_and_a_stopped_loop_refuses_calls(model_dir):
    loop = EngineLoop(Engine.from_model_dir(model_dir, CONFIG), lambda step: None)
    loop.start()
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        await loop.call(lambda e: e.add_request("empty", [], GREEDY))
    await loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        await loop.call(lambda e: None)
