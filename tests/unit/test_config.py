"""Flags, TANDEM_* environment fallbacks and value parsers of services/common/config.py."""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass

import pytest

from services.common.config import (
    add_option, add_switch, env_name, from_args, parse_address, parse_bool, parse_list, parse_size,
)


@dataclass(frozen=True, slots=True)
class ToyConfig:
    port: int
    kv_memory: int
    scheduler: str
    api_keys: tuple[str, ...]
    verbose: bool


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_option(parser, "--port", type=int, default=50061, help="port")
    add_option(parser, "--kv-memory", type=parse_size, default="2GiB", help="KV cache size")
    add_option(parser, "--scheduler", type=parse_address, default="127.0.0.1:50052")
    add_option(parser, "--api-keys", type=parse_list, default="")
    add_switch(parser, "--verbose")
    return parser


def test_defaults_env_and_flags_in_order_of_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert from_args(ToyConfig, _parser().parse_args([])) == ToyConfig(50061, 2 << 30, "127.0.0.1:50052", (), False)
    monkeypatch.setenv("TANDEM_PORT", "6000")
    monkeypatch.setenv("TANDEM_KV_MEMORY", "512MiB")
    monkeypatch.setenv("TANDEM_API_KEYS", "k1, k2")
    monkeypatch.setenv("TANDEM_VERBOSE", "true")
    from_env = from_args(ToyConfig, _parser().parse_args([]))
    assert from_env == ToyConfig(6000, 512 << 20, "127.0.0.1:50052", ("k1", "k2"), True)
    flags = _parser().parse_args(["--port", "7000", "--scheduler", "sched:1"])
    assert from_args(ToyConfig, flags, api_keys=("x",)) == ToyConfig(7000, 512 << 20, "sched:1", ("x",), True)
    with pytest.raises(FrozenInstanceError):
        from_env.port = 1


def test_env_values_are_checked_like_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_KV_MEMORY", "lots")
    with pytest.raises(argparse.ArgumentError, match="invalid size 'lots'"):
        _parser().parse_args([])


def test_help_names_the_variable() -> None:
    assert "(env TANDEM_KV_MEMORY; default 2GiB)" in _parser().format_help().replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("text, size", [
    ("1048576", 1 << 20), ("2GiB", 2 << 30), ("2gib", 2 << 30), ("512 MiB", 512 << 20), ("1.5KiB", 1536),
    ("1GB", 10**9), ("64k", 64000), ("3b", 3),
])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2 parsecs", "-1GiB", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_size(text)


def test_small_parsers() -> None:
    assert env_name("--max-batched-tokens") == "TANDEM_MAX_BATCHED_TOKENS"
    assert [parse_bool(v) for v in ("1", "Yes", "on", "0", "false", "")] == [True, True, True, False, False, False]
    assert parse_address("[::1]:50051") == "[::1]:50051"
    assert parse_list(" a, b,,c ") == ("a", "b", "c")
    for bad in ("localhost", ":50051", "host:0", "host:70000", "host:port"):
        with pytest.raises(argparse.ArgumentTypeError, match="use HOST:PORT"):
            parse_address(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="invalid boolean"):
        parse_bool("maybe")
