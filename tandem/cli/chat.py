"""`tandem chat`: a conversation with a running gateway, the reply streamed as it is generated.

Speaks the gateway's OpenAI-compatible HTTP API (`/v1/chat/completions` with `stream: true`),
standard library only, so it works against any Tandem deployment (or any OpenAI-compatible
server). Each line read is a user turn; the conversation so far goes with every request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_WORDS = {"exit", "quit", "/exit", "/quit"}


class ChatError(RuntimeError):
    """The gateway could not be reached or answered with an error (the message says which)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("TANDEM_URL", DEFAULT_URL),
                        help=f"the gateway's HTTP address (env TANDEM_URL; default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                        help="a client API key (env TANDEM_API_KEY; default none)")
    parser.add_argument("--model", help="the model to talk to (default: the first the gateway lists)")
    parser.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    parser.add_argument("--max-tokens", type=int, default=512, metavar="N", help="longest reply (default 512)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the gateway's)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up on a reply after SECONDS (default 600)")
    parser.add_argument("message", nargs="?", help="send this one message, print the reply and exit")


class Gateway:
    """The few calls `tandem chat` makes, with the key and a bounded timeout on each."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s

    def models(self) -> list[dict[str, Any]]:
        """The model cards of GET /v1/models, in the gateway's order."""
        with self._open("GET", "/v1/models") as response:
            return list(json.loads(response.read())["data"])

    def first_model(self) -> str:
        models = self.models()
        if not models:
            raise ChatError(f"{self.url}/v1/models lists no model; pass --model")
        return str(models[0]["id"])

    def stream_reply(self, body: dict[str, Any]) -> Iterator[str]:
        """The reply's text pieces, in order, as the server-sent events arrive."""
        with self._open("POST", "/v1/chat/completions", {**body, "stream": True}) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                yield _delta_text(json.loads(data))

    def _open(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise ChatError(f"{method} {self.url}{path}: HTTP {exc.code}: {_error_message(exc)}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ChatError(f"cannot reach the gateway at {self.url}: {exc}; is it running? (--url)") from exc


def _delta_text(chunk: dict[str, Any]) -> str:
    if "error" in chunk:
        raise ChatError(f"the gateway failed mid-reply: {chunk['error'].get('message', chunk['error'])}")
    return "".join(choice.get("delta", {}).get("content") or "" for choice in chunk.get("choices") or ())


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return exc.reason


def converse(gateway: Gateway, args: argparse.Namespace, lines: Iterator[str], out: TextIO) -> None:
    """Each line is a user turn: its reply streams to `out` and joins the history."""
    model = args.model or gateway.first_model()
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    options: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    for line in lines:
        text = line.strip()
        if text.lower() in EXIT_WORDS:
            return
        if not text:
            continue
        history.append({"role": "user", "content": text})
        reply = []
        for piece in gateway.stream_reply({**options, "messages": history}):
            out.write(piece)
            out.flush()
            reply.append(piece)
        out.write("\n")
        out.flush()
        history.append({"role": "assistant", "content": "".join(reply)})


def _typed_lines(prompt: str) -> Iterator[str]:
    while True:
        try:
            yield input(prompt)
        except EOFError:
            return


def main(args: argparse.Namespace) -> int:
    gateway = Gateway(args.url, args.api_key, args.timeout)
    interactive = args.message is None and sys.stdin.isatty()
    if args.message is not None:
        lines: Iterator[str] = iter([args.message])
    elif interactive:
        print(f"tandem chat: talking to {gateway.url}; an empty line does nothing, Ctrl-D or `exit` ends",
              file=sys.stderr)
        lines = _typed_lines("> ")
    else:
        lines = iter(sys.stdin)
    try:
        converse(gateway, args, lines, sys.stdout)
    except ChatError as exc:
        print(f"\ntandem chat: {exc}", file=sys.stderr)
        return 1
    return 0
