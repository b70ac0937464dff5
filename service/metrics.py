"""Prometheus metrics: request counters and latency histograms updated by the server, engine gauges read
from the engine's stats snapshot at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ovserve_requests", "RPCs by method and status code", ["rpc", "code"], registry=r)
        self.ttft = Histogram(
            "ovserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ovserve_inter_token_latency_seconds", "Time between streamed tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "ovserve_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "ovserve_queue_time_seconds", "Time waiting before first scheduling", buckets=LATENCY_BUCKETS, registry=r
        )
        r.register(_EngineCollector(engine))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
            ("ovserve_running_requests", "Requests being generated", s.num_running),
            ("ovserve_waiting_requests", "Requests waiting to be scheduled", s.num_waiting),
            ("ovserve_kv_cache_usage_ratio", "Share of KV cache blocks in use", s.kv_usage),
            (
                "ovserve_prefix_cache_hit_ratio",
                "Share of prompt tokens served from the prefix cache",
                s.prefix_hit_rate,
            ),
            ("ovserve_step_seconds", "Duration of the last engine step", s.last_step_seconds),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("ovserve_preemptions", "Requests preempted for lack of KV blocks", s.num_preemptions),
            ("ovserve_prompt_tokens", "Prompt tokens computed", s.num_prompt_tokens),
            ("ovserve_generated_tokens", "Tokens generated", s.num_generated_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)
