"""The network of the compose topology test: as root with iproute2, one network namespace per
service on a private bridge, the compose names in each namespace's /etc/hosts (so the compose
file's addresses run unmodified); otherwise a free loopback port per (service, port), rewritten.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import socket
import subprocess
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tandem.cli.ports import free_port

LISTEN_FLAGS = ("--port", "--http-port", "--metrics-port")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0")
ADDRESS = re.compile(r"(?<![\w.-])([A-Za-z0-9][\w.-]*):(\d+)\b")
RUN_PREFIX = "tandem-compose-"  # namespaces are RUN_PREFIX<pid>-<service>
SUBNET = "10.213.0"  # a /24 inside this run's own namespaces, none of which has a route out
ETC_NETNS = Path("/etc/netns")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class ComposeNetwork(Protocol):
    """Where the services' addresses and ports live on this machine."""

    kind: str

    def exec_prefix(self, service: str) -> list[str]:
        """What runs a program inside `service`'s network (as `docker compose exec` does)."""

    def port(self, service: str, port: int) -> int:
        """The port that the service's container port `port` listens on here."""

    def rewrite(self, service: str, text: str) -> str:
        """A command argument or variable of `service`, its addresses made reachable here."""

    def publish(self, service: str, port: int) -> str:
        """A loopback HOST:PORT of this process reaching `service`'s port (compose `ports:`)."""

    def serve_here(self, service: str, port: int) -> int:
        """The loopback port where a server in this process answers for `service:port`."""

    def close(self) -> None: ...


def open_network(services: dict[str, Any]) -> ComposeNetwork:
    """Namespaces when root with `ip`; loopback ports otherwise, or when namespaces fail."""
    if os.geteuid() == 0 and shutil.which("ip"):
        try:
            return NamespaceNetwork.create(list(services))
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            warnings.warn(f"network namespaces unavailable ({detail}); the services run on loopback ports")
    return LoopbackNetwork.build(services)


# --- Loopback: each (service, container port) gets a free port of 127.0.0.1 ---------------------


