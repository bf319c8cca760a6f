"""Prometheus metrics for the server, named like vLLM's (`vllm:` -> `pagoda:`) so dashboards port.

Engine-wide counts (running, waiting, KV usage, tokens, preemptions, prefix-cache counters) are read
at scrape time from a snapshot the engine thread publishes after every step: the engine itself is
never touched from the HTTP thread. Per-request histograms are observed by the engine thread when a
request produces tokens or finishes (prometheus_client objects are thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.outputs import RequestOutput

logger = logging.getLogger("pagoda.metrics")

PREFIX = "pagoda:"
LOG_INTERVAL_S = 10.0

# Buckets as vLLM's, so existing dashboards' quantiles read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

Snapshot = Mapping[str, int | float]

# (metric name, help, snapshot key) for what the engine counts itself.
_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("kv_cache_usage_perc", "KV cache usage: 1 means every block is held by a request.", "kv_cache_usage"),
    ("kv_cache_blocks_in_use", "KV blocks held by requests.", "kv_blocks_in_use"),
    ("kv_cache_blocks_total", "KV blocks in the cache.", "kv_blocks_total"),
)
_COUNTERS = (
    ("prompt_tokens", "Prompt tokens computed (prefill).", "num_prompt_tokens_computed"),
    ("generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("num_preemptions", "Requests preempted (recomputed later).", "num_preemptions"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding).", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).", "num_accepted_tokens"),
)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        for name, doc, key in _GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self._model_name], float(snap.get(key, 0)))
            yield g
        for name, doc, key in _COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self._model_name], float(snap.get(key, 0)))
            yield c


class ServerMetrics:
    """Every metric of one server, in its own registry (so test servers in one process never clash)."""

    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, label = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, registry=reg, buckets=buckets).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive tokens of a request.", _ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Decode time per output token.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Tokens computed per engine step.", _ITERATION_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self._rejections = Counter(PREFIX + "admission_rejections", "Requests refused at admission, by reason.",
                                   ["model_name", "reason"], registry=reg)
        reg.register(_EngineCollector(snapshot, model_name))
        self._stat_logger = StatLogger()
        self._snapshot = snapshot

    def reject(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        """Per-request timings of a finished request (all samples: the first sample's timings)."""
        m = out.metrics
        for sample in out.outputs:
            self._success.labels(self.model_name, sample.finish_reason or "abort").inc()
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is None:
            return  # aborted before its first token
        if m.first_scheduled_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        self.decode.observe(m.finished_time - m.first_token_time)
        num_out = len(out.outputs[0].token_ids)
        if num_out > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (num_out - 1))

    def observe_first_token(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)

    def maybe_log(self, now: float) -> None:
        self._stat_logger.maybe_log(self._snapshot(), now)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatLogger:
    """A log line every LOG_INTERVAL_S seconds: throughput, running, waiting, KV usage, prefix hit rate."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last: dict[str, float] = {}

    def maybe_log(self, snap: Snapshot, now: float) -> None:
        if now - self._last_time < self.interval:
            return
        dt = now - self._last_time
        keys = ("num_prompt_tokens_computed", "num_generation_tokens", "prefix_cache_queries", "prefix_cache_hits")
        delta = {k: float(snap.get(k, 0)) - self._last.get(k, 0.0) for k in keys}
        running, waiting = int(snap.get("num_requests_running", 0)), int(snap.get("num_requests_waiting", 0))
        self._last_time = now
        self._last = {k: float(snap.get(k, 0)) for k in keys}
        if not any(delta.values()) and not running and not waiting:
            return  # idle: no line
        queries = delta["prefix_cache_queries"]
        hit_rate = 100.0 * delta["prefix_cache_hits"] / queries if queries > 0 else 0.0
        logger.info("prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
                    "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                    delta["num_prompt_tokens_computed"] / dt, delta["num_generation_tokens"] / dt, running, waiting,
                    100.0 * float(snap.get("kv_cache_usage", 0.0)), hit_rate)
