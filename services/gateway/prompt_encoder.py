"""Prompts to token ids off the event loop: a request's text prompt or chat messages are encoded in
a small thread pool, at most `threads` at a time, so a long prompt never stalls the other streams,
/health or the gRPC health service that the loop serves meanwhile.

A request waits for a slot on the loop (cancellable: a client that leaves before its turn costs
nothing); a slot is held until its encoding really ends, so cancelled requests never pile work up
in the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from jinja2 import TemplateError

from services.common.errors import InvalidRequest
from services.common.tokenizer import TextCodec
from services.gateway.request import GenerationRequest

DEFAULT_THREADS = 2


class PromptEncoder:
    """Encodes the prompt field of validated requests, each with its model's codec (one pool for
    every model the gateway serves). Call `close()` when done with it."""

    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"PromptEncoder needs at least one thread, got {threads}")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._slots = asyncio.Semaphore(threads)

    async def encode(self, request: GenerationRequest, field: str, codec: TextCodec) -> list[int]:
        """The prompt's token ids by `codec`; `field` is the prompt field validation found set.
        InvalidRequest when the chat template rejects the messages."""
        if field == "token_ids":
            return list(request.token_ids or [])
        if field == "prompt":
            return await self._run(codec.encode, request.prompt or "")
        return await self._run(_chat, codec, request.messages or [], request.tools)

    def close(self) -> None:
        """Stop the threads once their current work ends; waiting work is dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, work: Callable[..., list[int]], *args: object) -> list[int]:
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            job: Future[list[int]] = self._pool.submit(work, *args)
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._slots.release))
        return await asyncio.wrap_future(job)



def _chat(codec: TextCodec, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    try:
        return codec.apply_chat_template(messages, tools)
    except TemplateError as exc:
        raise InvalidRequest("messages", f"the model's chat template rejects them: {exc}") from None
