"""Prometheus metrics, named as vLLM names them but under `pocketllm:`, in a registry of their own.

Latencies are taken at the server: from a request's arrival at the HTTP handler to its tokens
leaving it (handed to the response stream; a non-streaming response hands them over as the
engine produces them). The prefill, decode and inference times of a finished request are the
engine's own (its RequestOutput.metrics). Engine state (running, waiting, KV usage, prefix-cache,
preemption and speculative-decoding counters, tokens per step) is read from what the engine thread publishes after
each step, when /metrics is scraped.

One engine request counts once (`request_success_total`, the token histograms), whatever its
number of choices `n`; a request whose consumer went away before it finished counts as
finished_reason="abort", even one that never produced a token.
"""
from __future__ import annotations

import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pocketllm.outputs import RequestOutput
from pocketllm.server.async_llm import AsyncLLM, EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Finer below 0.3 s than vLLM's (its request buckets), to tell a queue-time p99 under 50 ms apart.
_QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2) + _REQUEST_BUCKETS


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets of per-request token counts)."""
    buckets = []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)


class _EngineCollector:
    """Gauges, counters and the tokens-per-step histogram, read from the engine thread's latest
    published stats."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.labels = [model_name]
        # vLLM's buckets, up to the most tokens a step may hold.
        cap = engine.engine.scheduler.config.max_num_batched_tokens
        self.num_iteration_buckets = sum(1 for b in EngineStats.ITERATION_TOKEN_BUCKETS if b <= cap)

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
                 s.prefix_hit_tokens),
                ("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)):
            c = CounterMetricFamily(f"pocketllm:{name}", doc, labels=["model_name"])
            c.add_metric(self.labels, value)
            yield c
        if s.spec is not None:  # vLLM's speculative decoding counters
            for name, doc, value in (
                    ("spec_decode_num_drafts", "Number of spec decoding drafts.", s.spec.num_drafts),
                    ("spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec.num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec.num_accepted_tokens)):
                c = CounterMetricFamily(f"pocketllm:{name}", doc, labels=["model_name"])
                c.add_metric(self.labels, value)
                yield c
            c = CounterMetricFamily("pocketllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", labels=["model_name", "position"])
            for pos, value in enumerate(s.spec.accepted_per_pos):
                c.add_metric(self.labels + [str(pos)], value)
            yield c
        cumulative = list(itertools.accumulate(s.iteration_token_counts))
        buckets = [(floatToGoString(b), cumulative[i])
                   for i, b in enumerate(EngineStats.ITERATION_TOKEN_BUCKETS[:self.num_iteration_buckets])]
        h = HistogramMetricFamily("pocketllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  labels=["model_name"])
        h.add_metric(self.labels, buckets + [("+Inf", cumulative[-1])], s.iteration_tokens_sum)
        yield h


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
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", _REQUEST_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", _REQUEST_BUCKETS)
        token_buckets = build_1_2_5_buckets(engine.engine.max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed.",
                                          token_buckets)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Number of generation tokens processed.", token_buckets)
        self.prompt_tokens = count("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = count("generation_tokens", "Number of generation tokens processed.")
        self.success = Counter("pocketllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)


class RequestTimer:
    """Latencies and token counts of one engine request, from its arrival at the server."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.last_token_time: float | None = None
        self.first_token_time: float | None = None
        self.done = False

    def tokens_sent(self, num_tokens: int) -> None:
        """New tokens left the server; an interval spanning several tokens counts once per token."""
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.first_token_time = now
            self.m.ttft.observe(now - self.arrival)
        else:
            gap = (now - self.last_token_time) / num_tokens
            for _ in range(num_tokens):
                self.m.itl.observe(gap)
        self.last_token_time = now

    def finish(self, out: RequestOutput | None, aborted: bool = False) -> None:
        """The request ended: finished (`out` is its finished output) or aborted (`out` is its
        latest output, None if it produced none). Counts once; later calls do nothing."""
        if self.done:
            return
        self.done = True
        m = self.m
        if not aborted:
            m.e2e.observe(time.monotonic() - self.arrival)
        reason = "abort" if aborted else (out.outputs[0].finish_reason if out is not None and out.outputs else None)
        if reason is not None:
            m.success.labels(m.model_name, reason).inc()
        if out is None:
            return
        num_prompt = len(out.prompt_token_ids)
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        m.prompt_tokens.inc(num_prompt)
        m.generation_tokens.inc(num_generated)
        t = out.metrics
        scheduled = t.get("first_scheduled_time")
        if scheduled is not None:
            m.queue_time.observe(max(0.0, scheduled - t["arrival_time"]))
        if aborted:
            return
        m.request_prompt_tokens.observe(num_prompt)
        m.request_generation_tokens.observe(num_generated)
        first_token, finished = t.get("first_token_time"), t.get("finished_time")
        if scheduled is not None and first_token is not None:
            m.prefill_time.observe(max(0.0, first_token - scheduled))
        if first_token is not None and finished is not None:
            m.decode_time.observe(max(0.0, finished - first_token))
        if scheduled is not None and finished is not None:
            m.inference_time.observe(max(0.0, finished - scheduled))
