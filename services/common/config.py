"""Typed service configuration from command-line flags with `TANDEM_*` environment fallbacks.

A flag wins over its variable (`--kv-memory` <- TANDEM_KV_MEMORY), which wins over the default.
Each service declares its flags with `add_option` and builds its frozen config with `from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any, TypeVar

ENV_PREFIX = "TANDEM_"
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

C = TypeVar("C")


def env_name(flag: str) -> str:
    """'--kv-memory' -> 'TANDEM_KV_MEMORY'."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def env_default(name: str, default: Any) -> Any:
    """The value of environment variable `name` (raw string) if set and non-empty, else default.

    Used as an argparse default: argparse applies the option's `type` to string defaults, so
    environment values are parsed and checked exactly like flag values.
    """
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    env: str | None = None,
    **kwargs: Any,
) -> None:
    """parser.add_argument(flag) whose default comes from TANDEM_<FLAG> when that is set."""
    env = env or env_name(flag)
    shown = "none" if default is None else default
    parser.add_argument(flag, type=type, default=env_default(env, default),
                        help=f"{help} (env {env}; default {shown})".lstrip(), **kwargs)


def add_switch(parser: argparse.ArgumentParser, flag: str, *, help: str = "", env: str | None = None) -> None:
    """A boolean --flag (off by default) that TANDEM_<FLAG>=1/true/yes/on also turns on."""
    env = env or env_name(flag)
    parser.add_argument(flag, action="store_true", default=parse_bool(env_default(env, "false")),
                        help=f"{help} (env {env})".lstrip())


def add_list_option(parser: argparse.ArgumentParser, flag: str, *, help: str = "", env: str | None = None,
                    metavar: str | None = None) -> None:
    """A repeatable option of comma-separated items, gathered into one tuple (default ()); the
    flags replace TANDEM_<FLAG> (itself a comma-separated list) rather than add to it."""
    env = env or env_name(flag)
    parser.add_argument(flag, type=parse_list, default=env_default(env, ()), action=_ListAction, metavar=metavar,
                        help=f"{help}; repeatable (env {env}, comma-separated)".lstrip())


class _ListAction(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (*(() if current is self.default else current), *values))


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """Build dataclass `cls` from the parsed flags whose names match its fields (then overrides)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    names = {f.name for f in dataclasses.fields(cls)}
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**{**values, **overrides})


def _type_error(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1048576' -> 1048576 (units are case-insensitive)."""
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise _type_error(f"invalid size {text!r}: use a number with an optional unit such as 512MiB, 2GiB or 1GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_count(text: str) -> int:
    """'3' -> 3: a whole number of things (replicas, workers), at least 1."""
    value = int(text)
    if value < 1:
        raise _type_error(f"must be at least 1, got {value}")
    return value


def parse_seconds(text: str) -> float:
    """'2.5' -> 2.5: a duration in seconds, 0 or more."""
    seconds = float(text)
    if seconds < 0:
        raise _type_error(f"must be >= 0 seconds, got {text}")
    return seconds


def parse_bool(text: str) -> bool:
    """'1'/'true'/'yes'/'on' -> True, '0'/'false'/'no'/'off'/'' -> False."""
    value = str(text).strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise _type_error(f"invalid boolean {text!r}: use true or false")


def parse_address(text: str) -> str:
    """Check a HOST:PORT address (IPv6 hosts in brackets) and return it unchanged."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _type_error(f"invalid address {text!r}: use HOST:PORT, for example 127.0.0.1:50052")
    return text


def parse_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(item.strip() for item in str(text).split(",") if item.strip())


def parse_addresses(text: str) -> tuple[str, ...]:
    """'h1:1,h2:2' -> ('h1:1', 'h2:2'), each checked as parse_address does; at least one."""
    addresses = tuple(parse_address(item) for item in parse_list(text))
    if not addresses:
        raise _type_error(f"no address in {text!r}: use HOST:PORT[,HOST:PORT...]")
    return addresses
