"""`n` independent samples of each of a request's prompts (the OpenAI `n`, and /v1/completions'
list of prompts), as generations of the shared pipeline whose chunks are merged in arrival
order, each tagged with its choice index: choice i of prompt p has index p * n + i. A request of
one choice is read straight from its generation, as fast as the client takes its chunks.

KV sharing: choice 0 is submitted alone and the others only once its first token arrived. By then
the prompt has been prefilled and its full blocks sit in the prefill worker's prefix cache, so
the other choices reuse them instead of computing the prompt n times. (Only full blocks are
cached, and a prefill worker that evicts them under pressure, or routing to another prefill
worker, makes the sharing partial; the results stay exact either way.)
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from services.gateway.generation import Generation, GenerationPipeline
from services.gateway.output import Chunk
from services.gateway.request import GenerationRequest

SEED_MODULUS = 1 << 64  # seeds are uint64 on the wire


class ChoiceSet:
    """The generations of one request's choices. Call order: `start()` (submits choice 0 of each
    prompt and waits for its first chunk, so failures before any output raise there), then
    `chunks()`, and `close()` in every case: it cancels whatever still runs upstream.

    Choice i > 0 of a prompt has request id "<id of its choice 0>-i" and, when a seed is given,
    seed + i, so choice 0 draws exactly what the same request with n = 1 draws.
    """

    def __init__(self, pipeline: GenerationPipeline, requests: list[GenerationRequest], n: int,
                 timeout: float) -> None:
        self._pipeline = pipeline
        self._requests = requests
        self._n = n
        self._timeout = timeout
        self._generations: list[Generation] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: asyncio.Queue[tuple[int, Chunk | Exception | None]] = asyncio.Queue()
        self._firsts: list[tuple[int, Chunk]] = []
        self._only: AsyncIterator[Chunk] | None = None  # the rest of the one choice, when there is one: no merging
        self.trace_id = ""  # of the first prompt's choice 0, once validated

    async def start(self) -> None:
        """Validate every prompt's choice 0 (so a bad prompt fails the request before any work),
        then for each prompt in turn: submit choice 0, wait for its first chunk, submit the others."""
        firsts = []
        for request in self._requests:
            firsts.append(await self._pipeline.start(request, self._timeout))
            self._generations.append(firsts[-1])
        self.trace_id = firsts[0].trace_id
        for number, (request, first) in enumerate(zip(self._requests, firsts)):
            await self._start_prompt(number * self._n, request, first)

    async def chunks(self) -> AsyncIterator[tuple[int, Chunk]]:
        """(choice index, chunk) until every choice finished; the first failure raises."""
        if len(self._firsts) != len(self._requests):
            raise RuntimeError("ChoiceSet.chunks() called before start()")
        for first in self._firsts:
            yield first
        if self._only is not None:
            async for chunk in self._only:
                yield 0, chunk
            return
        running = self._n * len(self._requests)
        while running:
            index, item = await self._queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    def close(self) -> None:
        """Stop every choice; upstream calls still running are cancelled. Idempotent."""
        for task in self._tasks:
            task.cancel()
        for generation in self._generations:
            generation.close()

    async def _start_prompt(self, base: int, request: GenerationRequest, first: Generation) -> None:
        first_chunks = aiter(first)
        self._firsts.append((base, await anext(first_chunks)))
        if self._n * len(self._requests) == 1:
            self._only = first_chunks
            return
        self._tasks.append(asyncio.create_task(self._pump(base, first_chunks)))
        for index in range(1, self._n):
            generation = await self._pipeline.start(_sibling(request, index, first.request_id), self._timeout)
            self._generations.append(generation)
            self._tasks.append(asyncio.create_task(self._pump(base + index, aiter(generation))))

    async def _pump(self, index: int, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, None))
        except Exception as error:  # handed to the reader of chunks(), which raises it
            self._queue.put_nowait((index, error))


def _sibling(request: GenerationRequest, index: int, first_id: str) -> GenerationRequest:
    sampling = request.sampling
    seed = None if sampling.seed is None else (sampling.seed + index) % SEED_MODULUS
    return dataclasses.replace(request, request_id=f"{first_id}-{index}",
                               sampling=dataclasses.replace(sampling, seed=seed))
