"""`tandem gateway`: the public door. Serves every model of its catalogue (`--model [NAME=]DIR`,
repeatable, and every model directory under $TANDEM_HOME/models; services/gateway/models.py) with
their tokenizers (never torch), GenerateService over gRPC and the HTTP API, and reports SERVING
while any of its schedulers can serve the primary model (services/gateway/health.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import sys
from dataclasses import dataclass

from services.common import internal_auth
from services.common.channels import internal_channel
from services.common.config import add_option, from_args, parse_addresses, parse_count, parse_list
from services.common.grpc_server import PUBLIC_MESSAGE_BYTES, create_server
from services.common.metrics import ServiceMetrics
from services.common.model_catalogue import ModelCatalogue, ModelCatalogueError
from services.common.model_config import ModelLoadError
from services.common.lora_catalogue import LoraCatalogueError, lora_sources
from services.common.model_store import default_model_dir
from services.common.tls import MutualTLS, ServerCertificate, TLSConfigError, add_server_arguments, server_certificate
from services.common.tracing import setup_tracing
from services.common import event_loop
from services.gateway import http_app, limits
from services.gateway.generation import GenerationPipeline
from services.gateway.upstream import Upstream
from services.gateway.health import follow_scheduler_health
from services.gateway.http_server import start_http
from services.gateway.models import GatewayModels
from services.gateway.servicer import GenerateServicer
from tandem.v1 import gateway_pb2_grpc

log = logging.getLogger("tandem.gateway")

GENERATE_SERVICE = "tandem.v1.GenerateService"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str
    port: int
    http_port: int  # the OpenAI-compatible HTTP API (served by the HTTP bridge)
    scheduler: tuple[str, ...]  # HOST:PORT of each scheduler; a request goes to the one its prefix ranks first
    catalogue: ModelCatalogue  # the models served by name; its primary is loaded at start
    api_keys: tuple[str, ...]
    lora: tuple[str, ...]  # --lora NAME=DIR,...: adapters served as model BASE:NAME (with $TANDEM_HOME/loras)
    internal_token: str | None  # sent to the scheduler; None only under --insecure-internal or with internal_tls
    internal_tls: MutualTLS | None  # mutual TLS with the scheduler
    tls: ServerCertificate | None  # the public doors' certificate (gRPC and HTTP); None: plaintext
    request_timeout: float  # seconds; the deadline of requests whose caller set none
    http: http_app.HttpConfig  # the HTTP bridge's body limit (and api_keys, request_timeout again)
    limits: limits.RequestLimits  # what one request may ask for, on both doors
    stream_interval: int  # tokens per message from a worker after the first (1: each as it comes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add_option(parser, "--port", type=int, default=50051, help="gRPC port")
    add_option(parser, "--http-port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API")
    add_option(parser, "--scheduler", type=parse_addresses, default=("127.0.0.1:50052",),
               help="the schedulers' HOST:PORT, comma-separated: a request goes to the one its leading prefix "
                    "ranks first (within a bound on each one's share), and to the next while one cannot be reached")
    parser.add_argument("--model", action="append", default=None, metavar="[NAME=]DIR",
                        help="a model to serve as NAME (DIR alone: under its directory's name), repeatable, beside "
                             "every model directory under $TANDEM_HOME/models; the first is the primary, loaded at "
                             "start, the others on their first request (env TANDEM_MODEL, comma-separated; default "
                             "the default model)")
    add_option(parser, "--lora", type=parse_list, default=(), metavar="NAME=DIR,...",
               help="LoRA adapters the workers serve (as they take --lora), listed and accepted as model BASE:NAME")
    add_option(parser, "--api-keys", type=parse_list, default=(),
               help="comma-separated client API keys; none turns authentication off")
    add_server_arguments(parser)
    internal_auth.add_arguments(parser)
    add_option(parser, "--request-timeout", type=float, default=600.0,
               help="deadline in seconds of requests whose caller set none")
    add_option(parser, "--stream-interval", type=parse_count, default=1,
               help="tokens per streamed chunk after the first, which goes at once (as vLLM's "
                    "--stream-interval): fewer chunks and less gateway CPU per token, coarser streaming")
    add_option(parser, "--event-loop", default="auto", choices=event_loop.EVENT_LOOPS,
               help="the event loop: uvloop's (auto: when installed) or asyncio's")
    http_app.add_arguments(parser)
    limits.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        auth = internal_auth.auth_from_args(args, "gateway")
        tls = server_certificate(args.tls_cert, args.tls_key)
        lora_sources(args.lora)  # a malformed --lora fails here
        flags = args.model or parse_list(os.environ.get("TANDEM_MODEL", ""))
        catalogue = ModelCatalogue.from_flags(flags, default_model=default_model_dir)
    except (internal_auth.InternalAuthError, TLSConfigError, LoraCatalogueError, ModelCatalogueError) as exc:
        print(f"tandem gateway: {exc}", file=sys.stderr)
        return 2
    config = from_args(GatewayConfig, args, catalogue=catalogue,
                       http=http_app.config_from_args(args), limits=limits.limits_from_args(args),
                       internal_token=auth.token, internal_tls=auth.tls, tls=tls)
    primary = catalogue.path(catalogue.primary)
    if not primary.is_dir():
        print(f"tandem gateway: model directory {primary} not found; run `tandem model pull-default` "
              "or pass --model DIR", file=sys.stderr)
        return 1
    try:
        event_loop.run(serve(config), args.event_loop)
    except event_loop.EventLoopError as exc:
        print(f"tandem gateway: {exc}", file=sys.stderr)
        return 2
    except (OSError, ModelLoadError) as exc:
        print(f"tandem gateway: {exc}", file=sys.stderr)
        return 1
    return 0


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT, then stop gracefully."""
    models = await GatewayModels.start(config.catalogue, tuple(lora_sources(config.lora)))
    codec, model = models.primary.codec, models.primary.model
    tracing = setup_tracing("gateway")
    metrics = ServiceMetrics(model.name, "gateway")
    open_channel = functools.partial(internal_channel, tls=config.internal_tls)
    channels = [open_channel(address) for address in config.scheduler]
    upstream = Upstream(channels, open_channel, config.stream_interval)
    pipeline = GenerationPipeline(codec, model, upstream,
                                  config.internal_token, metrics=metrics, limits=config.limits, models=models)
    server = create_server(config.host, config.port, api_keys=config.api_keys,
                           max_receive_bytes=PUBLIC_MESSAGE_BYTES,
                           credentials=config.tls.grpc_credentials() if config.tls else None)
    server.add_service(GENERATE_SERVICE, gateway_pb2_grpc.add_GenerateServiceServicer_to_server,
                       GenerateServicer(pipeline, config.request_timeout, tenant_salts=bool(config.api_keys),
                                        served_at=(config.host, server.port)))
    await server.start()
    http = http_app.create_http_app(pipeline, config.http, metrics.registry)
    http_server = await start_http(http, config.host, config.http_port, tls=config.tls)
    log.info("serving %s on %s:%d, HTTP%s on port %d (scheduler %s, auth %s, TLS %s, event loop %s)",
             ", ".join(models.names()), config.host,
             server.port, "S" if config.tls else "", http_server.port, ",".join(config.scheduler),
             "on" if config.api_keys else "off", "on" if config.tls else "off",
             event_loop.loop_name(asyncio.get_running_loop()))
    gc.freeze()  # what startup built (the tokenizer, the models' tables) stays out of every later collection
    follower = asyncio.create_task(follow_scheduler_health(channels, server, http, model=model.name,
                                                           internal_token=config.internal_token))
    try:
        await server.run_until_signal()
    finally:
        follower.cancel()
        http_app.set_serving(http, False)
        await http_server.stop()
        await upstream.close()
        for channel in channels:
            await channel.close()
        pipeline.close()
        tracing.shutdown()

