"""The `tandem` command: a thin dispatcher over subcommands.

Each subcommand lives in its own module (tandem/cli/ for the tools, the service's `main` module for
a service), which exposes `add_arguments(parser)` and `main(args) -> int`; only the module of the
command being run is imported, so `tandem --help` and `tandem trace` never load torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True, slots=True)
class Command:
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "up": Command("tandem.cli.up", "start the whole system locally (Redis, scheduler, workers, gateway)"),
    "gateway": Command("services.gateway.main", "run the gateway (gRPC and OpenAI-compatible HTTP)"),
    "scheduler": Command("services.scheduler.main", "run the scheduler"),
    "prefill": Command("services.prefill.main", "run a prefill worker"),
    "decode": Command("services.decode.main", "run a decode worker"),
    "colocated": Command("services.colocated.main", "run a worker that both prefills and decodes"),
    "sim-worker": Command("tandem.cli.sim_worker", "run simulated workers (no model) to measure the control plane"),
    "health": Command("services.common.health_cli", "check a service's gRPC health (exit 0 when serving)"),
    "model": Command("tandem.cli.model", "manage models: pull the default model, show a model's sizes"),
    "models": Command("tandem.cli.models", "list a deployment's models and where they are loaded; provision one"),
    "generate": Command("tandem.cli.generate", "generate text in-process with the engine"),
    "chat": Command("tandem.cli.chat", "chat with a running gateway, the reply streamed (--url)"),
    "trace": Command("tandem.cli.trace", "show a request's end-to-end trace"),
    "deploy": Command("tandem.cli.deploy", "write a docker compose or Kubernetes deployment"),
}


GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
EXIT_BROKEN_PIPE = 128 + 13  # as a process killed by SIGPIPE, what shells expect of `cmd | head`


class CommandUnavailable(RuntimeError):
    """The module that implements a subcommand is not part of this installation."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: LLM serving with disaggregated prefill and decode over gRPC.",
        epilog=_commands_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", help="one of the commands below; `tandem COMMAND --help` shows its options"
    )
    parsers = {name: subparsers.add_parser(name, description=command.help) for name, command in COMMANDS.items()}
    return parser, parsers


def _version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; `pip install -e .` records it)"


def _commands_help() -> str:
    # Listed here rather than by argparse, which misaligns long subcommand names.
    width = max(map(len, COMMANDS))
    return "commands:\n" + "\n".join(f"  {name:<{width}}  {command.help}" for name, command in COMMANDS.items())


def load_command(name: str) -> ModuleType:
    """Imports the module behind `name`; a missing module (not a missing dependency) is reported."""
    module_path = COMMANDS[name].module
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_path + ".").startswith(exc.name + "."):
            raise
        raise CommandUnavailable(
            f"`tandem {name}` is not available in this installation (module {module_path} not found)"
        ) from exc


def main(argv: list[str] | None = None) -> int:
    # gRPC's fork handlers restart its poller thread inside a forked child, where subprocess has
    # already closed the epoll fd, and the child can abort before exec (grpc/grpc#43055): `tandem up`
    # forks its services while it polls their health over gRPC. No tandem process uses gRPC in a
    # forked child, so the handlers are turned off before gRPC starts (children inherit it).
    os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "false")
    argv = sys.argv[1:] if argv is None else argv
    parser, parsers = build_parser()
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    if name in COMMANDS:
        try:
            module = load_command(name)
        except CommandUnavailable as exc:
            parser.exit(2, f"tandem: error: {exc}\n")
        module.add_arguments(parsers[name])
        parsers[name].set_defaults(run=module.main)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """The reader of our output went away (`tandem trace ... | head`): end quietly, as `cat` does.

    Standard output is pointed at /dev/null so the interpreter's final flush of what is still
    buffered cannot raise the same error again at exit.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE
