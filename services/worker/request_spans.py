"""The spans a worker records for the requests it runs: a request span each, a child span per
iteration while the request prefills, and the decode phase summed up on the request span
(iterations, preemptions, finish reason, token timings), never a span per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context

from services.common.tracing import Attr, Event, SpanName, TokenTimings
from services.runtime.engine import IterationWork, RequestOutput
from services.worker.engine_loop import StepResult
from services.worker.events import is_final

tracer = trace.get_tracer("tandem.worker")


def trace_iteration(parent: trace.Span, step: StepResult, work: IterationWork) -> None:
    """One engine iteration (prompt chunk) of a request, as a child of its request span timed by the step."""
    span = tracer.start_span(SpanName.PREFILL_ITERATION, context=trace.set_span_in_context(parent),
                             start_time=step.started_ns, attributes={
                                 Attr.PREFILL_TOKENS_COMPUTED: work.num_new_tokens,
                                 Attr.PREFILL_TOKENS_CACHED: work.num_cached_tokens,
                                 Attr.BATCH_SIZE: step.batch_size,
                                 Attr.BATCH_TOKENS: sum(w.num_new_tokens for w in step.work.values()),
                             })
    span.end(end_time=step.ended_ns)


@dataclass(slots=True)
class RequestSpan:
    """A request's span on this worker, and what it sums up when the request ends.

    While `prefilling` (until its first token) each iteration of the request is a child span; after
    it the iterations are counted. Preemptions are counted in either phase.
    """

    span: trace.Span
    timings: TokenTimings
    prefilling: bool
    iterations: int = 0
    preemptions: int = 0

    def note_iteration(self, step: StepResult, work: IterationWork) -> None:
        if work.num_preemptions > self.preemptions:  # recomputing after a preemption
            self.span.add_event(Event.PREEMPTED, timestamp=step.started_ns)
            self.preemptions = work.num_preemptions
        if self.prefilling:
            trace_iteration(self.span, step, work)
        else:
            self.iterations += 1

    def note_output(self, output: RequestOutput, now_ns: int) -> None:
        if self.prefilling:  # its first token: the prompt is done
            self.prefilling = False
            self.span.set_attributes({
                Attr.PREFILL_TOKENS_COMPUTED: output.num_prompt_tokens - output.num_cached_tokens,
                Attr.PREFILL_TOKENS_CACHED: output.num_cached_tokens,
            })
        self.timings.record(len(output.new_token_ids), now_ns)

    def end(self, finish_reason: str, output: RequestOutput | None) -> None:
        """`output` is the request's last, None when it ended without one (aborted)."""
        span = self.span
        span.set_attributes({Attr.GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason],
                             Attr.DECODE_ITERATIONS: self.iterations, Attr.DECODE_PREEMPTIONS: self.preemptions})
        if output is not None:
            span.set_attributes({Attr.GEN_AI_USAGE_INPUT_TOKENS: output.num_prompt_tokens,
                                 Attr.GEN_AI_USAGE_OUTPUT_TOKENS: output.num_output_tokens})
        self.timings.annotate(span)
        span.end()


class RequestSpans:
    """The open request spans of a worker. Call order: start(...) before the request enters the
    engine -> on_step(step) after every engine step (a request's final output ends its span) ->
    end(request_id, reason) when it leaves otherwise (aborted); ending an unknown id does nothing.

    `follow(request_id, span)` takes a span its caller owns and ends (the Prefill call's) instead:
    the request's iterations become its children and its first token an event on it."""

    def __init__(self) -> None:
        self._open: dict[str, RequestSpan] = {}
        self._followed: dict[str, trace.Span] = {}
        self.policy_attributes: dict[str, int] = {}  # the batching policy the scheduler set, on every span

    def start(self, name: str, request_id: str, parent: Context, *, prefilling: bool) -> None:
        """`parent`: the remote context of the call that brought the request (the scheduler's span)."""
        start_ns = time.time_ns()
        attributes = {Attr.REQUEST_ID: request_id, **self.policy_attributes}
        span = tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
        self._open[request_id] = RequestSpan(span, TokenTimings(start_ns=start_ns), prefilling)

    def follow(self, request_id: str, span: trace.Span) -> None:
        self._followed[request_id] = span

    def on_step(self, step: StepResult) -> None:
        for rid, work in step.work.items():
            if (request := self._open.get(rid)) is not None:
                request.note_iteration(step, work)
            elif (followed := self._followed.get(rid)) is not None:
                trace_iteration(followed, step, work)
        for output in step.outputs:
            if (followed := self._followed.pop(output.request_id, None)) is not None:
                followed.add_event(Event.FIRST_TOKEN, timestamp=step.ended_ns)
            if (request := self._open.get(output.request_id)) is not None:
                request.note_output(output, step.ended_ns)
                if is_final(output.finish_reason):
                    self.end(output.request_id, output.finish_reason.value, output)

    def end(self, request_id: str, finish_reason: str, output: RequestOutput | None = None) -> None:
        self._followed.pop(request_id, None)
        request = self._open.pop(request_id, None)
        if request is not None:
            request.end(finish_reason, output)
