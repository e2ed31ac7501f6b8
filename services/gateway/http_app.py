"""The gateway's OpenAI-compatible REST/SSE bridge: its settings and FastAPI routes over the same
GenerationPipeline as the gRPC door. Errors are shaped by http_errors, streams by sse, ids by
http_middleware; http_server serves the app with uvicorn in the gateway's process.

A generation request goes: API key, body size, JSON, n (all before any work), then the pipeline,
which checks every other field and limit exactly as for the gRPC door. The response starts only
once the first token arrived, so every failure before it is a plain HTTP error; a failure after it
is one error event in the stream, then `[DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.common.auth import presented_secret, secret_matches
from services.common.config import add_option, from_args, parse_size
from services.common.errors import DEFAULT_RETRY_AFTER_S, InvalidRequest, NotFound, Unauthenticated, retry_metadata
from services.common.metrics import render_metrics
from services.common.tokenizer import TextCodec
from services.common.wire import DEFAULT_MAX_TOKENS
from services.gateway import sse
from services.gateway.choices import ChoiceSet
from services.gateway.generation import GenerationPipeline
from services.gateway.http_errors import ApiError, add_error_handlers
from services.gateway.http_middleware import RequestIds
from services.gateway.models import LoadedModel
from services.gateway.openai_requests import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                              TokenizeRequest, body_error)
from services.gateway.openai_responses import ChatShaper, Choice, CompletionShaper, ResponseShaper, model_card
from services.gateway.request import GenerationRequest, salt_for_key
from services.gateway.validation import check_choices, check_generations, check_token_ids
from tandem.v1.errors import kind_named

CLIENT_CLOSED_REQUEST = kind_named("Cancelled").http_status  # the client left before the response

T = TypeVar("T")
Body = CompletionRequest | ChatCompletionRequest
Parsed = TypeVar("Parsed", CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The HTTP bridge's settings. The request limits are the pipeline's (limits.RequestLimits),
    shared with the gRPC door; the body size is HTTP's own."""

    api_keys: tuple[str, ...] = ()  # empty: no authentication
    request_timeout: float = 600.0  # seconds a generation may take, queueing included
    max_body_bytes: int = 1 << 20  # larger bodies get 413


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP bridge's own flag (the gateway's give --api-keys, --request-timeout, --http-port and
    the request limits)."""
    add_option(parser, "--max-body-bytes", type=parse_size, default=HttpConfig().max_body_bytes,
               help="largest HTTP request body, e.g. 1MiB (larger: 413)")


def config_from_args(args: argparse.Namespace) -> HttpConfig:
    """HttpConfig from the parsed flags whose names match its fields (api_keys, max_body_bytes)."""
    return from_args(HttpConfig, args)


class ClientGone(Exception):
    """The client disconnected before the response started."""


class HttpBridge:
    """The routes; one instance per app, holding the shared pipeline."""

    def __init__(self, pipeline: GenerationPipeline, config: HttpConfig, registry: CollectorRegistry) -> None:
        self.pipeline = pipeline
        self.config = config
        self.registry = registry
        self.serving = False  # /health: 503 until the gateway marks it serving, and again while draining

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, "chatcmpl")

    async def models(self, request: Request) -> Response:
        self._authenticate(request)
        entries = await self.pipeline.model_entries()
        return JSONResponse({"object": "list", "data": [model_card(entry) for entry in entries]})

    async def model(self, request: Request, model_id: str) -> Response:
        self._authenticate(request)
        try:
            entry = await self.pipeline.model_entry(model_id)
        except NotFound:
            served = ", ".join(repr(name) for name in self.pipeline.models.served_names())
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {served} "
                           "(GET /v1/models)", "model", "model_not_found") from None
        return JSONResponse(model_card(entry))

    async def tokenize(self, request: Request) -> Response:
        self._authenticate(request)
        body = _parse(TokenizeRequest, await _read_body(request, self.config.max_body_bytes))
        generation_request = body.generation_request()
        token_ids = await self.pipeline.tokenize(generation_request)
        model = (await self.pipeline.models.for_request(generation_request.model)).model
        return JSONResponse({"tokens": token_ids, "count": len(token_ids), "max_model_len": model.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        self._authenticate(request)
        body = _parse(DetokenizeRequest, await _read_body(request, self.config.max_body_bytes))
        loaded = await self.pipeline.models.for_request(body.model)
        check_token_ids("tokens", body.tokens, loaded.model)
        return JSONResponse({"prompt": loaded.codec.decode(body.tokens, skip_special_tokens=False)})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": importlib.metadata.version("tandem")})

    async def health(self, request: Request) -> Response:
        if self.serving:
            return JSONResponse({"status": "serving"})
        return JSONResponse({"status": "not_serving"}, status_code=503,
                            headers=dict(retry_metadata(DEFAULT_RETRY_AFTER_S)))

    async def metrics(self, request: Request) -> Response:
        body, content_type = render_metrics(self.registry)
        return Response(body, media_type=content_type)

    async def _generate(self, request: Request, body_type: type[Body], id_prefix: str) -> Response:
        body, requests = await self._accept(request, body_type)
        loaded = await self.pipeline.models.for_request(requests[0].model)  # one model for every prompt of a body
        shaper = self._shaper(body, requests, f"{id_prefix}-{requests[0].request_id}", loaded)
        total = body.num_choices * len(requests)
        choices = ChoiceSet(self.pipeline, requests, body.num_choices, self.config.request_timeout)
        streamed = False
        try:
            with _named_as_sent(body):
                await _unless_disconnected(request, choices.start())
            if body.stream:
                streamed = True  # the response closes the choices when the stream ends
                return sse.SseResponse(sse.events(shaper, choices, total, body.include_usage), choices.close)
            collected = await _unless_disconnected(request, _collect(choices, total))
            return JSONResponse(shaper.response(collected))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            request.state.trace_id = choices.trace_id
            if not streamed:
                choices.close()

    async def _accept(self, request: Request, body_type: type[Body]) -> tuple[Body, list[GenerationRequest]]:
        """Everything checked before any work: key, body size, JSON, fields, limits; then the
        pipeline's requests, one per prompt."""
        api_key = self._authenticate(request)
        body = _parse(body_type, await _read_body(request, self.config.max_body_bytes))
        body.check_undeclared()
        check_choices(body.num_choices, self.pipeline.limits)
        with _named_as_sent(body):
            requests = body.generation_requests(request.state.request_id, salt_for_key(api_key), DEFAULT_MAX_TOKENS)
        server = request.scope.get("server")  # the local socket's (host, port); None on a Unix socket
        for generation_request in requests:
            generation_request.served_at = (server[0], server[1]) if server else None
        check_generations(len(requests), body.num_choices, self.pipeline.limits)
        return body, requests

    def _shaper(self, body: Body, requests: list[GenerationRequest], response_id: str,
                loaded: LoadedModel) -> ResponseShaper:
        def token_text(token_id: int) -> str:
            return loaded.codec.decode([token_id], skip_special_tokens=False)

        common = (response_id, int(time.time()), loaded.model.name, token_text)
        with_logprobs = requests[0].sampling.logprobs is not None
        options = {"with_logprobs": with_logprobs, "n": body.num_choices,
                   "with_prompt_logprobs": body.prompt_logprobs is not None}
        if isinstance(body, ChatCompletionRequest):
            return ChatShaper(*common, **options, tools=body.tool_plan)
        echoes = [_prompt_text(request, loaded.codec) for request in requests] if body.echo else None
        return CompletionShaper(*common, **options, echoes=echoes)

    def _authenticate(self, request: Request) -> str | None:
        """The caller's API key (None when the gateway has none configured); 401 otherwise."""
        if not self.config.api_keys:
            return None
        presented = presented_secret(request.headers.get)
        if presented is None:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>`")
        if not secret_matches(presented, [key.encode() for key in self.config.api_keys]):
            raise Unauthenticated("invalid API key: send `Authorization: Bearer <key>` with a configured key")
        return presented


def _prompt_text(request: GenerationRequest, codec: TextCodec) -> str:
    if request.prompt is not None:
        return request.prompt
    return codec.decode(request.token_ids or [], skip_special_tokens=False)


def create_http_app(pipeline: GenerationPipeline, config: HttpConfig,
                    registry: CollectorRegistry | None = None) -> FastAPI:
    """The HTTP app over `pipeline`. /health answers 503 until `set_serving(app, True)`; /metrics
    renders `registry` (the gateway's ServiceMetrics registry)."""
    bridge = HttpBridge(pipeline, config, registry if registry is not None else CollectorRegistry())
    # No FastAPI spans: a request's root is the gateway's span (`{operation} {model}`), as on the gRPC door (and
    # every /health and /metrics scrape would otherwise add a trace of its own).
    app = FastAPI(title="Tandem", summary="OpenAI-compatible API of a Tandem gateway", docs_url=None,
                  redoc_url=None, telemetry={"tracing": False})
    app.state.bridge = bridge
    app.add_middleware(RequestIds)
    app.add_api_route("/v1/completions", bridge.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", bridge.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", bridge.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", bridge.model, methods=["GET"])
    app.add_api_route("/tokenize", bridge.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", bridge.detokenize, methods=["POST"])
    app.add_api_route("/version", bridge.version, methods=["GET"])
    app.add_api_route("/health", bridge.health, methods=["GET"])
    app.add_api_route("/metrics", bridge.metrics, methods=["GET"])
    add_error_handlers(app)
    return app


def set_serving(app: FastAPI, serving: bool) -> None:
    """Turn /health to 200 (serving) or 503 (starting, draining)."""
    app.state.bridge.serving = serving


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(f"more than {limit} bytes", limit)  # the rest is never read
    return bytes(body)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size}; this server accepts at most {limit} (--max-body-bytes)",
                    None, "request_too_large")


def _parse(body_type: type[Parsed], raw: bytes) -> Parsed:
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as exc:
        problem = body_error(exc)
        raise ApiError(400, problem.message, problem.param, problem.code) from None


@contextlib.contextmanager
def _named_as_sent(body: Body) -> Iterator[None]:
    """Re-raise the pipeline's InvalidRequest under the field name the body used."""
    try:
        yield
    except InvalidRequest as error:
        param = body.param_name(error.field)
        if param == error.field:
            raise
        problem = error.message.removeprefix(f"{error.field}: ")
        raise InvalidRequest(param, problem) from None


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so the upstream calls it makes) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        return task.result()
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(choices: ChoiceSet, n: int) -> list[Choice]:
    collected = [Choice(index) for index in range(n)]
    async for index, chunk in choices.chunks():
        collected[index].add(chunk)
    return collected
