"""The gateway's request pipeline, shared by the gRPC door and the HTTP bridge: validate (the
request limits), tokenize (off the event loop), submit to the scheduler with the deadline and
trace context, read the tokens from the workers it placed the request on, and turn them into chunks.

A `Generation` is one request in flight: one attempt (attempt.py) at a time, the next one the
continuation the scheduler places after the worker generating it was lost (the tokens delivered
so far go with it; the relay goes on at the same offset), or after its scheduler was lost before
the worker started it (the next scheduler places the continuation). A Submit call whose stream to
its scheduler broke, or could not connect, before the request was placed goes to the next one
(upstream.py), round after round until the deadline (as a continuation with nothing delivered
when the stream had connected: the lost scheduler may have launched it, and its workers must not
meet the same attempt id twice); a scheduler's own answer is final. Leaving its iteration
early, or `close()`, cancels the attempt's calls, which aborts the request on whichever worker
holds it. Its failures reach the client as client_errors words them; the upstream's own message
goes to the log and the span.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from services.common.errors import DeadlineExceeded, TandemError, Unavailable, error_from_rpc
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.lora_catalogue import split_model
from services.common.metrics import ServiceMetrics
from services.common.spans import gateway_span_name
from services.common.tokenizer import TextCodec
from services.common.tracing import Attr, TokenTimings, inject_metadata
from services.common.wire import sampling_to_proto
from services.gateway.attempt import Attempt
from services.gateway import telemetry
from services.gateway.client_errors import for_client
from services.gateway.limits import RequestLimits
from services.gateway.models import GatewayModels, LoadedModel, ModelEntry, read_residency
from services.gateway.output import Chunk, OutputAssembler, OutputOptions
from services.gateway.prompt_encoder import DEFAULT_THREADS, PromptEncoder
from services.gateway.relay import Interrupted, Relay, restate_usage
from services.gateway.upstream import Upstream
from services.gateway.request import GenerationRequest, ServedModel, new_request_id
from services.gateway.validation import check_prompt_length, validate_request
from tandem.v1 import common_pb2, scheduler_pb2

log = logging.getLogger(__name__)

_RETRY_START_S = 0.1  # no scheduler could be reached before placement: first pause before the next round
_RETRY_MAX_S = 1.0
# Stop submitting again while this much of the deadline is left, so the client hears UNAVAILABLE
# (retryable, with the reason) rather than its own DEADLINE_EXCEEDED on a loaded machine.
_ANSWER_RESERVE_S = 0.5
_SETTLE_S = 2.0  # the longest the end of a finished request waits for the scheduler to count it


class Generation:
    """One request in flight: its ids at once, its chunks by iterating (once).

    The last chunk has a finish reason. Failures raise TandemError with the upstream status kept
    (RESOURCE_EXHAUSTED and UNAVAILABLE with their retry hint, DEADLINE_EXCEEDED, ...) and the
    client's message of client_errors.
    """

    def __init__(
        self,
        request_id: str,
        trace_id: str,
        prompt_token_ids: list[int],
        upstream: Upstream,
        submit: scheduler_pb2.SubmitRequest,
        metadata: tuple[tuple[str, str], ...],
        deadline: float,
        assembler: OutputAssembler,
        span: trace.Span,
        timings: TokenTimings,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.request_id = request_id
        self.trace_id = trace_id
        self.prompt_token_ids = prompt_token_ids
        self._upstream = upstream
        self._submit = submit
        self._metadata = metadata
        self._deadline = deadline  # time.monotonic()
        self._assembler = assembler
        self._span = span
        self._metrics = metrics
        self._relay = Relay(request_id)
        self._turn = upstream.first_turn(submit)  # the scheduler it goes to, and its continuations
        self._attempt: Attempt | None = None
        self._timings = timings
        self._closed = False
        self._finished = False  # a finish reason arrived
        self._error_recorded = False
        self._scheduler_unreached = False  # the request failed because its last round of Submits reached none

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        try:
            async for event in self._events():
                chunk = self._assembler.on_event(event)
                if chunk is None:
                    continue
                self._record(chunk)
                yield chunk
                if chunk.stop_string is not None:
                    return  # cancels the request upstream at once
                if self._assembler.finished:
                    await self._settled()
                    return
        except grpc.aio.AioRpcError as exc:
            raise self._failed(error_from_rpc(exc)) from None
        except TandemError as exc:
            raise self._failed(exc) from None
        finally:
            self.close()

    async def _events(self) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        """The request's events in output order, across the attempts its lost workers make it take."""
        while True:
            self._attempt = await self._place()
            try:
                async for event in self._relay.events(self._remaining):
                    yield self._restated(event)
                return
            except Interrupted:
                self._attempt.close()
                if self._attempt.scheduler_lost:
                    self._turn += 1  # the continuation goes to the next scheduler
                self._submit.migration += 1
                self._submit.delivered_token_ids[:] = self._relay.tokens
                self._submit.sampling.seed = self._attempt.placement.seed

    async def _place(self) -> Attempt:
        """Submit the request (to the next scheduler while one cannot be reached, pausing after each
        round) and start reading its workers' streams once the scheduler says where it runs."""
        backoff, unreached = _RETRY_START_S, 0
        while True:
            scheduler = self._upstream.scheduler(self._turn)
            call = scheduler.submit(self._submit, timeout=self._remaining(), metadata=self._metadata)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not call.broke:
                    raise  # the scheduler's own answer
                if call.reached:  # it may have been launched before its placement came: a new attempt id
                    self._submit.migration += 1
                unreached += 1
                self._turn += 1
                if unreached % self._upstream.num_schedulers:
                    continue
                if self._remaining() <= backoff + _ANSWER_RESERVE_S:
                    self._scheduler_unreached = True
                    raise
                log.info("request %s: no scheduler can be reached (%s); submitting again in %.1f s",
                         self.request_id, exc.details(), backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, _RETRY_MAX_S)
                continue
            if first is grpc.aio.EOF or not first.HasField("placement"):
                call.cancel()
                raise Unavailable(f"the scheduler ended request {self.request_id}'s call before placing it")
            attempt = Attempt(call, first.placement, self._relay)
            attempt.start(lambda address, request: self._upstream.stream(address, request, self._metadata))
            return attempt

    async def _settled(self) -> None:
        """The request finished: let the scheduler count it before the gateway's span ends (the
        client already has its last chunk), so its spans and stats close inside the gateway's."""
        if self._attempt is not None:
            await self._attempt.settled(min(_SETTLE_S, max(0.0, self._deadline - time.monotonic())))

    def _remaining(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id}: its deadline passed after "
                                   f"{self._relay.next_offset} token(s)")
        return left

    def _restated(self, event: scheduler_pb2.TokenEvent) -> scheduler_pb2.TokenEvent:
        """The final event with the usage and timings the client gets."""
        if event.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            return event
        if self._relay.base:
            restate_usage(event.usage, len(self.prompt_token_ids), event.output_offset + len(event.token_ids))
        if self._attempt is not None:
            event.timings.queue_ms = self._attempt.placement.queue_ms
        if self._timings.ttft_s is not None:
            event.timings.time_to_first_token_ms = self._timings.ttft_s * 1000
        event.timings.total_ms = (time.time_ns() - self._timings.start_ns) / 1e6
        return event

    def close(self) -> None:
        """Cancel the upstream request (a no-op once it finished) and end the span; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._attempt is not None:
            self._attempt.close()
        if not self._finished:
            telemetry.record_abandoned(self._span, self._metrics, len(self.prompt_token_ids), self._timings.num_tokens,
                                       self._elapsed_s(), failed=self._error_recorded)
        self._timings.annotate(self._span)
        self._span.end()

    def _record(self, chunk: Chunk) -> None:
        if chunk.token_ids:
            gap = self._timings.record(len(chunk.token_ids))
            if self._metrics is not None:
                if gap is None:
                    self._metrics.time_to_first_token.observe(self._timings.ttft_s or 0.0)
                else:
                    self._metrics.inter_token_latency.observe(gap)
        if chunk.finish_reason is not None and chunk.usage is not None:
            self._finished = True
            telemetry.record_finished(self._span, self._metrics, self.request_id, chunk.finish_reason, chunk.usage,
                                      self._elapsed_s())

    def _elapsed_s(self) -> float:
        return (time.time_ns() - self._timings.start_ns) / 1e9

    def _failed(self, error: TandemError) -> TandemError:
        """The client's error for an upstream failure; the upstream's words go to the log and span."""
        detail = f"{type(error).__name__}: {error.message}"
        log.info("request %s failed: %s", self.request_id, detail)  # info: a full queue refuses many at once
        telemetry.record_failed(self._span, error, detail)
        self._error_recorded = True
        return for_client(error, self.request_id, self._scheduler_unreached)


class GenerationPipeline:
    """Starts generations for the gateway's models (`models`; `codec` and `model` are its primary
    one's) against its schedulers and their workers.

    `start` does all validation and tokenization before anything goes upstream; the Submit call
    begins when the returned Generation is first iterated. `close()` when done with it.
    """

    def __init__(
        self,
        codec: TextCodec,
        model: ServedModel,
        upstream: grpc.aio.Channel | Upstream,
        internal_token: str | None = None,
        tracer: trace.Tracer | None = None,
        metrics: ServiceMetrics | None = None,
        limits: RequestLimits = RequestLimits(),
        tokenizer_threads: int = DEFAULT_THREADS,
        models: GatewayModels | None = None,
    ) -> None:
        self.codec = codec
        self.model = model
        self.models = models or GatewayModels(LoadedModel(model, codec))
        self.limits = limits
        self._encoder = PromptEncoder(tokenizer_threads)
        self._upstream = upstream if isinstance(upstream, Upstream) else Upstream([upstream])
        self._internal_token = internal_token
        self._tracer = tracer or trace.get_tracer(__name__)
        self._metrics = metrics

    def close(self) -> None:
        """Stop the tokenizer threads (requests still being tokenized finish first)."""
        self._encoder.close()

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids as `start` would submit them (validated as there). InvalidRequest or NotFound."""
        loaded = await self.models.for_request(request.model)
        field = validate_request(request, loaded.model, self.limits)
        return await self._encoder.encode(request, field, loaded.codec)

    async def model_entries(self) -> list[ModelEntry]:
        """Every model and adapter the gateway serves, with how many workers hold each loaded now."""
        return await self.models.entries(await read_residency(self._upstream, self._internal_metadata()))

    async def model_entry(self, served_name: str) -> ModelEntry:
        """One of `model_entries()`; NotFound naming the served ones for any other name."""
        await self.models.for_request(served_name)  # an unknown name fails before asking the scheduler
        return await self.models.entry(served_name, await read_residency(self._upstream, self._internal_metadata()))

    async def start(self, request: GenerationRequest, timeout: float) -> Generation:
        """Validate, tokenize and open the request's span. Raises InvalidRequest or NotFound."""
        loaded = await self.models.for_request(request.model)
        model = loaded.model
        field = validate_request(request, model, self.limits)
        prompt_token_ids = await self._encoder.encode(request, field, loaded.codec)
        if request.max_tokens_to_context:
            room = max(1, model.max_model_len - len(prompt_token_ids))
            request.sampling = dataclasses.replace(request.sampling, max_tokens=room)
        check_prompt_length(field, len(prompt_token_ids), request.sampling.max_tokens, model)
        request_id = request.request_id or new_request_id()
        timings = TokenTimings()  # TTFT and latencies count from the span's start
        attributes = self._span_attributes(request, request_id, model.name)
        name = gateway_span_name(str(attributes[Attr.GEN_AI_OPERATION_NAME]), model.name)
        span = self._tracer.start_span(name, kind=trace.SpanKind.SERVER, start_time=timings.start_ns,
                                       attributes=attributes)
        trace_id = format(span.get_span_context().trace_id, "032x")
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            model=model.name,
            token_ids=prompt_token_ids,
            sampling=sampling_to_proto(request.sampling),
            cache_salt=request.cache_salt,
            lora=split_model(request.model)[1],
            deadline_unix_ms=int((time.time() + timeout) * 1000),
            trace_id=trace_id,
        )
        metadata = self._metadata(span)
        options = OutputOptions(request.sampling, request.stop, request.include_stop_str_in_output,
                                request.skip_special_tokens, request.prompt_only)
        return Generation(
            request_id, trace_id, prompt_token_ids, self._upstream, submit, metadata, time.monotonic() + timeout,
            OutputAssembler(loaded.codec, options, prompt_token_ids),
            span,
            timings,
            self._metrics,
        )

    def _metadata(self, span: trace.Span) -> tuple[tuple[str, str], ...]:
        return (*inject_metadata(trace.set_span_in_context(span)), *self._internal_metadata())

    def _internal_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((INTERNAL_TOKEN_KEY, self._internal_token),) if self._internal_token else ()

    def _span_attributes(self, request: GenerationRequest, request_id: str,
                         model: str) -> dict[str, str | int | float]:
        sampling = request.sampling
        attributes: dict[str, str | int | float] = {
            Attr.REQUEST_ID: request_id,
            **telemetry.start_attributes(model, request.served_at),
            Attr.GEN_AI_OPERATION_NAME: "chat" if request.messages is not None else "text_completion",
            Attr.GEN_AI_REQUEST_MODEL: model,
            Attr.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_tokens,
            Attr.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            Attr.GEN_AI_REQUEST_TOP_P: sampling.top_p,
            Attr.GEN_AI_REQUEST_TOP_K: sampling.top_k,
        }
        if sampling.seed is not None:
            attributes[Attr.GEN_AI_REQUEST_SEED] = sampling.seed
        return attributes
