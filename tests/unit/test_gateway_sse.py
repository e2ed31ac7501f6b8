"""The SSE events of text-only chunks come from a per-choice template: the exact bytes the shaper's
JSON gives, for completions and chat, with text that JSON must escape; other chunks are left to
the JSON path."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.openai_responses import ChatShaper, CompletionShaper, ResponseShaper
from services.gateway.output import Chunk
from services.gateway.sse import DONE, SERVER_SEND, SseResponse, TextTemplates, event, events
from services.gateway.tools import FunctionDefinition, Tool, ToolPlan
from tandem.v1 import common_pb2

TEXTS = ["Hello", ' say "hi"\n', "back\\slash\ttab", "é 日本 🌊", "\u2028\x01", "{}[],:"]


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


def shapers() -> list[ResponseShaper]:
    return [CompletionShaper("cmpl-1", 1700000000, "m", token_text, with_logprobs=False),
            ChatShaper("chatcmpl-1", 1700000000, "m/ü", token_text, with_logprobs=False, n=2)]


@pytest.mark.parametrize("shaper", shapers(), ids=["completion", "chat"])
def test_a_text_chunk_is_the_event_its_json_gives(shaper: ResponseShaper) -> None:
    templates = TextTemplates(shaper)
    for index in (0, 1):
        for number, text in enumerate(TEXTS):
            chunk = Chunk([number], text)
            sent = templates.event(index, chunk)
            assert sent == event(shaper.chunk(index, chunk))
            assert json.loads(sent.removeprefix(b"data: "))["choices"][0]["index"] == index


def test_chunks_that_are_not_only_text_are_left_to_the_json() -> None:
    shaper = CompletionShaper("cmpl-1", 0, "m", token_text, with_logprobs=False)
    templates = TextTemplates(shaper)
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=1)
    assert templates.event(0, Chunk([7], "")) is None
    assert templates.event(0, Chunk([7], "end", finish_reason="length", usage=usage)) is None
    assert templates.event(0, Chunk([7], "x", prompt_logprobs=[common_pb2.TokenLogprob(token_id=1)])) is None
    logprobs = TextTemplates(CompletionShaper("cmpl-1", 0, "m", token_text, with_logprobs=True))
    assert logprobs.event(0, Chunk([7], "x", logprobs=[common_pb2.TokenLogprob(token_id=7)])) is None


def test_the_first_echoed_chunk_carries_the_prompt_then_the_template_takes_over() -> None:
    shaper = CompletionShaper("cmpl-1", 0, "m", token_text, with_logprobs=False, echoes=["Once"])
    templates = TextTemplates(shaper)
    assert templates.event(0, Chunk([1], " upon")) is None
    assert json.loads(event(shaper.chunk(0, Chunk([1], " upon"))).removeprefix(b"data: "))["choices"][0]["text"] \
        == "Once upon"
    assert json.loads(templates.event(0, Chunk([2], " a")).removeprefix(b"data: "))["choices"][0]["text"] == " a"


def test_chat_with_tools_is_left_to_the_json() -> None:
    plan = ToolPlan((Tool(type="function", function=FunctionDefinition(name="get_weather")),), "auto")
    shaper = ChatShaper("chatcmpl-1", 0, "m", token_text, with_logprobs=False, tools=plan)
    assert TextTemplates(shaper).event(0, Chunk([1], "Hi")) is None


async def _stream_with(scope_send: bool, body: list[bytes]) -> tuple[list[dict], list[dict], list[str]]:
    """Run an SseResponse over `body`: the messages to the app's send and to the server's own
    (sse.SERVER_SEND, when the scope has it), and what closed."""
    through_app: list[dict] = []
    to_server: list[dict] = []
    closed: list[str] = []

    async def events():
        for item in body:
            yield item

    async def app_send(message: dict) -> None:
        through_app.append(message)

    async def server_send(message: dict) -> None:
        to_server.append(message)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    scope = {"type": "http", **({SERVER_SEND: server_send} if scope_send else {})}
    await SseResponse(events(), lambda: closed.append("closed"))(scope, receive, app_send)
    return through_app, to_server, closed


async def test_the_start_goes_through_the_app_and_the_events_to_the_server() -> None:
    through_app, to_server, closed = await _stream_with(True, [b"data: 1\n\n", DONE])
    assert [message["type"] for message in through_app] == ["http.response.start"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in through_app[0]["headers"]
    assert [(message["body"], message["more_body"]) for message in to_server] == \
        [(b"data: 1\n\n", True), (DONE, False)]  # the sentinel's write ends the body
    assert closed == ["closed"]


async def test_a_body_that_does_not_end_with_the_sentinel_is_ended_by_an_empty_message() -> None:
    _, to_server, closed = await _stream_with(True, [b"data: 1\n\n", b"data: 2\n\n"])
    assert [(message["body"], message["more_body"]) for message in to_server] == \
        [(b"data: 1\n\n", True), (b"data: 2\n\n", True), (b"", False)]
    assert closed == ["closed"]


async def test_without_the_servers_send_every_message_goes_through_the_app() -> None:
    through_app, to_server, closed = await _stream_with(False, [DONE])
    assert [(message["type"], message.get("more_body")) for message in through_app] == \
        [("http.response.start", None), ("http.response.body", False)]
    assert to_server == [] and closed == ["closed"]


class _Choices:
    """A ChoiceSet's chunks() over given chunks, then a failure when given one."""

    def __init__(self, chunks: list[Chunk], failure: Exception | None = None) -> None:
        self._chunks = chunks
        self._failure = failure

    async def chunks(self):
        for chunk in self._chunks:
            yield 0, chunk
        if self._failure is not None:
            raise self._failure


