"""The blocking client: `generate` streams Chunks, `complete` and `chat` return a whole Completion.

Closing a stream (leaving its `with` block, or breaking out of a loop over it) cancels the call
on the server. UNAVAILABLE is retried with backoff until the first chunk arrives, never after.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator, Mapping, Sequence
from types import TracebackType
from typing import Any, Unpack

import grpc

from tandem.client.connection import (
    DEFAULT_TARGET, DEFAULT_TIMEOUT_S, Connection, Deadline, RetryPolicy, TLSConfig, retry_delay,
)
from tandem.client.request import GenerateOptions, build_request
from tandem.client.types import Chunk, ChunkDecoder, Completion, CompletionBuilder, ModelInfo, model_from_pb
from tandem.errors import error_from_rpc
from tandem.v1 import gateway_pb2, gateway_pb2_grpc


class ChunkStream:
    """The chunks of one Generate call as they arrive. `close()` cancels the call on the server;
    so does dropping the stream before its end (e.g. `break` in `for chunk in client.generate(...)`)."""

    def __init__(self, chunks: Generator[Chunk, None, None]) -> None:
        self._chunks = chunks

    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Client:
    """A blocking connection to a Tandem gateway's gRPC door (see `AsyncClient` for asyncio).

    `api_key` (default: $TANDEM_API_KEY) goes as `authorization: Bearer KEY`; `tls` is False for
    plaintext, True for TLS with the system's roots, or a TLSConfig; `timeout` is the default
    deadline of every call in seconds. A call's own `timeout=` overrides it; either counts from
    the call (`generate()` included) to the end of its stream, retries included. The options of
    generate/complete/chat are those of `GenerateOptions`.
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
        self._channel: grpc.Channel = self._connection.open_channel(grpc)
        self._stub = gateway_pb2_grpc.GenerateServiceStub(self._channel)

    def generate(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
                 timeout: float | None = None, **options: Unpack[GenerateOptions]) -> ChunkStream:
        """Streams the generation for a text prompt or a list of token ids (give one)."""
        request = build_request(options, prompt=prompt, token_ids=token_ids)
        return ChunkStream(self._stream(request, self._connection.deadline(timeout)))

    def complete(self, prompt: str | None = None, token_ids: Sequence[int] | None = None, *,
                 timeout: float | None = None, **options: Unpack[GenerateOptions]) -> Completion:
        """The whole generation for a text prompt or a list of token ids."""
        return _collect(self.generate(prompt, token_ids, timeout=timeout, **options))

    def chat_stream(self, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None,
                    **options: Unpack[GenerateOptions]) -> ChunkStream:
        """Streams the reply to `[{"role": ..., "content": ...}, ...]`, rendered by the server's chat template."""
        request = build_request(options, messages=messages)
        return ChunkStream(self._stream(request, self._connection.deadline(timeout)))

    def chat(self, messages: Sequence[Mapping[str, str]], *, timeout: float | None = None,
             **options: Unpack[GenerateOptions]) -> Completion:
        """The whole reply to a conversation (see `chat_stream`)."""
        return _collect(self.chat_stream(messages, timeout=timeout, **options))

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the deployment serves."""
        deadline = self._connection.deadline(timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=deadline.remaining(),
                                                 metadata=self._connection.metadata)
                return [model_from_pb(card) for card in response.models]
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                delay = retry_delay(self._connection.retry, attempt, error, deadline)
                if delay is None:
                    raise error from exc
            time.sleep(delay)

    def close(self) -> None:
        """Closes the channel; streams still open fail with Cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _stream(self, request: gateway_pb2.GenerateRequest, deadline: Deadline) -> Generator[Chunk, None, None]:
        for attempt in itertools.count(1):
            call = self._stub.Generate(request, timeout=deadline.remaining(), metadata=self._connection.metadata)
            decoder = ChunkDecoder()
            try:
                for msg in call:
                    yield decoder.decode(msg)
                return
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                error.request_id = decoder.request_id or None
                delay = None if decoder.started else retry_delay(self._connection.retry, attempt, error, deadline)
                if delay is None:
                    raise error from exc
            finally:
                call.cancel()
            time.sleep(delay)


def _collect(stream: ChunkStream) -> Completion:
    builder = CompletionBuilder()
    with stream:
        for chunk in stream:
            builder.add(chunk)
    return builder.build()
