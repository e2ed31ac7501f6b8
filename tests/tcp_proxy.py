"""A loopback TCP relay for fault tests: it passes bytes between a client and `upstream` until the
test breaks the connections open now on one side only, as a network path that dies under one peer
does. `silence()` drops what either side (or one) sends on them, their sockets kept open; `reset_clients()`
then resets their client side, while their upstream side stays open until `stop()`: the server
still holds the old connection and its calls, and never hears what was sent into the silence.
Connections opened afterwards are relayed normally.
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field

_CHUNK = 65536


@dataclass(slots=True)
class _Pair:
    """One relayed connection: the client's socket and ours to upstream."""

    client: socket.socket
    upstream: socket.socket
    to_upstream_silenced: bool = False
    to_client_silenced: bool = False
    cut: bool = False

    @property
    def silenced(self) -> bool:
        return self.to_upstream_silenced or self.to_client_silenced
    threads: list[threading.Thread] = field(default_factory=list)


class TcpProxy:
    """Call order: start(upstream) -> (clients dial the address it returns) -> silence() -> reset_clients()
    -> stop()."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._upstream: tuple[str, int] | None = None
        self._pairs: list[_Pair] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._acceptor = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)

    def start(self, upstream: str) -> str:
        """Relay to `upstream` from now on; returns the address to dial instead."""
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._acceptor.start()
        return self.address

    @property
    def connections(self) -> int:
        """Connections opened so far (cut ones included)."""
        with self._lock:
            return len(self._pairs)

    def silence(self, to_upstream: bool = True, to_client: bool = True) -> int:
        """From now on, drop what the client sends (`to_upstream`) and what upstream sends (`to_client`)
        on the connections open now; how many there are."""
        with self._lock:
            live = [pair for pair in self._pairs if not pair.cut]
            for pair in live:
                pair.to_upstream_silenced |= to_upstream
                pair.to_client_silenced |= to_client
        return len(live)

    def reset_clients(self) -> None:
        """Reset the client side of every silenced connection (an RST, as a dead path ends); the
        upstream side stays open."""
        with self._lock:
            silenced = [pair for pair in self._pairs if pair.silenced and not pair.cut]
            for pair in silenced:
                pair.cut = True
        for pair in silenced:
            pair.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            pair.client.shutdown(socket.SHUT_RD)  # wakes its pump, sends nothing
            pair.client.close()  # lingering 0 s: an RST

    def stop(self) -> None:
        self._stopping = True
        self._listener.close()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            for sock in (pair.client, pair.upstream):
                _close(sock)
        for pair in pairs:
            for thread in pair.threads:
                thread.join(timeout=5)

    def _accept(self) -> None:
        assert self._upstream is not None
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream, timeout=10)
            upstream.settimeout(None)
            pair = _Pair(client, upstream)
            pair.threads = [threading.Thread(target=self._pump, args=(pair, client, upstream, True), daemon=True),
                            threading.Thread(target=self._pump, args=(pair, upstream, client, False), daemon=True)]
            with self._lock:
                self._pairs.append(pair)
            for thread in pair.threads:
                thread.start()

    def _pump(self, pair: _Pair, source: socket.socket, sink: socket.socket, to_upstream: bool) -> None:
        """Relay source -> sink until either ends; a cut pair's upstream is left open."""
        while True:
            try:
                data = source.recv(_CHUNK)
            except OSError:
                break
            if not data:
                break
            if pair.to_upstream_silenced if to_upstream else pair.to_client_silenced:
                continue
            try:
                sink.sendall(data)
            except OSError:
                break
        if not pair.cut:
            for sock in (source, sink):
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
