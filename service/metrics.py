"""Prometheus metrics on their own HTTP port. The server updates request counters and latency histograms as
requests run; engine gauges and counters are read from engine.stats() at scrape time, so the engine thread
never touches prometheus-client."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from service.core.outputs import RequestOutput
from service.core.stats import DiskTierStats, RemoteTierStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# The same gauges under the names the Gateway API Inference Extension's endpoint picker reads by default
# (its --total-queued-requests-metric, --total-running-requests-metric, --kv-cache-usage-percentage-metric
# flags; vLLM's names), so an InferencePool of ovserve replicas needs no flags to route on load.
EPP_ALIASES = {
    "ovserve_waiting_requests": "vllm:num_requests_waiting",
    "ovserve_running_requests": "vllm:num_requests_running",
    "ovserve_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
}
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class MetricsHandler(WSGIRequestHandler):
    """One scrape. The metrics port has no token and a thread per connection, so a connection is closed
    `lifetime` seconds after it opened, whatever its client does (a scrape takes milliseconds; a client sending
    a byte every few seconds would outlast any per-read timeout), and a read waits at most `timeout`."""

    timeout = 5.0
    lifetime = 10.0

    def setup(self) -> None:
        super().setup()
        self.deadline = threading.Timer(self.lifetime, self.cut_off)
        self.deadline.daemon = True
        self.deadline.start()

    def cut_off(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self.deadline.cancel()
        with contextlib.suppress(OSError):  # the client may be gone, or cut off
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not logged
        pass


class MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most MAX_CONNECTIONS at once: connections beyond them are closed at once, so idle
    clients cannot pile up threads in the server's process (with prometheus_client's own server each open
    connection held a thread for as long as its client kept it open)."""

    MAX_CONNECTIONS = 32
    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client cut off or gone is no error of the server's (socketserver would print a traceback); anything
        else is reported as socketserver does."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "ovserve_requests", "Finished RPCs by method, status code and tenant", ["rpc", "code", "tenant"], registry=r
        )
        self.http_requests = Counter(
            "ovserve_http_requests",
            "Finished HTTP API requests by endpoint, status (499: the client went away) and tenant",
            ["endpoint", "status", "tenant"],
            registry=r,
        )
        self.dropped_connections = Counter(
            "ovserve_http_dropped_connections",
            "HTTP connections closed for a limit: head_timeout, body_timeout or connection_limit",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "ovserve_time_to_first_token_seconds",
            "Request start to first token (gRPC and HTTP), by tenant",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ovserve_inter_token_latency_seconds",
            "Time between tokens of a request after its first; tokens that arrive together share the gap",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ovserve_request_latency_seconds",
            "End-to-end generation latency (gRPC and HTTP), by tenant",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "ovserve_queue_time_seconds",
            "Time waiting before first scheduling, by tenant",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._engine = EngineCollector()
        r.register(self._engine)
        self._http: Any = None  # the metrics port's MetricsServer, once serving

    def attach(self, engine) -> None:
        self._engine.engine = engine

    def observe_first_token(self, seconds: float, tenant: str = "") -> None:
        self.ttft.labels(tenant).observe(seconds)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """num_tokens arrived together, seconds after the request's previous ones: each counts the gap's
        share (as vLLM counts the tokens of a speculative step), so the histogram's sum is the time spent
        decoding and its count the tokens decoded."""
        for _ in range(num_tokens):
            self.itl.observe(seconds / num_tokens)

    def observe_rpc(
        self, rpc: str, code: str, seconds: float, output: RequestOutput | None = None, tenant: str = ""
    ) -> None:
        self.requests.labels(rpc, code, tenant).inc()
        if rpc.startswith("Generate"):
            self.e2e.labels(tenant).observe(seconds)
        if output is not None and output.timings is not None:
            self.queue.labels(tenant).observe(output.timings.queue)

    def observe_http(
        self, endpoint: str, status: int, seconds: float, output: RequestOutput | None = None, tenant: str = ""
    ) -> None:
        self.http_requests.labels(endpoint, str(status), tenant).inc()
        if output is not None:
            self.e2e.labels(tenant).observe(seconds)
        if output is not None and output.timings is not None:
            self.queue.labels(tenant).observe(output.timings.queue)

    def observe_dropped_connection(self, reason: str) -> None:
        self.dropped_connections.labels(reason).inc()

    def observe_call(
        self,
        protocol: str,
        rpc: str,
        code: str | int,
        seconds: float,
        output: RequestOutput | None = None,
        tenant: str = "",
    ) -> None:
        """A finished call of either front: gRPC codes are names, HTTP statuses numbers. tenant: a configured
        tenant's name, empty for calls refused before it was known (the label's values stay bounded)."""
        if protocol == "grpc":
            self.observe_rpc(rpc, str(code), seconds, output, tenant)
        else:
            self.observe_http(rpc, int(code), seconds, output, tenant)

    def serve(self, port: int, host: str) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server = type("MetricsServer", (MetricsServer,), {"address_family": family})
        self._http = make_server(host, port, make_wsgi_app(self.registry), server, handler_class=MetricsHandler)
        threading.Thread(target=self._http.serve_forever, name="metrics", daemon=True).start()

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class TokenClock:
    """Time to first token and inter-token latency of one request, observed as its outputs arrive. The first
    output gives the time to first token only, even when it holds several tokens (a prefix-cache hit can
    verify drafts in the request's first step): those came with the first, not after it."""

    def __init__(
        self, metrics: Metrics, started: float, tenant: str = "", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics, self.last, self.clock, self.tenant = metrics, started, clock, tenant
        self.first = True

    def tick(self, out: RequestOutput) -> None:
        if not out.token_ids:
            return
        now = self.clock()
        if self.first:
            self.metrics.observe_first_token(now - self.last, self.tenant)
        else:
            self.metrics.observe_tokens(now - self.last, len(out.token_ids))
        self.last, self.first = now, False


class TokenClocks:
    """A request's TokenClock per candidate (n > 1): the time to first token once per request (its first
    candidate's first token), the inter-token latency of each candidate's tokens since its own earlier ones."""

    def __init__(
        self, metrics: Metrics, started: float, tenant: str = "", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.metrics, self.started, self.tenant, self.clock = metrics, started, tenant, clock
        self.clocks: dict[int, TokenClock] = {}

    def tick(self, out: RequestOutput) -> None:
        if not out.token_ids:
            return
        clock = self.clocks.get(out.index)
        if clock is None:
            clock = TokenClock(self.metrics, self.started, self.tenant, self.clock)
            if self.clocks:  # a later candidate's first tokens: the request's first token came already
                clock.last, clock.first = self.clock(), False
                self.clocks[out.index] = clock
                return
            self.clocks[out.index] = clock
        clock.tick(out)


class EngineCollector:
    """Engine gauges and counters from one stats() snapshot per scrape; nothing until an engine is attached."""

    def __init__(self) -> None:
        self.engine = None

    def collect(self):
        if self.engine is None:
            return
        s = self.engine.stats()
        for name, doc, value in (
            ("ovserve_running_requests", "Requests being generated", s.num_running),
            ("ovserve_waiting_requests", "Requests waiting to be scheduled", s.num_waiting),
            ("ovserve_kv_cache_usage_ratio", "Share of KV cache blocks in use", s.kv_usage),
            ("ovserve_kv_cache_free_blocks", "KV cache blocks free", s.num_free_blocks),
            ("ovserve_kv_cache_blocks", "KV cache blocks in all", s.num_total_blocks),
            (
                "ovserve_prefix_cache_hit_ratio",
                "Share of prompt tokens served from the prefix cache",
                s.prefix_hit_rate,
            ),
            ("ovserve_step_seconds", "Duration of the last engine step", s.last_step_seconds),
            ("ovserve_tokens_per_step", "Tokens computed in the last engine step", s.tokens_per_step),
            (
                "ovserve_spec_step_overhead_tokens",
                "A one-token step's fixed cost in units of the time each token up to 8 adds, from the speculative "
                "draft rule's table of step times",
                s.step_overhead_tokens,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
            if name in EPP_ALIASES:
                yield GaugeMetricFamily(EPP_ALIASES[name], f"{doc} (alias of {name})", value=value)
        for name, doc, value in (
            ("ovserve_preemptions", "Requests preempted for lack of KV blocks", s.num_preemptions),
            ("ovserve_prompt_tokens", "Prompt tokens computed (prefix cache hits excluded)", s.num_prompt_tokens),
            ("ovserve_generated_tokens", "Tokens generated", s.num_generated_tokens),
            ("ovserve_failed_steps", "Engine steps that raised (their requests failed)", s.num_failed_steps),
            (
                "ovserve_step_shape_changes",
                "Engine steps whose input shape differed from the last step's (each prepares kernels anew)",
                s.num_shape_changes,
            ),
            ("ovserve_prefix_cache_evictions", "Cached KV blocks reused for new content", s.num_cache_evictions),
            (
                "ovserve_shared_prompt_tokens",
                "Prompt tokens the later candidates of n > 1 requests read from the first candidate's KV blocks",
                s.num_shared_prompt_tokens,
            ),
            ("ovserve_spec_draft_tokens", "Draft tokens verified (speculative decoding)", s.num_draft_tokens),
            ("ovserve_spec_accepted_tokens", "Draft tokens the model agreed with", s.num_accepted_tokens),
            (
                "ovserve_spec_verify_steps",
                "Request-steps that verified draft tokens (each yields the accepted drafts plus one token)",
                s.num_verify_steps,
            ),
            (
                "ovserve_grammar_mask_wait_seconds",
                "Time steps waited for grammar masks (response formats, tool calls) after the model finished",
                s.mask_seconds_total,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "ovserve_loading_requests", "Requests restoring their prefix from disk or the remote tier", s.num_loading
        )
        by_source = CounterMetricFamily(
            "ovserve_prompt_tokens_by_source",
            "Prompt tokens by where their KV came from: computed, the RAM prefix cache, the disk tier or the remote "
            "tier",
            labels=["source"],
        )
        by_source.add_metric(["computed"], s.num_prompt_tokens)
        by_source.add_metric(["ram"], s.num_cached_prompt_tokens)
        by_source.add_metric(["disk"], s.num_restored_prompt_tokens)
        by_source.add_metric(["remote"], s.num_remote_prompt_tokens)
        yield by_source
        if s.disk is not None:
            yield from disk_tier_metrics(s.disk)
        if s.remote is not None:
            yield from remote_tier_metrics(s.remote)


def disk_tier_metrics(d: DiskTierStats):
    for name, doc, value in (
        (
            "ovserve_kv_disk_enabled",
            "1 while the disk tier writes; 0 after the disk refused a write or stopped answering",
            d.enabled,
        ),
        ("ovserve_kv_disk_blocks", "KV blocks stored in the disk tier", d.num_blocks),
        ("ovserve_kv_disk_bytes", "Bytes stored in the disk tier", d.num_bytes),
    ):
        yield GaugeMetricFamily(name, doc, value=float(value))
    counters: tuple[tuple[str, str, float], ...] = (
        ("ovserve_kv_disk_written_blocks", "KV blocks written to the disk tier", d.num_written),
        ("ovserve_kv_disk_restored_blocks", "KV blocks restored from the disk tier", d.num_restored),
        ("ovserve_kv_disk_skipped_blocks", "Full KV blocks not written because writes fell behind", d.num_skipped),
        ("ovserve_kv_disk_evicted_blocks", "KV blocks removed from the disk tier (size or idle time)", d.num_evicted),
        (
            "ovserve_kv_disk_corrupt_blocks",
            "Disk-tier entries refused: truncated, corrupt or foreign files, and anything not a regular readable file",
            d.num_corrupt,
        ),
        ("ovserve_kv_disk_written_bytes", "Bytes written to the disk tier", d.bytes_written),
        ("ovserve_kv_disk_read_bytes", "Bytes read from the disk tier", d.bytes_read),
        ("ovserve_kv_disk_restores", "Requests whose prefix was restored from disk", d.num_restores),
        ("ovserve_kv_disk_restore_seconds", "Time spent restoring prefixes from disk", d.restore_seconds_total),
    )
    for name, doc, total in counters:
        yield CounterMetricFamily(name, doc, value=total)


def remote_tier_metrics(r: RemoteTierStats):
    yield GaugeMetricFamily(
        "ovserve_kv_remote_up", "1 while the remote tier's store answers; 0 while it is down (prefixes computed)", r.up
    )
    counters: tuple[tuple[str, str, float], ...] = (
        ("ovserve_kv_remote_published_blocks", "KV blocks published to the remote tier", r.num_published),
        (
            "ovserve_kv_remote_skipped_blocks",
            "Full KV blocks not published: publishing fell behind, or the store was down",
            r.num_skipped,
        ),
        ("ovserve_kv_remote_fetched_blocks", "KV blocks fetched from the remote tier and verified", r.num_fetched),
        ("ovserve_kv_remote_misses", "Fetches whose chain ended at a block the store did not hold", r.num_missed),
        (
            "ovserve_kv_remote_corrupt_blocks",
            "Remote values refused (wrong length, checksum, identity or digest, or a key of another type)",
            r.num_corrupt,
        ),
        (
            "ovserve_kv_remote_errors",
            "Remote store operations that failed (unreachable, timed out, refused)",
            r.num_errors,
        ),
        ("ovserve_kv_remote_outages", "Times the remote store stopped answering", r.num_outages),
        ("ovserve_kv_remote_published_bytes", "Bytes published to the remote tier", r.bytes_published),
        ("ovserve_kv_remote_fetched_bytes", "Bytes fetched from the remote tier", r.bytes_fetched),
        ("ovserve_kv_remote_fetches", "Requests whose prefix was looked for in the remote tier", r.num_fetches),
        ("ovserve_kv_remote_fetch_seconds", "Time spent fetching prefixes from the remote tier", r.fetch_seconds_total),
    )
    for name, doc, total in counters:
        yield CounterMetricFamily(name, doc, value=total)
