"""`tandem chat` against a stand-in gateway: what it sends, what it prints, how it fails."""

from __future__ import annotations

import argparse
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tandem.cli import chat


class _Gateway(BaseHTTPRequestHandler):
    """Lists one model and streams each reply in two pieces: "echo:" then the last user turn."""

    bodies: list[dict[str, Any]] = []
    keys: list[str | None] = []

    def do_GET(self) -> None:
        self.keys.append(self.headers.get("Authorization"))
        self._send(200, "application/json", json.dumps({"data": [{"id": "tiny"}, {"id": "other"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if body["messages"][-1]["content"] == "too long":
            error = {"error": {"message": "max_tokens is too large", "param": "max_tokens"}}
            return self._send(400, "application/json", json.dumps(error).encode())
        pieces = ["echo:", body["messages"][-1]["content"]]
        events = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
        stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        self._send(200, "text/event-stream", stream)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def gateway_url() -> Iterator[str]:
    _Gateway.bodies, _Gateway.keys = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_line_is_a_turn_and_the_history_goes_with_it(gateway_url: str) -> None:
    args = _args("--url", gateway_url, "--api-key", "k1", "--system", "be brief", "--temperature", "0")
    out = io.StringIO()
    gateway = chat.Gateway(args.url, args.api_key, 5.0)
    chat.converse(gateway, args, iter(["hello\n", "\n", "again\n", "exit\n", "never sent\n"]), out)
    assert out.getvalue() == "echo:hello\necho:again\n"
    assert _Gateway.keys == ["Bearer k1"]
    first, second = _Gateway.bodies
    assert first == {"model": "tiny", "max_tokens": 512, "temperature": 0.0, "stream": True, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]}
    assert second["messages"][1:] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "echo:hello"},
                                      {"role": "user", "content": "again"}]


def test_one_message_from_the_command_line(gateway_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert chat.main(_args("--url", gateway_url, "--model", "other", "hi there")) == 0
    assert capsys.readouterr().out == "echo:hi there\n"
    assert [b["model"] for b in _Gateway.bodies] == ["other"]
    assert _Gateway.keys == []  # --model given: no listing


def test_an_error_answer_is_shown_with_its_message(gateway_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert chat.main(_args("--url", gateway_url, "too long")) == 1
    assert capsys.readouterr().err == (
        f"\ntandem chat: POST {gateway_url}/v1/chat/completions: HTTP 400: max_tokens is too large\n")


def test_no_gateway_says_where_it_looked(capsys: pytest.CaptureFixture[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    port = server.server_port
    server.server_close()  # nothing listens there now
    assert chat.main(_args("--url", f"http://127.0.0.1:{port}", "hi")) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"\ntandem chat: cannot reach the gateway at http://127.0.0.1:{port}: ")
    assert err.endswith("; is it running? (--url)\n")
