"""The public gRPC door, `tandem.v1.GenerateService`: converts at the edge and lets the
generation pipeline do the work (the same validation and limits as the HTTP door). Errors are
TandemErrors, mapped to statuses by the interceptor; every call, failed ones included, names its
request id in the initial metadata.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.errors import InvalidRequest, TandemError
from services.common.auth import presented_secret
from services.common.grpc_server import remaining_timeout
from services.common.wire import DEFAULT_MAX_TOKENS, FINISH_REASON_TO_PROTO, sampling_from_proto
from services.gateway.generation import Generation, GenerationPipeline
from services.gateway.models import ModelEntry
from services.gateway.output import Chunk
from services.gateway.request import (
    OWNED_BY, REQUEST_ID_HEADER, TRACE_ID_HEADER, GenerationRequest, new_request_id, salt_for_key,
)
from services.gateway.validation import check_repeated_sizes, request_id_or_new
from tandem.v1 import gateway_pb2, gateway_pb2_grpc


def request_from_proto(msg: gateway_pb2.GenerateRequest, default_salt: str = "") -> GenerationRequest:
    """The domain request; a repeated field left empty counts as not set, an empty cache_salt
    takes the tenant's default. InvalidRequest for prompt_logprobs, which GenerateResponse has no room for."""
    sampling = msg.sampling
    if sampling.HasField("prompt_logprobs"):
        raise InvalidRequest("sampling.prompt_logprobs", "prompt logprobs are returned on the HTTP door only "
                             "(/v1/completions, /v1/chat/completions); leave it unset")
    return GenerationRequest(
        sampling=sampling_from_proto(sampling, DEFAULT_MAX_TOKENS),
        model=msg.model,
        prompt=msg.prompt if msg.HasField("prompt") else None,
        token_ids=list(msg.token_ids) or None,
        messages=[{"role": m.role, "content": m.content} for m in msg.messages] or None,
        stop=tuple(sampling.stop),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        skip_special_tokens=sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True,
        cache_salt=msg.cache_salt or default_salt,
        request_id=msg.request_id,
    )


def response_from_chunk(chunk: Chunk) -> gateway_pb2.GenerateResponse:
    response = gateway_pb2.GenerateResponse(token_ids=chunk.token_ids, text=chunk.text, logprobs=chunk.logprobs)
    if chunk.finish_reason is not None:
        response.finish_reason = FINISH_REASON_TO_PROTO[chunk.finish_reason]
    if chunk.stop_token_id is not None:
        response.stop_token_id = chunk.stop_token_id
    if chunk.stop_string is not None:
        response.stop_string = chunk.stop_string
    if chunk.usage is not None:
        response.usage.CopyFrom(chunk.usage)
    if chunk.timings is not None:
        response.timings.CopyFrom(chunk.timings)
    return response


class GenerateServicer(gateway_pb2_grpc.GenerateServiceServicer):
    """Generate streams a request's chunks; the first response carries its request and trace ids
    (also sent at once as `x-request-id` / `x-trace-id` initial metadata, and again with the status:
    grpc's asyncio client drops initial metadata that the status overtook, as a call ended at once may)."""

    def __init__(self, pipeline: GenerationPipeline, default_timeout: float, tenant_salts: bool = False,
                 served_at: tuple[str, int] | None = None) -> None:
        """`tenant_salts`: API keys are configured, so each key's requests get their own prefix
        cache unless they send a cache_salt (as on the HTTP door). `served_at`: the (host, port)
        this door listens on, for its requests' spans."""
        self._pipeline = pipeline
        self._default_timeout = default_timeout
        self._tenant_salts = tenant_salts
        self._served_at = served_at

    def _default_salt(self, context: grpc.aio.ServicerContext) -> str:
        if not self._tenant_salts:
            return ""
        metadata = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
        return salt_for_key(presented_secret(metadata.get))

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request_id = request.request_id or new_request_id()
        try:
            timeout = remaining_timeout(context, default=self._default_timeout)
            check_repeated_sizes(len(request.messages), len(request.token_ids), self._pipeline.model,
                                 self._pipeline.limits)
            domain = request_from_proto(request, self._default_salt(context))
            domain.request_id = request_id
            domain.served_at = self._served_at
            generation = await self._pipeline.start(domain, timeout)
        except TandemError:  # refused before any work: the id still names it (a fresh one if its own is invalid)
            await _send_ids(context, ((REQUEST_ID_HEADER, request_id_or_new(request_id)),))
            raise
        try:
            await _send_ids(context, ((REQUEST_ID_HEADER, generation.request_id),
                                      (TRACE_ID_HEADER, generation.trace_id)))
            async for response in _responses(generation):
                yield response
        finally:
            generation.close()  # the client went away or the stream ended: cancel upstream

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        entries = await self._pipeline.model_entries()
        return gateway_pb2.ListModelsResponse(models=[model_card(entry) for entry in entries])


async def _send_ids(context: grpc.aio.ServicerContext, ids: tuple[tuple[str, str], ...]) -> None:
    """The request's ids as initial metadata now and as trailing metadata with its status."""
    await context.send_initial_metadata(ids)
    context.set_trailing_metadata(ids)


async def _responses(generation: Generation) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    first = True
    async for chunk in generation:
        response = response_from_chunk(chunk)
        if first:
            response.request_id, response.trace_id = generation.request_id, generation.trace_id
            first = False
        yield response


def model_card(entry: ModelEntry) -> gateway_pb2.ModelCard:
    """The card of a model or of an adapter (`entry.id` BASE:NAME), with its residency."""
    model = entry.model
    return gateway_pb2.ModelCard(id=entry.id, max_model_len=model.max_model_len, vocab_size=model.vocab_size,
                                 has_chat_template=model.has_chat_template, created=model.created,
                                 owned_by=OWNED_BY, resident=entry.resident, resident_workers=entry.resident_workers)
