"""The asyncio client: `generate` is an async iterator of Chunks, `complete` and `chat` await a Completion.

Same behaviour as the blocking Client: closing a stream cancels the call on the server, and
UNAVAILABLE is retried with backoff until the first chunk arrives, never after.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Mapping, Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc
import grpc.aio

from tandem.client.connection import (
    DEFAULT_TARGET, DEFAULT_TIMEOUT_S, Connection, Deadline, RetryPolicy, TLSConfig, retry_delay,
)
from tandem.client.request import GenerateOptions, build_request
from tandem.client.types import Chunk, ChunkDecoder, Completion, CompletionBuilder, ModelInfo, model_from_pb
from tandem.errors import error_from_rpc
from tandem.v1 import gateway_pb2, gateway_pb2_grpc


class AsyncChunkStream:
    """The chunks of one Generate call as they arrive. `aclose()` (or leaving `async with`) cancels
    the call on the server; a stream dropped before its end (`break` out of `async for`) is
    cancelled as soon as the event loop finalizes it."""

    def __init__(self, chunks: AsyncGenerator[Chunk, None]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class AsyncClient:
    """An asyncio connection to a Tandem gateway's gRPC door; same arguments as `Client`.

    The channel opens on the first call and belongs to that call's event loop: use one
    AsyncClient per loop, and `await client.close()` (or `async with`) when done.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        api_key: str | None = None,
        *,
        tls: bool | TLSConfig = False,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._connection = Connection(target, api_key, tls, timeout, retry, channel_options)
        self._channel: grpc.aio.Channel | None = None
        self._stub_instance: gateway_pb2_grpc.GenerateServiceStub | None = None

    def generate(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
                 timeout: float | None = None, **options: Unpack[GenerateOptions]) -> AsyncChunkStream:
        """Streams the generation for a text prompt or a list of token ids (give one)."""
        request = build_request(options, prompt=prompt, token_ids=token_ids)
        return AsyncChunkStream(self._stream(request, self._connection.deadline(timeout)))

    async def complete(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
                       timeout: float | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """The whole generation for a text prompt or a list of token ids."""
        return await _collect(self.generate(prompt, token_ids, timeout=timeout, **options))

    def chat_stream(self, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None,
                    **options: Unpack[GenerateOptions]) -> AsyncChunkStream:
        """Streams the reply to `[{"role": ..., "content": ...}, ...]`, rendered by the server's chat template."""
        request = build_request(options, messages=messages)
        return AsyncChunkStream(self._stream(request, self._connection.deadline(timeout)))

    async def chat(self, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None,
                   **options: Unpack[GenerateOptions]) -> Completion:
        """The whole reply to a conversation (see `chat_stream`)."""
        return await _collect(self.chat_stream(messages, timeout=timeout, **options))

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the deployment serves."""
        deadline = self._connection.deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._stub.ListModels(
                    gateway_pb2.ListModelsRequest(), timeout=deadline.remaining(), metadata=self._connection.metadata)
                return [model_from_pb(card) for card in response.models]
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                delay = retry_delay(self._connection.retry, attempt, error, deadline)
                if delay is None:
                    raise error from exc
            await asyncio.sleep(delay)

    async def close(self) -> None:
        """Closes the channel; streams still open fail with Cancelled."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub_instance = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    @property
    def _stub(self) -> gateway_pb2_grpc.GenerateServiceStub:
        if self._stub_instance is None:
            self._channel = self._connection.open_channel(grpc.aio)
            self._stub_instance = gateway_pb2_grpc.GenerateServiceStub(self._channel)
        return self._stub_instance

    async def _stream(self, request: gateway_pb2.GenerateRequest, deadline: Deadline) -> AsyncGenerator[Chunk, None]:
        for attempt in itertools.count(1):
            call = self._stub.Generate(request, timeout=deadline.remaining(), metadata=self._connection.metadata)
            decoder = ChunkDecoder()
            try:
                async for msg in call:
                    yield decoder.decode(msg)
                return
            except grpc.aio.AioRpcError as exc:
                error = error_from_rpc(exc)
                error.request_id = decoder.request_id or None
                delay = None if decoder.started else retry_delay(self._connection.retry, attempt, error, deadline)
                if delay is None:
                    raise error from exc
            finally:
                call.cancel()
            await asyncio.sleep(delay)


async def _collect(stream: AsyncChunkStream) -> Completion:
    builder = CompletionBuilder()
    async with stream:
        async for chunk in stream:
            builder.add(chunk)
    return builder.build()
