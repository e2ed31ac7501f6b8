"""Observability of the real mesh (`tandem up`): one connected trace per request through every hop,
prefix-cache hits in the prefill span, `tandem trace`, exact /metrics counts, a dead OTLP endpoint
that costs the requests nothing, and the trace of a colocated worker.

The services run in other processes, so the test reads the spans from the run directory's span
files (the services flush them every 0.5 s) instead of an in-memory exporter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from services.common.model_store import DEFAULT_MODEL_NAME
from services.common.spans import Attr, Event, SpanName, SpanRecord, gateway_span_name, load_span_files
from tandem.cli.ports import free_port
from tandem.cli.trace_view import request_spans, trace_gaps
from tandem.v1 import gateway_pb2
from tests.mesh import Mesh, collect, greedy_request
from tests.waiting import DEADLINE_S, wait_until


BLOCK = 16
NUM_LAYERS = 30
KV_BYTES_PER_TOKEN = 46080  # 2 x 30 layers x 3 kv heads x 64 dims x 4 bytes
KV_CHUNK_BYTES = 64 * 1024  # two blocks of one layer (2 x 24576 bytes) per chunk
CHUNK_SIZE = 32  # prompt tokens per prefill iteration
ENV = {
    "TANDEM_KV_CHUNK_BYTES": str(KV_CHUNK_BYTES),
    "TANDEM_CHUNK_SIZE": str(CHUNK_SIZE),
    "TANDEM_KV_MEMORY": "256MiB",
    "TANDEM_THREADS": "1",
}
NO_OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}  # span files
# Spans of a request besides its prefill iterations: gateway, scheduler submit/queue/route/relay,
# prefill request, KV send and receive, decode.
HOPS = 6
# Every request here is a completion of the default model: the gateway names its root span so.
ROOT = gateway_span_name("text_completion", DEFAULT_MODEL_NAME)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("observability")


@pytest.fixture(scope="module")
def mesh(run_dir, default_model_dir):
    started = Mesh.start("--prefill", "1", "--decode", "1", "--model", str(default_model_dir),
                         env={**ENV, **NO_OTLP}, run_dir=run_dir)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def model_name(mesh) -> str:
    return mesh.gateway().ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models[0].id


# -- helpers ---------------------------------------------------------------------------------

def prompt_of(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 40000 + 200 for i in range(length)]


def request(prompt: list[int], max_tokens: int, request_id: str, **sampling: Any) -> gateway_pb2.GenerateRequest:
    """A greedy request that generates exactly `max_tokens` tokens."""
    message = greedy_request(prompt, max_tokens, request_id=request_id)
    message.sampling.ignore_eos = True
    for name, value in sampling.items():
        setattr(message.sampling, name, value)
    return message


def generate(mesh: Mesh, message: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateResponse]:
    tokens, messages = collect(mesh.gateway().Generate(message, timeout=120))
    assert len(tokens) == message.sampling.max_tokens
    return messages


def route_of(mesh: Mesh, request_id: str):
    return {r.request_id: r for r in mesh.scheduler_stats().recent_routes}[request_id]


def kv_bytes(prompt_tokens: int) -> int:
    return -(-prompt_tokens // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN


def wait_for_spans(run_dir: Path, request_id: str, count: int) -> list[SpanRecord]:
    """The request's spans once its trace is whole (every started span written, every parent there);
    there must be exactly `count` of them."""
    def probe() -> list[SpanRecord] | None:
        loaded = load_span_files(run_dir)
        spans = request_spans(loaded.spans, request_id)
        return spans if spans and trace_gaps(spans, loaded.started, request_id).complete else None

    spans = wait_until(probe, f"the whole trace of request {request_id}")
    assert len(spans) == count, sorted(s.name for s in spans)
    return spans


def span_count(prompt_tokens: int) -> int:
    """How many spans the trace of an uncached prompt has: one per hop, and one per prefill iteration."""
    return HOPS + -(-prompt_tokens // CHUNK_SIZE)


def named(spans: list[SpanRecord], name: str) -> list[SpanRecord]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


def one(spans: list[SpanRecord], name: str) -> SpanRecord:
    (span,) = named(spans, name)
    return span


def shape(spans: list[SpanRecord]) -> tuple:
    """The tree as nested (name, service, children) tuples, siblings sorted: independent of timing."""
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        children[span.parent_span_id].append(span)

    def node(span: SpanRecord) -> tuple:
        return span.name, span.service, tuple(sorted(node(c) for c in children[span.span_id]))

    return tuple(sorted(node(s) for s in children[None]))


def normalized(tree: tuple) -> tuple:
    return tuple(sorted((name, service, normalized(kids)) for name, service, kids in tree))


def leaf(name: str, service: str) -> tuple:
    return name, service, ()


def expected_tree(prefill_iterations: int) -> tuple:
    """DESIGN section 3: gateway -> scheduler (one span: its queue and route are events on it) ->
    prefill (iterations, KV send -> KV receive on the decode worker) and decode, every hop a child
    of the one that caused it."""
    prefill = ("prefill.request", "prefill", (
        *[leaf("prefill.iteration", "prefill")] * prefill_iterations,
        ("kv_transfer.send", "prefill", (leaf("kv_transfer.receive", "decode"),)),
    ))
    submit = ("scheduler.submit", "scheduler", (prefill, leaf("decode.request", "decode")))
    return normalized(((ROOT, "gateway", (submit,)),))


def queue_ns(submit: SpanRecord) -> int:
    """The request's wait in the scheduler's queue: from its span's start to its admission."""
    (admitted,) = [e.time_ns for e in submit.events if e.name == Event.ADMITTED]
    return admitted - submit.start_ns


