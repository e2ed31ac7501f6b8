"""`tandem models`: the models a deployment serves. `list` asks a gateway (GET /v1/models: every
catalogue model and adapter, whether it is loaded and on how many workers); `provision NAME`
asks a scheduler to load and pin a model on N workers ahead of traffic (SchedulerService.
ProvisionModel, an internal RPC: it takes the internal token, or mutual TLS, as services do).

Exit codes: 0 done; 1 the gateway or scheduler refused (its message says why); 2 bad flags or
credentials; 3 no gateway or scheduler could be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
from typing import Any

import grpc

from services.common import internal_auth
from services.common.channels import internal_channel
from services.common.config import add_option, parse_addresses, parse_count
from services.common.grpc_server import INTERNAL_TOKEN_KEY
from services.common.tls import MutualTLS
from tandem.cli.chat import DEFAULT_URL, ChatError, Gateway
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
DEFAULT_SCHEDULER = "127.0.0.1:50052"
# What an answer means, for the codes whose message alone would not say what to do.
ADVICE = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "no answer within --timeout; the loads may still finish: see `tandem models "
                                       "list`, or provision again with a longer --timeout",
    grpc.StatusCode.UNAUTHENTICATED: "the scheduler refused the credentials: give the deployment's internal token "
                                     "(TANDEM_INTERNAL_TOKEN or --internal-token-file) or its mutual TLS files",
    grpc.StatusCode.PERMISSION_DENIED: "the scheduler refused the credentials: give the deployment's internal "
                                       "token or its mutual TLS files",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="every model and adapter a gateway serves, and where it is loaded",
                                 description="List the models a gateway serves (GET /v1/models): each catalogue "
                                 "model and adapter, whether a worker holds it loaded now, and on how many.")
    listing.add_argument("--url", default=os.environ.get("TANDEM_URL", DEFAULT_URL),
                         help=f"the gateway's HTTP address (env TANDEM_URL; default {DEFAULT_URL})")
    listing.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                         help="a client API key (env TANDEM_API_KEY; default none)")
    listing.add_argument("--json", action="store_true", help="print the model cards as JSON instead of a table")
    listing.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="give up after SECONDS (30)")
    provision = actions.add_parser("provision", help="load and pin a model on N workers ahead of traffic",
                                   description="Ask a scheduler to load model NAME on --replicas workers of each "
                                   "role a request needs and keep it there (pinned: never evicted).")
    provision.add_argument("name", metavar="NAME", help="a catalogue model's name (as `tandem models list` shows)")
    provision.add_argument("--replicas", type=parse_count, default=1, metavar="N",
                           help="workers that should hold it, of each role, counting those that already do (default 1)")
    add_option(provision, "--scheduler", type=parse_addresses, default=(DEFAULT_SCHEDULER,),
               help="the schedulers' HOST:PORT, comma-separated: the first that can be reached is asked")
    provision.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                           help="give up after SECONDS; loading a model takes a while (default 600)")
    internal_auth.add_arguments(provision)


def main(args: argparse.Namespace) -> int:
    if args.models_action == "list":
        return _list(args)
    return _provision(args)


# --- list ------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    try:
        cards = Gateway(args.url, args.api_key, args.timeout).models()
    except ChatError as exc:
        print(f"tandem models list: {exc}", file=sys.stderr)
        return EXIT_REFUSED if isinstance(exc.__cause__, urllib.error.HTTPError) else EXIT_UNREACHABLE
    sys.stdout.write(json.dumps(cards, indent=2) + "\n" if args.json else format_table(cards))
    return 0


def format_table(cards: list[dict[str, Any]]) -> str:
    """One line per card: its id, whether it is resident, on how many workers, its context, and the
    base model of an adapter."""
    rows = [("MODEL", "RESIDENT", "WORKERS", "CONTEXT", "ADAPTER OF")]
    for card in cards:
        rows.append((str(card["id"]), "yes" if card.get("resident") else "no", str(card.get("resident_workers", 0)),
                     str(card.get("max_model_len", "")), str(card.get("parent") or "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n" for row in rows)


# --- provision -------------------------------------------------------------------------------


def _provision(args: argparse.Namespace) -> int:
    try:
        auth = internal_auth.auth_from_args(args, "models provision")
    except internal_auth.InternalAuthError as exc:
        print(f"tandem models provision: {exc}", file=sys.stderr)
        return EXIT_USAGE
    request = scheduler_pb2.ProvisionModelRequest(model=args.name, replicas=args.replicas)
    metadata = ((INTERNAL_TOKEN_KEY, auth.token),) if auth.token else ()
    try:
        worker_ids, scheduler = asyncio.run(provision(args.scheduler, request, metadata, auth.tls, args.timeout))
    except grpc.aio.AioRpcError as exc:
        return _refused(args, exc)
    print(f"model {args.name!r} is pinned on {len(worker_ids)} worker{'s' if len(worker_ids) != 1 else ''} "
          f"({scheduler}): {', '.join(worker_ids)}")
    return 0


async def provision(schedulers: tuple[str, ...], request: scheduler_pb2.ProvisionModelRequest,
                    metadata: tuple[tuple[str, str], ...], tls: MutualTLS | None,
                    timeout: float) -> tuple[list[str], str]:
    """The worker ids the first reachable scheduler pinned the model on, and that scheduler. Raises
    the scheduler's refusal, or the last UNAVAILABLE when none could be reached."""
    error: grpc.aio.AioRpcError | None = None
    for address in schedulers:
        async with internal_channel(address, tls=tls) as channel:
            try:
                response = await scheduler_pb2_grpc.SchedulerServiceStub(channel).ProvisionModel(
                    request, metadata=metadata, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:  # it reached the scheduler: its answer stands
                    raise
                error = exc
                continue
        return list(response.worker_ids), address
    assert error is not None  # schedulers is never empty (parse_addresses)
    raise error


def _refused(args: argparse.Namespace, exc: grpc.aio.AioRpcError) -> int:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        print(f"tandem models provision: no scheduler could be reached ({', '.join(args.scheduler)}): "
              f"{code.name}: {exc.details()}; is it running? (--scheduler)", file=sys.stderr)
        return EXIT_UNREACHABLE
    advice = ADVICE.get(code)
    print(f"tandem models provision: {code.name}: {exc.details()}" + (f" ({advice})" if advice else ""),
          file=sys.stderr)
    return EXIT_REFUSED
