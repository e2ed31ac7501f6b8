"""bench/loadgen.py and bench/serve.py without servers: the scenarios, the statistics and goodput, the
SSE client on a canned stream, and the Tandem/peer ratios."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench import loadgen, serve
from bench.loadgen import (
    RequestResult, Scenario, Slo, default_scenarios, percentile, prompt_text, stream_completion, summarize,
)
from bench.serve import Measured, Server, applied_policies, chosen_scenarios, parse_args, ratios, write_per_request


def test_long_prompt_mix_puts_every_fourth_prompt_at_1000_words():
    mix = default_scenarios(rate_per_s=1.0)["c16-long"]
    assert (mix.concurrency, mix.output_tokens) == (16, 64)
    assert mix.prompt_words()[:8] == [100, 100, 100, 1000, 100, 100, 100, 1000]
    assert mix.prompt_words().count(1000) == mix.requests // 4


def test_closed_loop_starts_everything_at_once_and_poisson_is_seeded_with_the_given_mean_gap():
    assert Scenario("c8", requests=5, concurrency=8).arrivals_s() == [0.0] * 5
    poisson = Scenario("p", requests=2000, concurrency=64, rate_per_s=4.0, seed=7)
    arrivals = poisson.arrivals_s()
    assert arrivals == poisson.arrivals_s()  # every server gets the same arrival times
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    mean_gap = arrivals[-1] / (len(arrivals) - 1)
    assert 0.225 < mean_gap < 0.275  # 1/rate = 0.25 s; 2,000 draws put the mean within 10 %


def test_scenarios_do_not_share_prompts_so_no_server_gets_prefix_cache_hits_across_them():
    scenarios = default_scenarios(1.0).values()
    firsts = {prompt_text(0, 100, s.seed) for s in scenarios}
    assert len(firsts) == len(default_scenarios(1.0))
    text = prompt_text(3, 100, seed=1)
    assert len(text.split()) == 100 and text == prompt_text(3, 100, seed=1) != prompt_text(4, 100, seed=1)


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile(values, 1.0)) == (51.0, 100.0, 100.0)
    assert percentile([], 0.99) == 0.0


def test_summary_counts_goodput_per_request_against_both_slos():
    slo = Slo(ttft_ms=1000, itl_ms=100)
    results = [
        RequestResult(100, ttft_s=0.5, gaps_s=[0.05, 0.05], output_tokens=3),  # meets both
        RequestResult(100, ttft_s=2.0, gaps_s=[0.05, 0.05], output_tokens=3),  # TTFT too slow
        RequestResult(1000, ttft_s=0.5, gaps_s=[0.05, 0.30], output_tokens=3),  # one stalled gap
        RequestResult(100, error="HTTP 503: b'no worker'"),
    ]
    stats = summarize("s", "c", results, wall_s=2.0, slo=slo)
    assert (stats.requests, stats.failed, stats.first_error) == (4, 1, "HTTP 503: b'no worker'")
    assert stats.goodput_rps == 0.5  # one good request in 2 s
    assert stats.output_tokens_per_s == 4.5  # 9 tokens of the three that finished
    assert (stats.ttft_p50_ms, stats.ttft_p99_ms) == (500.0, 2000.0)
    assert (stats.itl_p50_ms, stats.itl_p99_ms) == (50.0, 300.0)
    assert stats.slo_met is False


def test_a_request_cut_off_by_the_time_limit_fails_but_its_tokens_count_in_throughput_and_latency():
    cut = RequestResult(100, ttft_s=0.2, gaps_s=[0.1], output_tokens=2, error="not finished within the scenario's 90 s")
    stats = summarize("s", "c", [cut], wall_s=1.0, slo=Slo())
    assert (stats.failed, stats.goodput_rps, stats.output_tokens_per_s) == (1, 0.0, 2.0)
    assert (stats.ttft_p50_ms, stats.itl_p99_ms) == (200.0, 100.0)


def test_slo_met_needs_no_failure_and_both_p99s_within():
    good = [RequestResult(100, ttft_s=0.1, gaps_s=[0.01], output_tokens=2) for _ in range(3)]
    assert summarize("s", "c", good, 1.0, Slo()).slo_met is True
    assert summarize("s", "c", good + [RequestResult(100, error="x")], 1.0, Slo()).slo_met is False


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _run(handler) -> RequestResult:
    result = RequestResult(3)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await stream_completion(client, "http://peer", "m", "a b c", 3, result)
    asyncio.run(go())
    return result


def test_client_sends_a_greedy_ignore_eos_stream_and_times_text_chunks():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content), path=request.url.path)
        body = _sse({"choices": [{"text": "x"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": "yz"}]},
                    {"choices": [], "usage": {"completion_tokens": 3}})
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    result = _run(handler)
    assert seen["path"] == "/v1/completions"
    assert {k: seen[k] for k in ("model", "prompt", "max_tokens", "temperature", "stream", "ignore_eos")} == {
        "model": "m", "prompt": "a b c", "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    assert result.ok and result.output_tokens == 3  # from the usage: the last chunk carried two tokens
    assert len(result.gaps_s) == 1 and result.ttft_s >= 0  # two chunks carried text


def test_client_reports_an_http_error_and_a_short_stream_as_failures():
    error = _run(lambda request: httpx.Response(429, content=b'{"error": "queue full"}'))
    assert not error.ok and error.error.startswith("HTTP 429: ")
    short = _run(lambda request: httpx.Response(200, content=_sse({"choices": [{"text": "x"}]})))
    assert not short.ok and short.error == "1 tokens instead of 3"


def test_ratios_pair_every_tandem_setup_with_every_peer_per_scenario():
    servers = [Server("tandem colocated", True, "", lambda: None), Server("llama.cpp Q4_1", False, "", lambda: None)]
    tandem = summarize("tandem colocated", "c8", [RequestResult(1, 0.1, [0.02], 64)], 1.0, Slo())
    peer = summarize("llama.cpp Q4_1", "c8", [RequestResult(1, 0.1, [0.01], 32)], 1.0, Slo())
    (row,) = ratios([tandem, peer], servers)
    assert (row["tandem"], row["peer"], row["scenario"]) == ("tandem colocated", "llama.cpp Q4_1", "c8")
    assert (row["output_tokens_per_s"], row["itl_p50_ms"]) == (2.0, 2.0)


def test_ratios_pair_each_tandem_setup_with_the_setups_listed_before_it():
    names = ("tandem colocated", "tandem disaggregated", "tandem hybrid")
    servers = [Server(name, True, "", lambda: None) for name in names]
    stats = [summarize(name, "c8", [RequestResult(1, 0.1, [0.02], 64 * (i + 1))], 1.0, Slo())
             for i, name in enumerate(names)]
    rows = ratios(stats, servers)
    assert [(r["tandem"], r["peer"], r["output_tokens_per_s"]) for r in rows] == [
        ("tandem disaggregated", "tandem colocated", 2.0), ("tandem hybrid", "tandem colocated", 3.0),
        ("tandem hybrid", "tandem disaggregated", 1.5)]


def test_flags_scale_the_scenarios_and_reject_unpaired_names(capsys):
    args = parse_args(["--scenario", "c8", "--scenario", "poisson-long", "--rate", "2", "--requests-scale", "0.25"])
    c8, poisson = chosen_scenarios(args)
    assert (c8.name, c8.requests, poisson.requests, poisson.rate_per_s) == ("c8", 8, 8, 2.0)
    with pytest.raises(SystemExit):
        parse_args(["--peer-name", "vllm"])
    assert "give one name per URL" in capsys.readouterr().err


def test_run_scenario_cuts_a_stalled_stream_at_the_time_limit_and_keeps_what_it_streamed(monkeypatch):
    async def stall_after_one_chunk():
        yield b'data: {"choices": [{"text": "x"}]}\n\n'
        await asyncio.sleep(60)

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stall_after_one_chunk(), headers={"content-type": "text/event-stream"})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(loadgen.httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=httpx.MockTransport(handler), **kwargs))
    scenario = Scenario("c1", requests=2, concurrency=1, output_tokens=4)
    results, wall_s = asyncio.run(loadgen.run_scenario("http://peer", "m", scenario, time_limit_s=2.0))
    first, second = results
    assert first.ttft_s is not None and first.output_tokens == 1
    assert first.error == second.error == "not finished within the scenario's 2 s"
    assert second.ttft_s is None  # never sent: the only slot stayed busy
    assert wall_s >= 2.0


def test_applied_policies_names_each_worker_with_its_last_policy(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    line = "2026-12-01 16:54:58,989 INFO colocated services.worker.runtime: applying the scheduler's batch policy "
    (logs / "colocated-0.log").write_text(f"{line}{{'max_num_batched_tokens': 21}} (window 0 ms)\nother\n"
                                          f"{line}{{'max_num_batched_tokens': 32}} (window 0 ms)\n")
    (logs / "gateway.log").write_text("nothing about policies\n")
    assert applied_policies(tmp_path) == [
        "colocated-0: 2 policy change(s), the last {'max_num_batched_tokens': 32} (window 0 ms)"]


def test_per_request_rows_say_why_each_request_counts_toward_goodput_or_not(tmp_path):
    slo = Slo(ttft_ms=1000, itl_ms=100)
    results = [RequestResult(100, ttft_s=0.5, gaps_s=[0.05, 0.05], output_tokens=3),
               RequestResult(1000, ttft_s=0.5, gaps_s=[0.05, 0.30], output_tokens=3),
               RequestResult(100, error="HTTP 503: b'no worker'")]
    measured = Measured(summarize("s", "c", results, wall_s=2.0, slo=slo), results)
    path = tmp_path / "requests.jsonl"
    write_per_request([measured], slo, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["index"], r["prompt_words"], r["ttft_ms"], r["itl_p99_ms"], r["longest_gap_ms"], r["meets_slo"])
            for r in rows] == [(0, 100, 500.0, 50.0, 50.0, True), (1, 1000, 500.0, 300.0, 300.0, False),
                               (2, 100, None, 0.0, 0.0, False)]
    assert rows[2]["error"] == "HTTP 503: b'no worker'" and {r["server"] for r in rows} == {"s"}


def test_run_dir_keeps_each_tandem_setups_logs_and_spans_under_its_name(tmp_path, monkeypatch):
    started = []

    class FakeMesh:
        http_url = "http://127.0.0.1:1"

        @classmethod
        def start(cls, *up_args, run_dir):
            started.append((up_args, run_dir))
            (run_dir / "spans-scheduler.jsonl").write_text("{}\n")
            return cls()

        def stop(self):
            pass

    monkeypatch.setattr(serve, "Mesh", FakeMesh)
    servers = serve.servers_of(parse_args(["--tandem", "hybrid=--mode hybrid", "--run-dir", str(tmp_path / "runs")]))
    with servers[0].open() as url:
        assert url == "http://127.0.0.1:1"
    assert started == [(("--mode", "hybrid"), tmp_path / "runs" / "hybrid")]
    assert (tmp_path / "runs" / "hybrid" / "spans-scheduler.jsonl").read_text() == "{}\n"  # kept after the stop
