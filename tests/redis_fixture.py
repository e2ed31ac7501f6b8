"""A real `redis-server` on a free loopback port for tests (pytest plugin: `pytest_plugins = ["tests.redis_fixture"]`).

`redis_server` (session) is shared; `private_redis` (function) is one a test may stop and
restart, e.g. to check that the scheduler degrades and recovers.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cli.ports import free_port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server process without persistence; start() and stop() may be repeated (same port)."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError("redis-server not found: install it with `apt-get install -y redis-server`")
        self.executable = executable
        self.port = port or free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        args = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir)]
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.workdir / f"redis-{self.port}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING:\n{tail}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