def _strings(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    check = service.get("healthcheck", {}).get("test", [])
    return [*command, *check, *map(str, service.get("environment", {}).values())]


def _endpoints(services: dict[str, Any]) -> set[tuple[str, int]]:
    """Every (service, container port) the file listens on or refers to."""
    endpoints: set[tuple[str, int]] = set()
    for name, service in services.items():
        command = service.get("command", [])
        endpoints |= {(name, int(command[i + 1])) for i, arg in enumerate(command[:-1]) if arg in LISTEN_FLAGS}
        for text in _strings(service):
            for host, port in ADDRESS.findall(text):
                if host in LOOPBACK_HOSTS:
                    endpoints.add((name, int(port)))
                elif host in services:
                    endpoints.add((host, int(port)))
    return endpoints


@dataclass(slots=True)
class LoopbackNetwork:
    """Every service on this machine's loopback, compose names and ports rewritten to free ports."""

    ports: dict[tuple[str, int], int]
    kind: str = "loopback"

    @classmethod
    def build(cls, services: dict[str, Any]) -> LoopbackNetwork:
        endpoints = sorted(_endpoints(services))
        return cls({endpoint: free_port() for endpoint in endpoints})

    def exec_prefix(self, service: str) -> list[str]:
        return []

    def port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            raise KeyError(f"nothing in the compose file listens on {service}:{port}")
        return self.ports[(service, port)]

    def rewrite(self, service: str, text: str) -> str:
        if text == "0.0.0.0":
            return "127.0.0.1"

        def local_address(match: re.Match[str]) -> str:
            host, port = match.group(1), int(match.group(2))
            owner = service if host in LOOPBACK_HOSTS else host
            return f"127.0.0.1:{self.port(owner, port)}" if (owner, port) in self.ports else match.group(0)

        return ADDRESS.sub(local_address, text)

    def publish(self, service: str, port: int) -> str:
        return f"127.0.0.1:{self.port(service, port)}"

    def serve_here(self, service: str, port: int) -> int:
        return self.port(service, port)

    def close(self) -> None:
        pass


# --- Namespaces: each service its own network, on one bridge, found by its compose name ---------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def socket_in(namespace: str | None) -> socket.socket:
    """A TCP socket of network namespace `namespace` (None: this process's own).

    A socket belongs to the namespace of the thread that made it, so a short-lived thread
    enters the namespace, makes it, and ends.
    """
    if namespace is None:
        return socket.socket()
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            with open(f"/run/netns/{namespace}") as handle:
                if _libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into network namespace {namespace} failed")
            made.append(socket.socket())
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            made.append(exc)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


class PortForward:
    """Relays each TCP connection accepted at an address of one namespace to an address in
    another, as docker's proxy relays a published port to its container."""

    def __init__(self, listen: tuple[str | None, str, int], target: tuple[str | None, str, int]) -> None:
        listen_ns, host, port = listen
        self.target = target
        self.listener = socket_in(listen_ns)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((host, port))
        self.listener.listen()
        self.port: int = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        target_ns, host, port = self.target
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket_in(target_ns)
            try:
                upstream.connect((host, port))
            except OSError:
                client.close()  # the caller sees a refused connection and retries, as with a real port
                upstream.close()
                continue
            self.connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        for sock in (self.listener, *self.connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked on it
            sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # one side closed: the connection is over


def _hosts_file(addresses: dict[str, str]) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    return "\n".join([*lines, *(f"{address} {name}" for name, address in addresses.items())]) + "\n"


def _sweep_stale_runs() -> None:
    """Delete the namespaces and /etc/netns entries of runs whose process died without cleaning up."""
    listing = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=30)
    for line in listing.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = re.fullmatch(re.escape(RUN_PREFIX) + r"(\d+)-.+", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


@dataclass(slots=True)
class NamespaceNetwork:
    """A namespace per service with one veth on a bridge, which lives in a namespace of its own
    (`-bridge`) so that nothing is added to this machine's own network."""

    run: str
    addresses: dict[str, str]  # service -> its address on the bridge
    namespaces: list[str] = field(default_factory=list)  # made so far, to delete
    forwards: list[PortForward] = field(default_factory=list)
    made_etc_netns: bool = False
    kind: str = "namespaces"

    @classmethod
    def create(cls, services: list[str]) -> NamespaceNetwork:
        _sweep_stale_runs()
        addresses = {name: f"{SUBNET}.{index}" for index, name in enumerate(services, start=2)}
        network = cls(f"{RUN_PREFIX}{os.getpid()}", addresses)
        try:
            network._build()
        except BaseException:
            network.close()
            raise
        return network

    def namespace(self, service: str) -> str:
        return f"{self.run}-{service}"

    def _build(self) -> None:
        bridge = f"{self.run}-bridge"
        self._add_namespace(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        self.made_etc_netns = not ETC_NETNS.exists()
        hosts = _hosts_file(self.addresses)
        for index, (service, address) in enumerate(self.addresses.items()):
            namespace = self.namespace(service)
            self._add_namespace(namespace)
            _ip("-n", bridge, "link", "add", f"veth{index}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("-n", bridge, "link", "set", f"veth{index}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # `ip netns exec` binds these over /etc/hosts and /etc/resolv.conf: names resolve as in
            # compose, and no DNS query is ever sent (there is no nameserver and no route out).
            etc = ETC_NETNS / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "resolv.conf").write_text("# compose service names are in /etc/hosts\n")
        # Fail here, and fall back to loopback, if processes or sockets cannot enter a namespace.
        _ip("netns", "exec", bridge, "true")
        socket_in(bridge).close()

    def _add_namespace(self, name: str) -> None:
        self.namespaces.append(name)
        _ip("netns", "add", name)

    def exec_prefix(self, service: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(service)]

    def port(self, service: str, port: int) -> int:
        return port

    def rewrite(self, service: str, text: str) -> str:
        return text

    def publish(self, service: str, port: int) -> str:
        forward = PortForward((None, "127.0.0.1", 0), (self.namespace(service), self.addresses[service], port))
        self.forwards.append(forward)
        return f"127.0.0.1:{forward.port}"

    def serve_here(self, service: str, port: int) -> int:
        local = free_port()
        self.forwards.append(PortForward((self.namespace(service), "0.0.0.0", port), (None, "127.0.0.1", local)))
        return local

    def close(self) -> None:
        for forward in self.forwards:
            forward.close()
        for namespace in reversed(self.namespaces):  # the bridge's last: its veth ends go with it
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
            shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)
        if self.made_etc_netns:
            with contextlib.suppress(OSError):
                ETC_NETNS.rmdir()  # only when empty: another run may be using it
