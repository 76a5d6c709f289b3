"""Prometheus metrics, named as vLLM names them but under `pocketllm:`, in a registry of their own.

Latencies are taken at the server: from a request's arrival at the HTTP handler to its tokens
leaving it (handed to the response stream; a non-streaming response hands them over as the
engine produces them). Engine state (running, waiting, KV usage, prefix-cache counters) is read
from what the engine thread publishes after each step, when /metrics is scraped.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pocketllm.outputs import RequestOutput
from pocketllm.server.async_llm import AsyncLLM

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Finer below 0.3 s than vLLM's (its request buckets), to tell a queue-time p99 under 50 ms apart.
_QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2) + _REQUEST_BUCKETS


class _EngineCollector:
    """Gauges and counters read from the engine thread's latest published stats."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.labels = [model_name]

    def collect(self):
        s = self.engine.stats
        for name, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
                ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)):
            g = GaugeMetricFamily(f"pocketllm:{name}", doc, labels=["model_name"])
            g.add_metric(self.labels, value)
            yield g
        for name, doc, value in (
                ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 s.prefix_queried_tokens),
                ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 s.prefix_hit_tokens)):
            c = CounterMetricFamily(f"pocketllm:{name}", doc, labels=["model_name"])
            c.add_metric(self.labels, value)
            yield c


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pocketllm:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        def count(name: str, doc: str) -> Counter:
            return Counter(f"pocketllm:{name}", doc, ["model_name"], registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", _QUEUE_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = count("generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("pocketllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float) -> "RequestTimer":
        return RequestTimer(self, arrival)


class RequestTimer:
    """Latencies and token counts of one engine request, from its arrival at the server."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.last_token_time: float | None = None
        self.done = False

    def tokens_sent(self, num_tokens: int) -> None:
        """New tokens left the server; an interval spanning several tokens counts once per token."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.m.ttft.observe(now - self.arrival)
        else:
            gap = (now - self.last_token_time) / num_tokens
            for _ in range(num_tokens):
                self.m.itl.observe(gap)
        self.last_token_time = now

    def finish(self, out: RequestOutput | None, aborted: bool = False) -> None:
        if self.done:
            return
        self.done = True
        if not aborted:
            self.m.e2e.observe(time.monotonic() - self.arrival)
        if out is None:
            return
        self.m.prompt_tokens.inc(len(out.prompt_token_ids))
        self.m.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        scheduled = out.metrics.get("first_scheduled_time")
        if scheduled is not None:
            self.m.queue_time.observe(max(0.0, scheduled - out.metrics["arrival_time"]))
        for c in out.outputs:
            reason = "abort" if aborted and c.finish_reason is None else c.finish_reason
            if reason is not None:
                self.m.success.labels(self.m.model_name, reason).inc()
