"""Tandem's Python SDK: `Client` (blocking) and `AsyncClient` (asyncio) for the gateway's gRPC door.

    with tandem.Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Once upon a time", max_tokens=32):
            print(chunk.text, end="")
"""

from tandem.client.aio import AsyncChunkStream, AsyncClient
from tandem.client.connection import RetryPolicy, TLSConfig
from tandem.client.request import GenerateOptions
from tandem.client.sync import ChunkStream, Client
from tandem.client.types import Chunk, Completion, ModelInfo, Timings, TokenLogprob, TopLogprob, Usage

__all__ = [
    "AsyncChunkStream", "AsyncClient", "Chunk", "ChunkStream", "Client", "Completion", "GenerateOptions", "ModelInfo",
    "RetryPolicy", "TLSConfig", "Timings", "TokenLogprob", "TopLogprob", "Usage",
]
