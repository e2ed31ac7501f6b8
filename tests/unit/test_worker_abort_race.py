"""An abort racing a handler on a real worker runtime (a model-free simulated engine, no scheduler):
the abort ran before the handler tracked its request, but its engine call landed after the
handler's request got into the engine. The handler must still hear of the abort (a prefill worker's
Prefill call hung to its deadline: tests/integration/test_workers.py's early abort, 1 run in 3)."""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path

from services.common.sampling_params import SamplingParams
from services.prefill.main import SPEC
from services.worker.events import TrackedRequest
from services.worker.main_common import add_arguments, start_runtime, worker_config
from services.worker.sim_engine import SimTiming
from services.worker.transport import ChannelPool
from tandem.cli.sim_worker import SimConfig, engine_factory


async def test_an_abort_whose_engine_drop_lands_after_the_request_still_ends_its_handlers_wait(
        default_model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, SPEC)
    flags = ["--insecure-internal", "--scheduler", "none", "--model", str(default_model_dir)]
    config = worker_config(parser.parse_args(flags), SPEC)
    sim = SimConfig(count=1, kv_blocks=64, max_seqs=8, timing=SimTiming(step_ms=1.0))
    runtime = await start_runtime(config, SPEC, asyncio.get_running_loop().create_future(), "127.0.0.1:1",
                                  ChannelPool(), engine_factory(sim))
    entered, release = threading.Event(), threading.Event()
    try:
        async with runtime.serving("") as served:
            # The engine thread waits at a gate, so the handler's request and the abort's drop reach
            # it in one round (pending calls, then a step): no step can make the first output between.
            gate = asyncio.ensure_future(served.loop.call(lambda engine: entered.set() or release.wait(30)))
            assert await asyncio.to_thread(entered.wait, 30)
            aborting = asyncio.create_task(runtime.abort(["r"]))
            await asyncio.sleep(0)  # the abort ran up to its engine call, which goes out on the next turn
            assert not aborting.done()
            # Open the gate once that call went out (a callback scheduled now runs after it).
            asyncio.get_running_loop().call_soon(release.set)
            # This turn, before that call: the handler tracks the request and gets it into the engine.
            runtime.track(TrackedRequest("r", 3, logprobs=False), awaited=True, hands_on=True)
            await served.loop.call(lambda engine: engine.add_request(
                "r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), stop_after_prefill=True))
            assert await gate
        assert await aborting == ["r"]  # the engine held it, and dropped it
        assert await asyncio.wait_for(runtime.first_output("r"), 30) is None
        assert runtime.was_aborted("r")
        runtime.forget("r")
    finally:
        await runtime.stop(0)
