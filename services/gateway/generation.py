"""The gateway's request pipeline, shared by the gRPC door and the HTTP bridge: validate (the
request limits), tokenize (off the event loop), submit to the scheduler with the deadline and
trace context, relay the token events as chunks.

A `Generation` is one request in flight. Leaving its iteration early, or `close()`, cancels the
Submit call, which aborts the request on whichever worker holds it. Its failures reach the client
as client_errors words them; the upstream's own message goes to the log and the span.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from services.common.errors import TandemError, Unavailable, error_from_rpc
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.metrics import ServiceMetrics
from services.common.tokenizer import TextCodec
from services.common.tracing import Attr, SpanName, TokenTimings, inject_metadata
from services.common.wire import sampling_to_proto
from services.gateway import telemetry
from services.gateway.client_errors import for_client
from services.gateway.limits import RequestLimits
from services.gateway.output import Chunk, OutputAssembler, OutputOptions
from services.gateway.prompt_encoder import DEFAULT_THREADS, PromptEncoder
from services.gateway.request import GenerationRequest, ServedModel, new_request_id
from services.gateway.validation import check_prompt_length, validate_request
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)


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
        submit: Callable[[], grpc.aio.UnaryStreamCall],
        assembler: OutputAssembler,
        span: trace.Span,
        timings: TokenTimings,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.request_id = request_id
        self.trace_id = trace_id
        self.prompt_token_ids = prompt_token_ids
        self._submit = submit
        self._assembler = assembler
        self._span = span
        self._metrics = metrics
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._timings = timings
        self._closed = False
        self._finished = False  # a finish reason arrived
        self._error_recorded = False

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        try:
            self._call = self._submit()
            async for event in self._call:
                if self._assembler.finished:
                    continue  # read the stream to its end: the request completed upstream
                chunk = self._assembler.on_event(event)
                if chunk is None:
                    continue
                self._record(chunk)
                yield chunk
                if chunk.stop_string is not None:
                    return  # cancels the request upstream at once
            if not self._assembler.finished:
                raise Unavailable(f"the scheduler ended request {self.request_id}'s stream before it finished")
        except grpc.aio.AioRpcError as exc:
            raise self._failed(error_from_rpc(exc)) from None
        except TandemError as exc:
            raise self._failed(exc) from None
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the upstream request (a no-op once it finished) and end the span; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._call is not None:
            self._call.cancel()
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
        return for_client(error, self.request_id)


class GenerationPipeline:
    """Starts generations for one served model against one scheduler.

    `start` does all validation and tokenization before anything goes upstream; the Submit call
    begins when the returned Generation is first iterated. `close()` when done with it.
    """

    def __init__(
        self,
        codec: TextCodec,
        model: ServedModel,
        scheduler: scheduler_pb2_grpc.SchedulerServiceStub,
        internal_token: str | None = None,
        tracer: trace.Tracer | None = None,
        metrics: ServiceMetrics | None = None,
        limits: RequestLimits = RequestLimits(),
        tokenizer_threads: int = DEFAULT_THREADS,
    ) -> None:
        self.codec = codec
        self.model = model
        self.limits = limits
        self._encoder = PromptEncoder(codec, tokenizer_threads)
        self._scheduler = scheduler
        self._internal_token = internal_token
        self._tracer = tracer or trace.get_tracer(__name__)
        self._metrics = metrics

    def close(self) -> None:
        """Stop the tokenizer threads (requests still being tokenized finish first)."""
        self._encoder.close()

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids as `start` would submit them (validated as there). InvalidRequest or NotFound."""
        field = validate_request(request, self.model, self.limits)
        return await self._encoder.encode(request, field)

    async def start(self, request: GenerationRequest, timeout: float) -> Generation:
        """Validate, tokenize and open the request's span. Raises InvalidRequest or NotFound."""
        field = validate_request(request, self.model, self.limits)
        prompt_token_ids = await self._encoder.encode(request, field)
        if request.max_tokens_to_context:
            room = max(1, self.model.max_model_len - len(prompt_token_ids))
            request.sampling = dataclasses.replace(request.sampling, max_tokens=room)
        check_prompt_length(field, len(prompt_token_ids), request.sampling.max_tokens, self.model)
        request_id = request.request_id or new_request_id()
        timings = TokenTimings()  # TTFT and latencies count from the span's start
        span = self._tracer.start_span(SpanName.GATEWAY, kind=trace.SpanKind.SERVER, start_time=timings.start_ns,
                                       attributes=self._span_attributes(request, request_id))
        trace_id = format(span.get_span_context().trace_id, "032x")
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            model=self.model.name,
            token_ids=prompt_token_ids,
            sampling=sampling_to_proto(request.sampling),
            cache_salt=request.cache_salt,
            deadline_unix_ms=int((time.time() + timeout) * 1000),
            trace_id=trace_id,
        )
        metadata = self._metadata(span)
        options = OutputOptions(request.sampling, request.stop, request.include_stop_str_in_output,
                                request.skip_special_tokens)
        return Generation(
            request_id, trace_id, prompt_token_ids,
            lambda: self._scheduler.Submit(submit, timeout=timeout, metadata=metadata),
            OutputAssembler(self.codec, options, len(prompt_token_ids)),
            span,
            timings,
            self._metrics,
        )

    def _metadata(self, span: trace.Span) -> tuple[tuple[str, str], ...]:
        pairs = inject_metadata(trace.set_span_in_context(span))
        if self._internal_token:
            pairs.append((INTERNAL_TOKEN_KEY, self._internal_token))
        return tuple(pairs)

    def _span_attributes(self, request: GenerationRequest, request_id: str) -> dict[str, str | int | float]:
        sampling = request.sampling
        attributes: dict[str, str | int | float] = {
            Attr.REQUEST_ID: request_id,
            **telemetry.start_attributes(self.model.name),
            Attr.GEN_AI_OPERATION_NAME: "chat" if request.messages is not None else "text_completion",
            Attr.GEN_AI_REQUEST_MODEL: self.model.name,
            Attr.GEN_AI_REQUEST_MAX_TOKENS: sampling.max_tokens,
            Attr.GEN_AI_REQUEST_TEMPERATURE: sampling.temperature,
            Attr.GEN_AI_REQUEST_TOP_P: sampling.top_p,
            Attr.GEN_AI_REQUEST_TOP_K: sampling.top_k,
        }
        if sampling.seed is not None:
            attributes[Attr.GEN_AI_REQUEST_SEED] = sampling.seed
        return attributes
