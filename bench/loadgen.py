"""Load for the serving benchmark: scenarios, their prompts, one streaming OpenAI client, the statistics.

A scenario is a bounded list of requests (prompt length in words, output tokens) and the rule for when
each starts: a closed loop (at most `concurrency` in flight; the next starts when one ends) or Poisson
arrivals at `rate_per_s` (seeded, so every server gets the same arrival times). Every server gets the
same prompts in the same order through the same client (`stream_completion`: a streaming POST
/v1/completions, greedy, `ignore_eos`), so the figures differ only by the server. A scenario sends at
most `requests` requests and waits at most its time limit; a request still running then is cancelled
and counts as failed, and what it streamed until then counts in the latencies and the throughput.

Goodput counts the requests that meet both SLOs on their own (time to first token within the TTFT SLO,
and the request's own p99 inter-token gap within the ITL SLO) per second of the scenario's wall time.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    requests: int
    concurrency: int  # the most requests in flight at once
    rate_per_s: float = 0.0  # > 0: Poisson arrivals at this rate (still capped by concurrency)
    long_every: int = 0  # every n-th request (the n-th, 2n-th, ...) has the long prompt; 0: none
    short_words: int = 100
    long_words: int = 1000
    output_tokens: int = 64
    seed: int = 0

    def prompt_words(self) -> list[int]:
        """Words in each request's prompt, in sending order."""
        return [self.long_words if self.long_every and (i + 1) % self.long_every == 0 else self.short_words
                for i in range(self.requests)]

    def arrivals_s(self) -> list[float]:
        """When each request may start, in seconds after the scenario starts: all at once for a closed loop."""
        if self.rate_per_s <= 0:
            return [0.0] * self.requests
        rng = random.Random(self.seed)
        offsets, now = [], 0.0
        for _ in range(self.requests):
            offsets.append(now)
            now += rng.expovariate(self.rate_per_s)
        return offsets


def default_scenarios(rate_per_s: float) -> dict[str, Scenario]:
    """The comparison's scenarios: 100-word prompts at concurrency 1 and 8; the long-prompt mix (every
    4th prompt 1,000 words) at concurrency 16 and as Poisson arrivals. Each has its own seed, so no
    prompt repeats across them and no server gets a prefix-cache hit from an earlier scenario."""
    scenarios = (
        Scenario("c1", requests=8, concurrency=1, seed=1),
        Scenario("c8", requests=32, concurrency=8, seed=2),
        Scenario("c16-long", requests=48, concurrency=16, long_every=4, seed=3),
        Scenario("poisson-long", requests=32, concurrency=64, rate_per_s=rate_per_s, long_every=4, seed=4),
    )
    return {s.name: s for s in scenarios}


def prompt_text(index: int, words: int, seed: int = 0) -> str:
    """A prompt of `words` common words, different for every index from its first word on."""
    rng = random.Random(seed * 1_000_003 + index)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 5000.0
    itl_ms: float = 200.0


@dataclass(slots=True)
class RequestResult:
    prompt_words: int
    ttft_s: float | None = None  # None: no token came
    gaps_s: list[float] = field(default_factory=list)  # between chunks that carried text
    output_tokens: int = 0  # the usage's completion_tokens, else the chunks that carried text
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None

    def meets(self, slo: Slo) -> bool:
        return (self.ok and self.ttft_s * 1000 <= slo.ttft_ms
                and percentile(self.gaps_s, 0.99) * 1000 <= slo.itl_ms)


@dataclass(slots=True)
class ScenarioStats:
    server: str
    scenario: str
    requests: int
    failed: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    goodput_rps: float
    slo_met: bool  # the scenario's TTFT p99 and ITL p99 both within the SLOs, and nothing failed
    first_error: str


def percentile(values: list[float], q: float) -> float:
    """The value below which a fraction q of `values` lie (nearest rank); 0.0 for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarize(server: str, scenario: str, results: list[RequestResult], wall_s: float, slo: Slo) -> ScenarioStats:
    streamed = [r for r in results if r.ttft_s is not None]  # a request cut off counts what it streamed
    ttfts = [r.ttft_s * 1000 for r in streamed]
    gaps = [g * 1000 for r in streamed for g in r.gaps_s]
    failed = sum(not r.ok for r in results)
    ttft_p99, itl_p99 = percentile(ttfts, 0.99), percentile(gaps, 0.99)
    return ScenarioStats(
        server, scenario, len(results), failed, wall_s,
        output_tokens_per_s=sum(r.output_tokens for r in streamed) / wall_s if wall_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 0.5), ttft_p99_ms=ttft_p99,
        itl_mean_ms=statistics.fmean(gaps) if gaps else 0.0,
        itl_p50_ms=percentile(gaps, 0.5), itl_p99_ms=itl_p99,
        goodput_rps=sum(r.meets(slo) for r in results) / wall_s if wall_s > 0 else 0.0,
        slo_met=failed == 0 and bool(streamed) and ttft_p99 <= slo.ttft_ms and itl_p99 <= slo.itl_ms,
        first_error=next((r.error for r in results if r.error), ""),
    )


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id the server's GET /v1/models lists (llama-server and Tandem both answer it)."""
    response = await client.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                            result: RequestResult) -> None:
    """One greedy streaming completion of exactly `max_tokens` tokens (ignore_eos), timed chunk by chunk
    into `result` as the chunks come, so a request cut off by the time limit keeps what it streamed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.gaps_s.append(now - last)
                last = now
                result.output_tokens += 1
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]  # a chunk may carry several tokens
    if result.output_tokens != max_tokens:
        result.error = f"{result.output_tokens} tokens instead of {max_tokens}"


async def run_scenario(url: str, model: str, scenario: Scenario, time_limit_s: float) -> tuple[list[RequestResult], float]:
    """Sends the scenario's requests to `url`; returns each one's result, in sending order, and the wall
    time from the first send to the last completion (or to the time limit)."""
    results = [RequestResult(words) for words in scenario.prompt_words()]
    arrivals = scenario.arrivals_s()
    gate = asyncio.Semaphore(scenario.concurrency)
    limits = httpx.Limits(max_connections=scenario.concurrency, max_keepalive_connections=scenario.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit_s, connect=10), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                prompt = prompt_text(i, results[i].prompt_words, scenario.seed)
                await stream_completion(client, url, model, prompt, scenario.output_tokens, results[i])

        tasks = [asyncio.create_task(one(i)) for i in range(scenario.requests)]
        await asyncio.wait(tasks, timeout=time_limit_s)
        wall_s = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for result, task in zip(results, tasks):
        _note_failure(result, task, time_limit_s)
    return results, wall_s


def _note_failure(result: RequestResult, task: asyncio.Task, time_limit_s: float) -> None:
    if task.cancelled():
        result.error = f"not finished within the scenario's {time_limit_s:.0f} s"
    elif task.exception() is not None:
        result.error = f"{type(task.exception()).__name__}: {task.exception()}"
