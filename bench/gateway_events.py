"""The gateway's own CPU per streamed event, in one process: from the relay's push of a worker's
token event to the SSE bytes handed to the HTTP server's send, through the real Generation,
ChoiceSet, OutputAssembler (incremental detokenizing), TextTemplates and SseResponse, with uvloop.

`bench/gateway_stream.py` measures the whole gateway (gRPC's threads, the sockets, the HTTP
server) and swings by 10% or more on a loaded machine, more than a change to the gateway's own code
per event moves it. This point leaves the rest out: no gRPC (the attempt's placement and streams
are stand-ins; events are pushed into each request's relay as the Follow reader pushes them), no
socket (a stand-in for uvicorn's send frames the chunks as it does into memory). `--streams`
requests each get one event of one token per pass of the loop, as a worker's decode step gives
them; a round is `--tokens` passes; the figure is the process CPU per event of the best and the
median round after the warm-up ones, the events built before each round so their building is not
counted. Reaches into the pipeline's private parts (Generation._place, ChoiceSet's first chunk):
a change there shows as a failure of its unit test (tests/unit/test_bench_gateway_events.py).

Run: `.venv/bin/python bench/gateway_events.py [--streams 8] [--tokens 128] [--rounds 30] [--json]
[--profile N]` (N: cProfile's top N functions by own time, after the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402
from opentelemetry import trace  # noqa: E402

from bench.control_plane import cpu_model, loadavg  # noqa: E402
from services.common.metrics import ServiceMetrics  # noqa: E402
from services.common.model_store import default_model_dir  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.tokenizer import TextCodec  # noqa: E402
from services.common.tracing import TokenTimings  # noqa: E402
from services.gateway import sse  # noqa: E402
from services.gateway.choices import ChoiceSet  # noqa: E402
from services.gateway.generation import Generation  # noqa: E402
from services.gateway.openai_responses import CompletionShaper  # noqa: E402
from services.gateway.output import OutputAssembler, OutputOptions  # noqa: E402
from tandem.v1 import common_pb2, scheduler_pb2  # noqa: E402

WARMUP_ROUNDS = 3
TEXT = "The quick brown fox jumps over the lazy dog and keeps running along the river bank. "


@dataclass(slots=True)
class Result:
    streams: int
    tokens: int
    rounds: int  # measured, after the warm-up ones
    best_us_per_event: float
    median_us_per_event: float
    loadavg_before: str
    loadavg_after: str
    cpu: str
    bodies: list[bytes] = field(default_factory=list, repr=False)  # each stream's HTTP body, of the last round


class _Upstream:
    """Generation asks it only for the request's first scheduler."""

    def first_turn(self, submit: scheduler_pb2.SubmitRequest) -> int:
        return 0


class _Attempt:
    """What Generation reads of an attempt once placed: its placement, settle and close."""

    placement = scheduler_pb2.Placement(queue_ms=1.0)
    scheduler_lost = False

    def close(self) -> None:
        pass

    async def settled(self, timeout: float) -> None:
        pass


class _ServerSend:
    """uvicorn's send for a response body with chunked encoding, into memory."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.complete = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start" or self.complete:
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        content = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
        if not more:
            content.append(b"0\r\n\r\n")
            self.complete = True
        self.body += b"".join(content)


class _Stream:
    """One request: its Generation (whose relay takes the events) and its SSE response running."""

    def __init__(self, codec: TextCodec, metrics: ServiceMetrics, tokens: int) -> None:
        prompt = [1, 2, 3]
        assembler = OutputAssembler(codec, OutputOptions(SamplingParams(max_tokens=tokens, ignore_eos=True)), prompt)
        span = trace.get_tracer(__name__).start_span("bench")
        self.generation = Generation("bench", "", prompt, _Upstream(), scheduler_pb2.SubmitRequest(), (),
                                     time.monotonic() + 600, assembler, span, TokenTimings(), metrics)

        async def place() -> _Attempt:
            return _Attempt()

        self.generation._place = place  # type: ignore[method-assign]
        self.shaper = CompletionShaper("cmpl-bench", 0, "m", lambda token_id: codec.decode([token_id]),
                                       with_logprobs=False)
        self.send = _ServerSend()

    async def respond(self) -> None:
        """As HttpBridge does once ChoiceSet.start() took the first chunk: the SSE response."""
        choices = ChoiceSet(None, [None], 1, 600)  # type: ignore[arg-type]
        chunks = aiter(self.generation)
        choices._firsts.append((0, await anext(chunks)))
        choices._only = chunks
        response = sse.SseResponse(sse.events(self.shaper, choices, 1, False), choices.close)
        await response._stream(self.send, self.send)


def token_events(token_ids: list[int], tokens: int) -> list[list[scheduler_pb2.TokenEvent]]:
    """Per output offset, the event of that token (as a decode step's), the last with the finish reason and usage."""
    events = []
    for offset in range(tokens):
        event = scheduler_pb2.TokenEvent(request_id="bench", output_offset=offset, worker_id="w",
                                         token_ids=[token_ids[offset % len(token_ids)]])
        event.timings.decode_ms = 1.0
        if offset == tokens - 1:
            event.finish_reason = common_pb2.FINISH_REASON_LENGTH
            event.usage.prompt_tokens, event.usage.completion_tokens = 3, tokens
        events.append(event)
    return events


async def one_round(codec: TextCodec, metrics: ServiceMetrics, token_ids: list[int], streams: int,
                    tokens: int) -> tuple[float, list[bytes]]:
    """Process CPU seconds of one round's events, and each stream's body."""
    requests = [_Stream(codec, metrics, tokens) for _ in range(streams)]
    events = [token_events(token_ids, tokens) for _ in requests]
    tasks = [asyncio.ensure_future(request.respond()) for request in requests]
    await asyncio.sleep(0)  # every response waits for its first event
    started = time.process_time()
    for offset in range(tokens):
        for request, its_events in zip(requests, events):
            request.generation._relay.push(its_events[offset])
        await asyncio.sleep(0)  # the requests' tasks take their events, as after a Follow message
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return time.process_time() - started, [bytes(request.send.body) for request in requests]


async def run(codec: TextCodec, streams: int, tokens: int, rounds: int, profile: int = 0) -> Result:
    metrics = ServiceMetrics("m", "gateway")
    token_ids = codec.encode(TEXT * (tokens // 16 + 1))
    load_before, figures, bodies = loadavg(), [], []
    profiler = cProfile.Profile() if profile else None
    for number in range(WARMUP_ROUNDS + rounds):
        if profiler is not None and number == WARMUP_ROUNDS:
            profiler.enable()
        used, bodies = await one_round(codec, metrics, token_ids, streams, tokens)
        if number >= WARMUP_ROUNDS:
            figures.append(used / (streams * tokens) * 1e6)
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    return Result(streams, tokens, rounds, round(min(figures), 2), round(statistics.median(figures), 2),
                  load_before, loadavg(), cpu_model(), bodies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="requests streaming at once (events per loop pass)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request, one an event")
    parser.add_argument("--rounds", type=int, default=30, help="rounds measured, after the warm-up ones")
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (its tokenizer); default: the default model")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N by own time")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    codec = TextCodec.from_model_dir(args.model or default_model_dir())
    result = uvloop.run(run(codec, args.streams, args.tokens, args.rounds, args.profile))
    report = {key: value for key, value in asdict(result).items() if key != "bodies"}
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
