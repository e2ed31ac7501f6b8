"""What the gateway records of a request when it ends: its span's GenAI response attributes and status,
and its metrics.

A request ends one of three ways: finished (a finish reason and usage arrived), failed (an upstream
error), or abandoned (the client left, or the gateway closed it, before a finish reason). Each is
recorded here once, so the span and `/metrics` always agree. Attribute keys come from
`opentelemetry-semantic-conventions`; the span's start attributes stay in generation.py.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.semconv.attributes import error_attributes, server_attributes

from services.common.metrics import ServiceMetrics
from services.common.spans import Attr
from tandem.v1 import common_pb2

PROVIDER = "tandem"  # gen_ai.provider.name: not one of the listed providers, so our own name
ABANDONED = "cancelled"  # error.type of a request that ended before its finish reason
ABORT = "abort"  # request_success's finished_reason for it, as vLLM counts aborts


def start_attributes(model: str, served_at: tuple[str, int] | None) -> dict[str, str | int]:
    """Start attributes of every gateway span beside the request's: the provider, the model that
    answers (the served model, known before the first token), and `server.address` / `server.port`
    of the door the request came in on, when the door knows it."""
    attributes: dict[str, str | int] = {gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER, gen_ai.GEN_AI_RESPONSE_MODEL: model}
    if served_at is not None:
        attributes[server_attributes.SERVER_ADDRESS], attributes[server_attributes.SERVER_PORT] = served_at
    return attributes


def record_finished(span: trace.Span, metrics: ServiceMetrics | None, request_id: str, finish_reason: str,
                    usage: common_pb2.Usage, elapsed_s: float) -> None:
    span.set_attributes({
        gen_ai.GEN_AI_RESPONSE_ID: request_id,
        Attr.GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason],
        Attr.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
        Attr.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
    })  # fmt: skip
    if metrics is not None:
        metrics.count_request(finish_reason, usage.prompt_tokens, usage.completion_tokens, elapsed_s)


def record_failed(span: trace.Span, error: Exception, detail: str) -> None:
    """ERROR with `error.type` the error's class (low cardinality, as the conventions ask)."""
    span.set_attribute(error_attributes.ERROR_TYPE, type(error).__name__)
    span.set_status(trace.StatusCode.ERROR, detail)


def record_abandoned(span: trace.Span, metrics: ServiceMetrics | None, prompt_tokens: int, output_tokens: int,
                     elapsed_s: float, failed: bool) -> None:
    """A request closed before its finish reason: counted as an abort; its span ERROR unless a failure already said why."""
    if not failed:
        span.set_attribute(error_attributes.ERROR_TYPE, ABANDONED)
        span.set_status(trace.StatusCode.ERROR, "the request ended before it finished (client gone or cancelled)")
    if metrics is not None:
        metrics.count_request(ABORT, prompt_tokens, output_tokens, elapsed_s)
