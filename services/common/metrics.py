"""Prometheus metrics of a Tandem service, named like vLLM's (`tandem:*`) so dashboards translate.

`ServiceMetrics` defines every metric on the service's own registry with its `model_name` and
`worker` labels already bound; `start_metrics_server` serves it for the gRPC-only services and
`render_metrics` produces the `/metrics` body for the gateway's HTTP app.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# Latency buckets in seconds (vLLM's ranges, trimmed for one-machine deployments).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)
# Tokens per request (prompt or generated): 1-2-5 steps up to long-context prompts.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

LABELS = ("model_name", "worker")


class ServiceMetrics:
    """All of Tandem's metrics, bound to one service's registry, model and worker.

    Each service updates the ones it owns; the others stay at zero. `worker` is the recording
    process's identity (a worker's HOST:PORT, or "gateway" / "scheduler"). Finish reasons for
    `request_success` are the lowercase names: "stop", "length", "abort".
    """

    def __init__(self, model_name: str, worker: str, registry: CollectorRegistry | None = None) -> None:
        # The `*_created` series double every family and no dashboard uses them (vLLM drops them too).
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.worker = worker
        bound = {"model_name": model_name, "worker": worker}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(**bound)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=self.registry).labels(**bound)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(**bound)

        self.time_to_first_token = histogram(
            "tandem:time_to_first_token_seconds", "Time from request arrival to its first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "tandem:inter_token_latency_seconds", "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "tandem:e2e_request_latency_seconds", "Time from request arrival to its last token.", REQUEST_BUCKETS)
        self._request_queue_time = Histogram(
            "tandem:request_queue_time_seconds", "Time a request waited for admission.", LABELS,
            registry=self.registry, buckets=REQUEST_BUCKETS)
        self.kv_transfer_time = histogram(
            "tandem:kv_transfer_seconds", "Duration of one request's KV transfer.", TRANSFER_BUCKETS)
        self.num_requests_running = gauge("tandem:num_requests_running", "Requests being computed.")
        self.num_requests_waiting = gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.prefix_cache_queries = counter(
            "tandem:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "tandem:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        self.num_preemptions = counter("tandem:num_preemptions_total", "Sequences preempted for lack of KV blocks.")
        self.num_migrations = counter(
            "tandem:num_migrations_total", "Requests moved to another worker after theirs was lost.")
        self._model_loads = Counter("tandem:model_loads_total", "Models loaded onto this worker (cold starts).",
                                    LABELS, registry=self.registry)
        self._model_load_time = Histogram("tandem:model_load_seconds", "Time to load a model onto this worker.",
                                          LABELS, registry=self.registry, buckets=REQUEST_BUCKETS)
        self.models_resident = gauge("tandem:models_resident", "Models loaded and serving on this worker.")
        self.kv_transfer_bytes = counter("tandem:kv_transfer_bytes_total", "KV cache bytes transferred.")
        self.request_prompt_tokens = histogram(
            "tandem:request_prompt_tokens", "Prompt tokens of each finished or aborted request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "tandem:request_generation_tokens", "Tokens generated for each finished or aborted request.",
            TOKEN_BUCKETS)
        self.prompt_tokens = counter("tandem:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("tandem:generation_tokens_total", "Tokens generated.")
        self._batch_policy = Gauge(
            "tandem:batch_policy", "The batching policy the scheduler set, by field (0: the worker's own flag).",
            (*LABELS, "field"), registry=self.registry)
        self._request_success = Counter(
            "tandem:request_success_total", "Finished requests by finish reason.",
            (*LABELS, "finished_reason"), registry=self.registry)
        self._prefill_placement = Counter(
            "tandem:prefill_placement_total", "Requests started with a hybrid decode worker, by where they "
            "prefilled (local: on it; remote: a prefill worker) and why.",
            (*LABELS, "placement", "reason"), registry=self.registry)

    def request_success(self, finished_reason: str, model_name: str = "") -> Counter:
        """The success counter for one finish reason ("stop", "length", "abort"), under the request's
        model where the service serves several (the scheduler), else under the service's own."""
        return self._request_success.labels(model_name=model_name or self.model_name, worker=self.worker,
                                            finished_reason=finished_reason)

    def request_queue_time(self, model_name: str = "") -> Histogram:
        """The admission-wait histogram, labelled as `request_success` is."""
        return self._request_queue_time.labels(model_name=model_name or self.model_name, worker=self.worker)

    def prefill_placement(self, placement: str, reason: str, model_name: str = "") -> Counter:
        """The scheduler's count of one conditional-disaggregation outcome ("local"/"remote", and its reason)."""
        return self._prefill_placement.labels(model_name=model_name or self.model_name, worker=self.worker,
                                              placement=placement, reason=reason)

    def model_loaded(self, model_name: str, seconds: float) -> None:
        """One load of a model onto this worker, under the loaded model's name."""
        self._model_loads.labels(model_name=model_name, worker=self.worker).inc()
        self._model_load_time.labels(model_name=model_name, worker=self.worker).observe(seconds)

    def batch_policy(self, field: str) -> Gauge:
        """The gauge of one batching-policy field (max_num_batched_tokens, max_num_seqs, chunk_size, window_ms)."""
        return self._batch_policy.labels(model_name=self.model_name, worker=self.worker, field=field)

    def count_request(self, finished_reason: str, prompt_tokens: int, generation_tokens: int, e2e_s: float) -> None:
        """One request that ended, finished or aborted ("abort": the client left or it failed first)."""
        self.request_success(finished_reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.e2e_request_latency.observe(e2e_s)


@dataclass(slots=True)
class MetricsServer:
    """A running `/metrics` HTTP endpoint; `port` is the bound one (useful with port 0)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of one scrape; the gateway returns it from its HTTP `/metrics` route.

    Always the classic text format: prometheus-client's OpenMetrics output turns the colons of
    sample names into underscores but not those of HELP/TYPE (prometheus/client_python#1177),
    which breaks `tandem:*` names for any scraper that negotiates OpenMetrics.
    """
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve `registry` at http://HOST:PORT/metrics from a daemon thread (for gRPC-only services).

    HOST is the service's own --host: metrics listen where its gRPC does, never wider.
    """
    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    server = make_server(host.strip("[]"), port, _metrics_app(registry), server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name=f"metrics:{port}", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


def _metrics_app(registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found; metrics are at /metrics\n"]
        body, content_type = render_metrics(registry)
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: no access log
        return None
