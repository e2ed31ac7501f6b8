"""Listen ports a launcher hands to the services it starts (`tandem up`, the tests' clusters).

A port from bind(0) comes from the kernel's ephemeral range, the range every outgoing connection's
local port is drawn from too: between our close and the child's bind, a connection (a gRPC client,
a Redis client) may take it. So ports come from below that range, in order from a random start per
process (two launchers seldom meet), each checked free by a bind, none handed out twice.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below this lie well-known services' ports (Redis 6379, HTTP 8000-8080, ...)
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, for systems without /proc


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's (first, last) ephemeral port."""
    try:
        first, last = path.read_text().split()
        return int(first), int(last)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def quiet_ports(ephemeral: tuple[int, int]) -> range:
    """The ports no outgoing connection takes: below the ephemeral range, or above it when the
    range starts too low to leave room there."""
    first, last = ephemeral
    below, above = range(LOWEST, first), range(max(last + 1, LOWEST), 65536)
    return below if len(below) >= len(above) else above


class PortPool:
    """Hands out quiet ports free on `host` now, each once. Call order: take(), take(), ..."""

    def __init__(self, ports: range, start: int | None = None) -> None:
        if not ports:
            raise RuntimeError(f"no port outside the ephemeral range {ephemeral_range()}: widen it in "
                               f"{EPHEMERAL_RANGE} or pass the services' ports explicitly")
        self._ports = ports
        self._next = random.randrange(len(ports)) if start is None else start
        self._given = 0

    def take(self, host: str = "127.0.0.1") -> int:
        while self._given < len(self._ports):
            port = self._ports[self._next % len(self._ports)]
            self._next += 1
            self._given += 1
            if _bindable(host, port):
                return port
        raise RuntimeError(f"every port of {self._ports.start}-{self._ports.stop - 1} was handed out or taken")


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as sock:
            sock.bind((host, port))
        return True
    except OSError:
        return False


_pool: PortPool | None = None
_pool_pid = 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range, never handed out before in this process."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():  # a forked child draws its own start
        _pool, _pool_pid = PortPool(quiet_ports(ephemeral_range())), os.getpid()
    return _pool.take(host)