async def _body(choices: _Choices, include_usage: bool) -> list[bytes]:
    shaper = CompletionShaper("cmpl-1", 1700000000, "m", token_text, with_logprobs=False)
    return [item async for item in events(shaper, choices, 1, include_usage)]  # type: ignore[arg-type]


async def test_the_usage_event_and_the_sentinel_are_one_chunk_after_the_text() -> None:
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=2)
    chunks = [Chunk([1], "Hi"), Chunk([2], "!", finish_reason="length", usage=usage)]
    body = await _body(_Choices(chunks), include_usage=True)
    shaper = CompletionShaper("cmpl-1", 1700000000, "m", token_text, with_logprobs=False)
    assert body == [event(shaper.chunk(0, chunks[0])), event(shaper.chunk(0, chunks[1])),
                    event(shaper.usage_chunk([usage])) + DONE]
    assert (await _body(_Choices(chunks), include_usage=False))[2:] == [DONE]


async def test_a_failure_is_one_error_event_joined_to_the_sentinel() -> None:
    body = await _body(_Choices([Chunk([1], "Hi")], RuntimeError("bug")), include_usage=True)
    assert len(body) == 2 and body[1].endswith(DONE) and body[1].count(b"data: ") == 2
    assert json.loads(body[1].removesuffix(DONE)[len(b"data: "):])["error"]["code"] == "internal_error"


async def test_a_client_that_leaves_ends_the_body_and_closes() -> None:
    cancelled = asyncio.Event()
    closed: list[str] = []

    async def events():
        yield b"data: 1\n\n"
        try:
            await asyncio.Event().wait()  # the next token never comes
        except asyncio.CancelledError:
            cancelled.set()
            raise
        yield DONE

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        while len(sent) < 2:  # the start and the first event
            await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    await asyncio.wait_for(SseResponse(events(), lambda: closed.append("closed"))({"type": "http"}, receive, send), 10)
    assert closed == ["closed"]
    await asyncio.wait_for(cancelled.wait(), 10)
    assert [message.get("body") for message in sent] == [None, b"data: 1\n\n"]
