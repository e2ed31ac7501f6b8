"""Tandem's Prometheus metrics: exact names and labels, scraped totals, the /metrics server."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import ServiceMetrics, render_metrics, start_metrics_server

EXPECTED_FAMILIES = {
    "tandem:time_to_first_token_seconds": "histogram",
    "tandem:inter_token_latency_seconds": "histogram",
    "tandem:e2e_request_latency_seconds": "histogram",
    "tandem:request_queue_time_seconds": "histogram",
    "tandem:kv_transfer_seconds": "histogram",
    "tandem:num_requests_running": "gauge",
    "tandem:num_requests_waiting": "gauge",
    "tandem:kv_cache_usage_perc": "gauge",
    "tandem:prefix_cache_queries_total": "counter",
    "tandem:prefix_cache_hits_total": "counter",
    "tandem:num_preemptions_total": "counter",
    "tandem:num_migrations_total": "counter",
    "tandem:model_loads_total": "counter",
    "tandem:model_load_seconds": "histogram",
    "tandem:models_resident": "gauge",
    "tandem:kv_transfer_bytes_total": "counter",
    "tandem:request_success_total": "counter",
    "tandem:prefill_placement_total": "counter",
    "tandem:request_prompt_tokens": "histogram",
    "tandem:request_generation_tokens": "histogram",
    "tandem:prompt_tokens_total": "counter",
    "tandem:generation_tokens_total": "counter",
    "tandem:batch_policy": "gauge",
}


def _type_lines(text: str) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_exposes_exactly_the_vllm_like_names() -> None:
    metrics = ServiceMetrics("smollm2", "127.0.0.1:50071")
    metrics.request_success("stop").inc()
    body, content_type = render_metrics(metrics.registry)

    assert _type_lines(body.decode()) == EXPECTED_FAMILIES
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert "tandem:time_to_first_token_seconds_bucket{" in body.decode()


def test_scraped_counts_and_sums_match_what_was_observed() -> None:
    metrics = ServiceMetrics("smollm2", "w0")
    ttfts = [0.125, 0.25, 0.5, 2.0, 0.0625]  # binary fractions: the sums are exact
    gaps = [0.015625, 0.03125, 0.03125]
    for value in ttfts:
        metrics.time_to_first_token.observe(value)
    for value in gaps:
        metrics.inter_token_latency.observe(value)
    metrics.prompt_tokens.inc(37)
    metrics.generation_tokens.inc(120)
    metrics.kv_transfer_bytes.inc(4096)
    metrics.kv_transfer_bytes.inc(1024)
    metrics.prefix_cache_queries.inc(64)
    metrics.prefix_cache_hits.inc(48)
    metrics.num_preemptions.inc()
    metrics.num_requests_running.set(3)
    metrics.kv_cache_usage.set(0.375)
    for reason in ("stop", "stop", "length"):
        metrics.request_success(reason).inc()

    samples = _samples(render_metrics(metrics.registry)[0].decode())
    labels = (("model_name", "smollm2"), ("worker", "w0"))
    assert samples[("tandem:time_to_first_token_seconds_count", labels)] == len(ttfts)
    assert samples[("tandem:time_to_first_token_seconds_sum", labels)] == sum(ttfts)
    assert samples[("tandem:time_to_first_token_seconds_bucket", (("le", "0.25"), *labels))] == 3
    assert samples[("tandem:inter_token_latency_seconds_count", labels)] == 3
    assert samples[("tandem:inter_token_latency_seconds_sum", labels)] == 0.078125
    assert samples[("tandem:e2e_request_latency_seconds_count", labels)] == 0
    assert samples[("tandem:prompt_tokens_total", labels)] == 37
    assert samples[("tandem:generation_tokens_total", labels)] == 120
    assert samples[("tandem:kv_transfer_bytes_total", labels)] == 5120
    assert samples[("tandem:prefix_cache_queries_total", labels)] == 64
    assert samples[("tandem:prefix_cache_hits_total", labels)] == 48
    assert samples[("tandem:num_preemptions_total", labels)] == 1
    assert samples[("tandem:num_requests_running", labels)] == 3
    assert samples[("tandem:kv_cache_usage_perc", labels)] == 0.375
    assert samples[("tandem:request_success_total", (("finished_reason", "length"), *labels))] == 1
    assert samples[("tandem:request_success_total", (("finished_reason", "stop"), *labels))] == 2


def test_each_service_has_its_own_registry() -> None:
    gateway = ServiceMetrics("m", "gateway")
    decode = ServiceMetrics("m", "decode-0")
    gateway.generation_tokens.inc(5)

    assert _samples(render_metrics(decode.registry)[0].decode())[
        ("tandem:generation_tokens_total", (("model_name", "m"), ("worker", "decode-0")))] == 0


def test_metrics_server_keeps_colons_even_when_openmetrics_is_asked_for() -> None:
    metrics = ServiceMetrics("m", "prefill-0")
    metrics.prompt_tokens.inc(7)
    server = start_metrics_server("127.0.0.1", 0, metrics.registry)
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/metrics",
            headers={"Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read().decode()
            content_type = response.headers["Content-Type"]
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
    finally:
        server.close()

    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert 'tandem:prompt_tokens_total{model_name="m",worker="prefill-0"} 7.0' in body.splitlines()
    assert _type_lines(body) == EXPECTED_FAMILIES
    assert missing.value.code == 404


def test_a_service_of_several_models_labels_each_request_with_its_own() -> None:
    metrics = ServiceMetrics("", "scheduler")
    metrics.request_success("stop", "smollm2").inc()
    metrics.request_success("abort", "other").inc()
    metrics.request_queue_time("smollm2").observe(0.25)

    samples = _samples(render_metrics(metrics.registry)[0].decode())
    assert samples[("tandem:request_success_total", (("finished_reason", "stop"), ("model_name", "smollm2"),
                                                     ("worker", "scheduler")))] == 1
    assert samples[("tandem:request_success_total", (("finished_reason", "abort"), ("model_name", "other"),
                                                     ("worker", "scheduler")))] == 1
    assert samples[("tandem:request_queue_time_seconds_sum", (("model_name", "smollm2"), ("worker", "scheduler")))] == 0.25
    per_request = ("tandem:request_success_total", "tandem:request_queue_time_seconds_count")
    assert not any(dict(labels)["model_name"] == "" for name, labels in samples if name in per_request)
