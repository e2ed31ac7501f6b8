"""A request's first token event carries the engine's prompt logprobs on its token stream; the
scheduler's report of that event does not."""

from __future__ import annotations

from services.runtime.engine import RequestOutput
from services.runtime.sampler import SampledToken
from services.worker.engine_loop import StepResult
from services.worker.events import TokenBatcher, TrackedRequest


def test_the_first_event_carries_the_prompt_logprobs_and_the_report_does_not():
    batcher = TokenBatcher("w-1")
    batcher.track(TrackedRequest("r", num_prompt_tokens=3, logprobs=False))
    prompt = [SampledToken(6, -1.25, [(8, -0.75)]), SampledToken(7, -2.0)]
    output = RequestOutput("r", [9], [SampledToken(9, -0.5)], None, 3, 0, 1, prompt)
    step = StepResult([output], batch_size=1, iteration=1, started_ns=0, ended_ns=1, work={},
                      running_ids=frozenset({"r"}), stored=[], evicted=[], snapshot=None)
    events = batcher.batch(step)
    (event,) = events.events
    assert [(e.token_id, e.logprob) for e in event.prompt_logprobs] == [(6, -1.25), (7, -2.0)]
    assert [(t.token_id, t.logprob) for t in event.prompt_logprobs[0].top_logprobs] == [(8, -0.75)]
    assert not event.logprobs  # the output's own logprobs were not asked for
    (reported,) = events.report.events
    assert not reported.prompt_logprobs and list(reported.token_ids) == [9]