def iterations(spans: list[SpanRecord]) -> list[tuple[int, int, int]]:
    """(tokens computed, tokens from the prefix cache, batch size) of each prefill iteration, in order."""
    return [(s.attributes[Attr.PREFILL_TOKENS_COMPUTED], s.attributes[Attr.PREFILL_TOKENS_CACHED],
             s.attributes[Attr.BATCH_SIZE]) for s in named(spans, SpanName.PREFILL_ITERATION)]


def trace_cli(run_dir: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "trace", *args], capture_output=True, text=True,
                          env={**os.environ, "TANDEM_RUN_DIR": str(run_dir), "NO_COLOR": "1"}, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- one request, one trace ------------------------------------------------------------------

def test_one_request_is_one_connected_trace_through_every_hop(mesh, run_dir, model_name):
    messages = generate(mesh, request(prompt_of(40, 1), 6, "obs-one", top_p=0.5))
    spans = wait_for_spans(run_dir, "obs-one", span_count(40))

    assert {s.trace_id for s in spans} == {messages[0].trace_id}
    assert {s.request_id for s in spans} == {"obs-one"}
    assert shape(spans) == expected_tree(prefill_iterations=2)  # 40 tokens: chunks of 32 and 8
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        if span.parent_span_id is not None:  # on one clock: a child runs within its parent
            parent = by_id[span.parent_span_id]
            assert parent.start_ns <= span.start_ns and span.end_ns <= parent.end_ns, (span.name, parent.name)
    servers = [s.name for s in spans if s.kind == "server"]
    assert sorted(servers) == sorted([ROOT, "kv_transfer.receive", "prefill.request", "scheduler.submit"])
    route = route_of(mesh, "obs-one")
    prefill_address, decode_address = (mesh.endpoint(n).address for n in ("prefill-0", "decode-0"))
    assert {s.instance for s in spans if s.service == "prefill"} == {prefill_address}
    assert {s.instance for s in spans if s.service == "decode"} == {decode_address}

    root = one(spans, ROOT)
    timings = (Attr.TTFT_S, Attr.ITL_MEAN_S, Attr.ITL_MAX_S, Attr.TOKEN_ARRIVALS_MS)  # measured: checked below
    assert {k: v for k, v in root.attributes.items() if k not in timings} == {
        Attr.REQUEST_ID: "obs-one",
        Attr.GEN_AI_OPERATION_NAME: "text_completion",
        Attr.GEN_AI_REQUEST_MODEL: model_name,
        Attr.GEN_AI_REQUEST_MAX_TOKENS: 6,
        Attr.GEN_AI_REQUEST_TEMPERATURE: 0.0,
        Attr.GEN_AI_REQUEST_TOP_P: 0.5,
        Attr.GEN_AI_REQUEST_TOP_K: 0,
        Attr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
        Attr.GEN_AI_USAGE_INPUT_TOKENS: 40,
        Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 6,
        "gen_ai.provider.name": "tandem",
        "gen_ai.response.model": model_name,
        "gen_ai.response.id": "obs-one",
        "server.address": "127.0.0.1",
        "server.port": int(mesh.endpoint("gateway").address.rsplit(":", 1)[1]),
    }
    (first_token,) = root.events
    assert first_token.name == Event.FIRST_TOKEN
    assert root.attributes[Attr.TTFT_S] == pytest.approx((first_token.time_ns - root.start_ns) / 1e9, abs=1e-6)
    assert 0 < root.attributes[Attr.ITL_MEAN_S] <= root.attributes[Attr.ITL_MAX_S]
    submit = one(spans, SpanName.SCHEDULER_SUBMIT)
    assert submit.attributes[Attr.GEN_AI_REQUEST_MODEL] == model_name
    assert [e.name for e in submit.events] == [Event.ADMITTED, Event.ROUTED]
    admitted, routed = (e.time_ns for e in submit.events)
    assert submit.start_ns <= admitted <= routed <= one(spans, SpanName.PREFILL).start_ns

    routing = submit.attributes
    assert routing[Attr.ROUTE_PREFILL_WORKER] == route.prefill_worker_id
    assert routing[Attr.ROUTE_DECODE_WORKER] == route.decode_worker_id
    scores = json.loads(routing[Attr.ROUTE_SCORES])
    assert set(scores) == {route.prefill_worker_id, route.decode_worker_id}
    assert scores[route.prefill_worker_id]["cached_blocks"] == 0 and "cost" in scores[route.prefill_worker_id]
    assert "free_blocks" in scores[route.decode_worker_id]

    prefill = one(spans, SpanName.PREFILL)
    assert prefill.attributes[Attr.PREFILL_TOKENS_COMPUTED] == 40
    assert prefill.attributes[Attr.PREFILL_TOKENS_CACHED] == 0
    assert [e.name for e in prefill.events] == [Event.FIRST_TOKEN]
    assert iterations(spans) == [(32, 0, 1), (8, 0, 1)]

    sent, received = one(spans, SpanName.KV_SEND), one(spans, SpanName.KV_RECEIVE)
    # The KV of 40 tokens, 3 blocks, through shared memory (one host), layer-pipelined: one message
    # per run of layers gathered while the prompt's last chunk computed, so 1 to 30 of them.
    chunks = sent.attributes[Attr.KV_CHUNKS]
    assert 1 <= chunks <= NUM_LAYERS
    for end in (sent, received):
        assert end.attributes[Attr.KV_TRANSPORT] == "shm"
        assert end.attributes[Attr.KV_BLOCKS] == 3
        assert end.attributes[Attr.KV_BYTES] == kv_bytes(40) == 3 * BLOCK * KV_BYTES_PER_TOKEN
        assert end.attributes[Attr.KV_CHUNKS] == chunks
        assert end.attributes[Attr.KV_MB_PER_S] > 0
    assert sent.attributes[Attr.KV_PEER] == decode_address
    assert 0 < sent.attributes[Attr.KV_AFTER_FIRST_TOKEN_MS] <= sent.duration_ns / 1e6
    assert sent.attributes[Attr.KV_MB_PER_S] == pytest.approx(kv_bytes(40) / 1e6 / (sent.duration_ns / 1e9), rel=0.1)

    decode = one(spans, SpanName.DECODE)
    assert {k: decode.attributes[k] for k in (Attr.GEN_AI_RESPONSE_FINISH_REASONS, Attr.GEN_AI_USAGE_OUTPUT_TOKENS,
                                              Attr.DECODE_ITERATIONS, Attr.DECODE_PREEMPTIONS)} == {
        Attr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"], Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 6,
        Attr.DECODE_ITERATIONS: 5, Attr.DECODE_PREEMPTIONS: 0}  # token 0 came from the prefill worker
    assert [e.name for e in decode.events] == [Event.FIRST_TOKEN]
    assert 0 < decode.attributes[Attr.ITL_MEAN_S] <= decode.attributes[Attr.ITL_MAX_S]

    assert submit.attributes[Attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert submit.attributes[Attr.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert all(s.status != "ERROR" for s in spans)


def test_a_prefix_cache_hit_shows_in_the_prefill_span(mesh, run_dir):
    prefix = prompt_of(64, 2)
    cold = generate(mesh, request(prefix + prompt_of(8, 3), 2, "obs-prefix-cold"))
    warm = generate(mesh, request(prefix + prompt_of(8, 4), 2, "obs-prefix-warm"))
    assert (cold[-1].usage.cached_tokens, warm[-1].usage.cached_tokens) == (0, 64)

    cold_spans = wait_for_spans(run_dir, "obs-prefix-cold", span_count(72))
    assert shape(cold_spans) == expected_tree(prefill_iterations=3)
    cold_prefill = one(cold_spans, SpanName.PREFILL).attributes
    assert (cold_prefill[Attr.PREFILL_TOKENS_COMPUTED], cold_prefill[Attr.PREFILL_TOKENS_CACHED]) == (72, 0)
    assert iterations(cold_spans) == [(32, 0, 1), (32, 0, 1), (8, 0, 1)]

    warm_spans = wait_for_spans(run_dir, "obs-prefix-warm", HOPS + 1)
    assert shape(warm_spans) == expected_tree(prefill_iterations=1)
    warm_prefill = one(warm_spans, SpanName.PREFILL).attributes
    assert (warm_prefill[Attr.PREFILL_TOKENS_COMPUTED], warm_prefill[Attr.PREFILL_TOKENS_CACHED]) == (8, 64)
    assert iterations(warm_spans) == [(8, 64, 1)]
    scores = json.loads(one(warm_spans, SpanName.SCHEDULER_SUBMIT).attributes[Attr.ROUTE_SCORES])
    assert scores[route_of(mesh, "obs-prefix-warm").prefill_worker_id]["cached_blocks"] == 4
    # the decode worker reuses the shared prefix's 4 blocks from its own prefix cache: of the prompt's
    # 5 blocks of KV, only the last one is shipped
    kv_send = one(warm_spans, SpanName.KV_SEND).attributes
    assert (kv_send[Attr.KV_REUSED_BLOCKS], kv_send[Attr.KV_BYTES]) == (4, kv_bytes(72) - kv_bytes(64))


def test_http_requests_are_traced_from_the_gateway_root(mesh, run_dir, model_name):
    body = json.dumps({"model": model_name, "prompt": "The capital of France is", "max_tokens": 3,
                       "temperature": 0, "ignore_eos": True}).encode()
    call = urllib.request.Request(f"{mesh.http_url}/v1/completions", data=body, method="POST",
                                  headers={"Content-Type": "application/json", "x-request-id": "obs-http"})
    with urllib.request.urlopen(call, timeout=60) as response:
        assert response.headers["x-request-id"] == "obs-http"
        trace_id = response.headers["x-trace-id"]
        usage = json.load(response)["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] < CHUNK_SIZE

    spans = wait_for_spans(run_dir, "obs-http", HOPS + 1)
    assert {s.trace_id for s in spans} == {trace_id}
    assert shape(spans) == expected_tree(prefill_iterations=1)
    root = one(spans, ROOT)
    assert root.kind == "server" and root.parent_span_id is None
    assert root.attributes[Attr.GEN_AI_OPERATION_NAME] == "text_completion"
    assert root.attributes[Attr.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"]
    assert root.attributes[Attr.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    http_host, http_port = mesh.http_url.removeprefix("http://").rsplit(":", 1)
    assert (root.attributes["server.address"], root.attributes["server.port"]) == (http_host, int(http_port))


# -- tandem trace ----------------------------------------------------------------------------

def preorder(nodes: list[dict[str, Any]], depth: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    for node in nodes:
        yield depth, node
        yield from preorder(node["children"], depth + 1)


def waterfall_rows(text: str) -> list[tuple[int, str]]:
    """(depth, span name) of each span row of the text waterfall (rows end with their bar; the
    token ticks under a span and the TTFT breakdown after the spans are not spans)."""
    spans_part = text.split("\nwhere the time to first token went")[0]
    rows = [line for line in spans_part.splitlines()[2:]
            if line.rstrip().endswith("|") and not line.lstrip().startswith("tokens (")]
    # Columns are two spaces apart; a span name has single ones ("text_completion SmolLM2-...").
    return [((len(line) - len(line.lstrip())) // 2, re.split(r"\s{2,}", line.strip())[0]) for line in rows]


def test_tandem_trace_prints_every_hop_in_order_and_its_json_matches_the_spans(mesh, run_dir):
    generate(mesh, request(prompt_of(40, 5), 4, "obs-cli"))
    spans = wait_for_spans(run_dir, "obs-cli", span_count(40))

    document = json.loads(trace_cli(run_dir, "obs-cli", "--format", "json"))
    assert document["request_id"] == "obs-cli"
    nodes = list(preorder(document["spans"]))
    records = {s.span_id: s.to_json() for s in spans}
    assert sorted(node["span_id"] for _, node in nodes) == sorted(records)
    for _, node in nodes:
        assert {k: v for k, v in node.items() if k != "children"} == records[node["span_id"]]
        assert [c["parent_span_id"] for c in node["children"]] == [node["span_id"]] * len(node["children"])
        starts = [c["start_ns"] for c in node["children"]]
        assert starts == sorted(starts)

    text = trace_cli(run_dir, "obs-cli")
    header = text.splitlines()[0].split()
    assert header[:4] == ["request", "obs-cli", "trace", spans[0].trace_id]
    assert header[4:8] == ["4", "services", str(span_count(40)), "spans"]
    rows = waterfall_rows(text)
    assert rows == [(depth, node["name"]) for depth, node in nodes]
    names = [name for _, name in rows]
    hops = [ROOT, "scheduler.submit", "prefill.request", "prefill.iteration", "kv_transfer.send",
            "kv_transfer.receive", "decode.request"]
    positions = [names.index(hop) for hop in hops]
    assert positions == sorted(positions)
    assert re.search(r"admitted@[\d.]+ms  routed@[\d.]+ms", text)
    chunks = one(spans, SpanName.KV_SEND).attributes[Attr.KV_CHUNKS]
    assert f"kv.bytes={kv_bytes(40)}" in text and f"kv.chunks={chunks}" in text
    assert "decode.iterations=3" in text and "usage.output_tokens=4" in text


def test_tandem_trace_last_lists_the_most_recent_requests(mesh, run_dir):
    ids = [f"obs-last-{i}" for i in range(3)]
    for i, request_id in enumerate(ids):
        generate(mesh, request(prompt_of(20 + i, 10 + i), 2 + i, request_id))
    for i, request_id in enumerate(ids):
        wait_for_spans(run_dir, request_id, span_count(20 + i))

    listed = json.loads(trace_cli(run_dir, "--last", "3", "--format", "json"))
    assert [r["request_id"] for r in listed] == ids[::-1]
    for i, summary in zip((2, 1, 0), listed):
        assert (summary["input_tokens"], summary["output_tokens"], summary["finish_reason"], summary["status"]) == (
            20 + i, 2 + i, "length", "UNSET")
        assert 0 < summary["ttft_s"] < summary["total_s"]

    lines = trace_cli(run_dir, "--last", "2").splitlines()
    assert lines[0].split() == ["STARTED", "REQUEST", "ID", "TTFT", "IN", "OUT", "TOTAL", "FINISH", "STATUS"]
    assert len(lines) == 3 and ids[2] in lines[1] and ids[1] in lines[2]


# -- metrics ---------------------------------------------------------------------------------

SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples: Samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(LABEL.findall(match["labels"] or ""))
            samples[(match["name"], labels)] = float(match["value"])
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples of `name` that carry these labels (0 when there is none)."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def test_metrics_count_exactly_what_was_sent(mesh, run_dir, model_name):
    services = {"gateway": "gateway", "scheduler": "scheduler", "prefill": "prefill-0", "decode": "decode-0"}
    urls = {service: mesh.endpoint(name, "metrics").address for service, name in services.items()}
    mesh.wait_idle(DEADLINE_S)
    before = {service: scrape(url) for service, url in urls.items()}
    sent = [(prompt_of(24 + 9 * i, 20 + i), 3 + i) for i in range(4)]  # prompts 24..51 tokens, 3..6 tokens out
    ids = [f"obs-metrics-{i}" for i in range(len(sent))]
    with ThreadPoolExecutor(len(sent)) as pool:
        list(pool.map(lambda i: generate(mesh, request(sent[i][0], sent[i][1], ids[i])), range(len(sent))))
    mesh.wait_idle(DEADLINE_S)
    n, prompt_tokens, output_tokens = len(sent), sum(len(p) for p, _ in sent), sum(m for _, m in sent)

    def settled() -> dict[str, Samples] | None:  # gauges follow the last engine step or call
        now = {service: scrape(url) for service, url in urls.items()}
        idle = all(value(now[s], "tandem:num_requests_running") == value(now[s], "tandem:num_requests_waiting")
                   == value(now[s], "tandem:kv_cache_usage_perc") == 0 for s in now)
        return now if idle else None

    after = wait_until(settled, "idle gauges on every service")

    def delta(service: str, name: str, **labels: str) -> float:
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    labels = {"gateway": (model_name, "gateway"), "scheduler": ("", "scheduler"),
              "prefill": (model_name, mesh.endpoint("prefill-0").address),
              "decode": (model_name, mesh.endpoint("decode-0").address)}
    # The scheduler serves several models: its per-request series carry each request's model.
    per_request = ("tandem:request_success_total", "tandem:request_queue_time_seconds")
    for service, (model, worker) in labels.items():
        series = [(name, dict(ls)) for (name, ls) in after[service] if name.startswith("tandem:")]
        assert series and all(
            s["model_name"] == (model_name if service == "scheduler" and name.startswith(per_request) else model)
            and s["worker"] == worker for name, s in series), service

    kv_total = sum(kv_bytes(len(p)) for p, _ in sent)
    length = {"finished_reason": "length"}
    # The gateway sees whole requests; the prefill worker computes each prompt (no cache hit), its
    # first token and the KV it ships; the decode worker the other tokens, finishing each request.
    expected = [
        ("gateway", "tandem:request_success_total", length, n),
        ("gateway", "tandem:prompt_tokens_total", {}, prompt_tokens),
        ("gateway", "tandem:generation_tokens_total", {}, output_tokens),
        ("gateway", "tandem:time_to_first_token_seconds_count", {}, n),
        ("gateway", "tandem:inter_token_latency_seconds_count", {}, output_tokens - n),
        ("gateway", "tandem:e2e_request_latency_seconds_count", {}, n),
        ("scheduler", "tandem:request_queue_time_seconds_count", {}, n),
        ("scheduler", "tandem:request_success_total", length, n),
        ("prefill", "tandem:time_to_first_token_seconds_count", {}, n),
        ("prefill", "tandem:generation_tokens_total", {}, n),
        ("prefill", "tandem:prefix_cache_queries_total", {}, prompt_tokens),
        ("prefill", "tandem:prefix_cache_hits_total", {}, 0),
        ("prefill", "tandem:kv_transfer_bytes_total", {}, kv_total),
        ("prefill", "tandem:kv_transfer_seconds_count", {}, n),
        ("prefill", "tandem:num_preemptions_total", {}, 0),
        ("prefill", "tandem:request_success_total", {}, 0),
        ("decode", "tandem:request_success_total", length, n),
        ("decode", "tandem:prompt_tokens_total", {}, prompt_tokens),
        ("decode", "tandem:generation_tokens_total", {}, output_tokens - n),
        ("decode", "tandem:num_preemptions_total", {}, 0),
        ("decode", "tandem:kv_transfer_bytes_total", {}, 0),
        ("decode", "tandem:prefix_cache_queries_total", {}, 0),
    ]
    assert [(s, m, delta(s, m, **ls)) for s, m, ls, _ in expected] == [(s, m, v) for s, m, _, v in expected]

    for service, samples in after.items():  # every histogram's +Inf bucket is its count
        for (name, ls), count in samples.items():
            if name.endswith("_count"):
                assert value(samples, name[: -len("_count")] + "_bucket", le="+Inf", **dict(ls)) == count

    spans = {request_id: wait_for_spans(run_dir, request_id, span_count(len(prompt)))
             for request_id, (prompt, _) in zip(ids, sent)}
    roots = [one(s, ROOT).attributes for s in spans.values()]
    ttft = sum(r[Attr.TTFT_S] for r in roots)
    itl = sum(r[Attr.ITL_MEAN_S] * (r[Attr.GEN_AI_USAGE_OUTPUT_TOKENS] - 1) for r in roots)
    assert delta("gateway", "tandem:time_to_first_token_seconds_sum") == pytest.approx(ttft, abs=1e-6)
    assert delta("gateway", "tandem:inter_token_latency_seconds_sum") == pytest.approx(itl, abs=1e-6)
    e2e = delta("gateway", "tandem:e2e_request_latency_seconds_sum")
    assert e2e == pytest.approx(ttft + itl, abs=0.01 * n)  # observed as the last token arrived
    assert e2e <= sum(one(s, ROOT).duration_ns for s in spans.values()) / 1e9
    sends = sum(one(s, SpanName.KV_SEND).attributes[Attr.KV_AFTER_FIRST_TOKEN_MS] for s in spans.values()) / 1e3
    assert delta("prefill", "tandem:kv_transfer_seconds_sum") == pytest.approx(sends, abs=0.005 * n)
    queued = sum(queue_ns(one(s, SpanName.SCHEDULER_SUBMIT)) for s in spans.values()) / 1e9
    assert delta("scheduler", "tandem:request_queue_time_seconds_sum") == pytest.approx(queued, abs=0.005 * n)


# -- a dead OTLP endpoint ----------------------------------------------------------------------

def test_a_dead_otlp_endpoint_fails_no_request_and_is_reported(tmp_path, default_model_dir):
    # That exporting costs the request path nothing is tests/unit/test_tracing.py's to show: spans
    # are exported on the batch worker, never on the thread that ends them.
    endpoint = f"http://127.0.0.1:{free_port()}"
    broken_dir = tmp_path / "otlp"
    broken = Mesh.start("--prefill", "1", "--decode", "1", "--model", str(default_model_dir),
                        env={**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}, run_dir=broken_dir)
    try:
        for seed in range(100, 103):
            generate(broken, request(prompt_of(32, seed), 4, f"obs-otlp-{seed}"))  # all 4 tokens, no error

        def warned() -> str | None:
            for log in sorted(broken_dir.glob("*.log")):
                for line in log.read_text(errors="replace").splitlines():
                    if f"cannot export spans to OTLP endpoint {endpoint}" in line and "WARNING" in line:
                        return line
            return None

        wait_until(warned, "a warning about the dead OTLP endpoint in a service log", timeout=60)
        generate(broken, request(prompt_of(32, 300), 4, "obs-after-warning"))  # dropping spans, still serving
    finally:
        broken.stop()
    assert not list(broken_dir.glob("spans-*.jsonl"))  # OTLP replaces the span files, it does not add to them


# -- colocated mode ----------------------------------------------------------------------------

# Spans of a colocated request besides its prefill iterations: gateway, scheduler, and the worker's
# request span.
COLOCATED_HOPS = 3


def colocated_tree(prefill_iterations: int) -> tuple:
    """One worker prefills and decodes: the scheduler's child is its request span, and the request
    span's children are the iterations that computed the prompt (no transfer, no decode span)."""
    worker = ("colocated.request", "colocated", (leaf("prefill.iteration", "colocated"),) * prefill_iterations)
    submit = ("scheduler.submit", "scheduler", (worker,))
    return normalized(((ROOT, "gateway", (submit,)),))


def test_a_colocated_worker_traces_its_prefill_iterations_and_decode(tmp_path, default_model_dir):
    run_dir = tmp_path / "colocated"
    colocated = Mesh.start("--mode", "colocated", "--model", str(default_model_dir),
                           env={**ENV, **NO_OTLP}, run_dir=run_dir)
    try:
        prompt = prompt_of(40, 1)
        messages = generate(colocated, request(prompt, 6, "obs-colocated"))
        generate(colocated, request(prompt[:32] + prompt_of(8, 2), 2, "obs-colocated-warm"))  # 2 blocks cached
        worker_address = colocated.endpoint("colocated-0").address
    finally:
        colocated.stop()  # flushes the span files
    spans = wait_for_spans(run_dir, "obs-colocated", COLOCATED_HOPS + 2)
    assert len(spans) == COLOCATED_HOPS + 2

    assert {s.trace_id for s in spans} == {messages[0].trace_id}
    assert shape(spans) == colocated_tree(prefill_iterations=2)  # 40 tokens: chunks of 32 and 8
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        if span.parent_span_id is not None:
            parent = by_id[span.parent_span_id]
            assert parent.start_ns <= span.start_ns and span.end_ns <= parent.end_ns, (span.name, parent.name)
    assert {s.instance for s in spans if s.service == "colocated"} == {worker_address}
    assert iterations(spans) == [(32, 0, 1), (8, 0, 1)]

    worker = one(spans, SpanName.COLOCATED)
    timings = (Attr.TTFT_S, Attr.ITL_MEAN_S, Attr.ITL_MAX_S, Attr.TOKEN_ARRIVALS_MS)
    assert {k: v for k, v in worker.attributes.items() if k not in timings} == {
        Attr.REQUEST_ID: "obs-colocated",
        Attr.PREFILL_TOKENS_COMPUTED: 40,
        Attr.PREFILL_TOKENS_CACHED: 0,
        Attr.DECODE_ITERATIONS: 5,  # token 0 ended the prefill; one iteration for each of the other 5
        Attr.DECODE_PREEMPTIONS: 0,
        Attr.GEN_AI_RESPONSE_FINISH_REASONS: ["length"],
        Attr.GEN_AI_USAGE_INPUT_TOKENS: 40,
        Attr.GEN_AI_USAGE_OUTPUT_TOKENS: 6,
    }
    (first_token,) = worker.events
    last_chunk = named(spans, SpanName.PREFILL_ITERATION)[-1]
    assert (first_token.name, first_token.time_ns) == (Event.FIRST_TOKEN, last_chunk.end_ns)
    assert worker.attributes[Attr.TTFT_S] == pytest.approx((first_token.time_ns - worker.start_ns) / 1e9, abs=1e-6)
    assert 0 < worker.attributes[Attr.ITL_MEAN_S] <= worker.attributes[Attr.ITL_MAX_S]
    assert all(s.status != "ERROR" for s in spans)

    warm = wait_for_spans(run_dir, "obs-colocated-warm", COLOCATED_HOPS + 1)
    assert shape(warm) == colocated_tree(prefill_iterations=1)
    assert iterations(warm) == [(8, 32, 1)]
    warm_worker = one(warm, SpanName.COLOCATED).attributes
    assert (warm_worker[Attr.PREFILL_TOKENS_COMPUTED], warm_worker[Attr.PREFILL_TOKENS_CACHED],
            warm_worker[Attr.DECODE_ITERATIONS], warm_worker[Attr.GEN_AI_USAGE_OUTPUT_TOKENS]) == (8, 32, 1, 2)


def test_every_metric_the_grafana_dashboard_queries_is_served(mesh):
    """infra/grafana/tandem.json queries only series that a live mesh's /metrics endpoints serve."""
    from tests.unit.test_infra import dashboard_metrics

    generate(mesh, request(prompt_of(24, 40), 3, "obs-dashboard"))  # finish reasons appear once counted
    mesh.wait_idle(DEADLINE_S)
    served = set()
    for name in ("gateway", "scheduler", "prefill-0", "decode-0"):
        served |= {re.sub(r"_(bucket|sum|count)$", "", sample) for sample, _ in scrape(mesh.endpoint(name, "metrics").address)}
    queried = dashboard_metrics()
    assert len(queried) >= 15 and queried - served == set()
