"""How the SDK reaches a gateway: target, TLS, keepalive, API key metadata, default deadline and retry
policy.

Shared by Client and AsyncClient so both connect, authenticate and retry alike.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc

from tandem.errors import Overloaded, TandemError, Unavailable

API_KEY_ENV = "TANDEM_API_KEY"
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 120.0
USER_AGENT = "tandem-python"
# Ping a connection silent for 20 s, give up on it 10 s later: streams outlive idle NATs and a dead
# gateway is noticed. The gateway accepts pings 10 s apart and more (services/common/grpc_server.py).
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS for the channel: `root_certificates` (PEM) to trust, or None for the system's roots;
    `certificate_chain` and `private_key` (PEM) for mutual TLS; `server_name` to check the
    server's certificate against instead of the target's host."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str | os.PathLike[str] | None = None, cert: str | os.PathLike[str] | None = None,
                   key: str | os.PathLike[str] | None = None, server_name: str | None = None) -> TLSConfig:
        """TLS from PEM files: the CA to trust (None: the system's roots), and for mutual TLS the
        client's certificate chain and its key (both or neither)."""
        if (cert is None) != (key is None):
            raise ValueError("mutual TLS needs both cert= and key= (the client's certificate chain and its key)")
        return cls(root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert),
                   server_name=server_name)


def _read(path: str | os.PathLike[str] | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of UNAVAILABLE, and of RESOURCE_EXHAUSTED that carries a retry hint, before a stream's
    first chunk (never after it: tokens already seen would be generated again). The wait after
    failed attempt n is the server's hint (`retry-after-ms`, else `retry-after`) when it sent one,
    else min(initial_backoff * multiplier**(n-1), max_backoff), shortened at random by up to `jitter`."""

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1 (1 = no retry), got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"RetryPolicy needs backoffs >= 0, multiplier >= 1 and jitter in [0, 1], got {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt `attempt` (1-based)."""
        backoff = min(self.initial_backoff * self.multiplier ** (attempt - 1), self.max_backoff)
        return backoff * (1.0 - self.jitter * random.random())


class Deadline:
    """The end of one call, retries included; each attempt gets the time that is left."""

    def __init__(self, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self._end = time.monotonic() + timeout

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())


def retry_delay(policy: RetryPolicy, attempt: int, error: TandemError, deadline: Deadline) -> float | None:
    """The wait before another attempt of a call that produced nothing yet, or None to raise `error`
    (not retryable, out of attempts, or the wait would outlast the deadline)."""
    hint = error.retry_after if isinstance(error, Overloaded | Unavailable) else None
    retryable = isinstance(error, Unavailable) or (isinstance(error, Overloaded) and hint is not None)
    if not retryable or attempt >= policy.max_attempts:
        return None
    delay = policy.delay(attempt) if hint is None else hint
    return delay if delay < deadline.remaining() else None


class Connection:
    """Settings of one client; opens the channel with either grpc API (`grpc` or `grpc.aio`)."""

    def __init__(
        self,
        target: str,
        api_key: str | None,
        tls: bool | TLSConfig,
        timeout: float,
        retry: RetryPolicy,
        channel_options: Sequence[tuple[str, Any]],
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.target = target
        self.tls = TLSConfig() if tls is True else tls or None
        self.timeout = timeout
        self.retry = retry
        self.channel_options = [("grpc.primary_user_agent", USER_AGENT), *KEEPALIVE_OPTIONS, *channel_options]
        if self.tls is not None and self.tls.server_name:
            self.channel_options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {key}"),) if key else ()

    def open_channel(self, api: ModuleType) -> Any:
        """A channel of `api` (grpc for Client, grpc.aio for AsyncClient) to the target."""
        if self.tls is None:
            return api.insecure_channel(self.target, options=self.channel_options)
        credentials = grpc.ssl_channel_credentials(
            self.tls.root_certificates, self.tls.private_key, self.tls.certificate_chain)
        return api.secure_channel(self.target, credentials, options=self.channel_options)

    def deadline(self, timeout: float | None) -> Deadline:
        """The deadline of a call: its own timeout, else the client's default."""
        return Deadline(self.timeout if timeout is None else timeout)
