"""The server's Prometheus metrics (``GET /metrics``, text exposition format).

Each app has its own registry (so that tests can build several apps in one process). Names:

* ``ftjax_requests_running``, ``ftjax_requests_waiting`` (gauges): the scheduler's rows in use and its queue;
* ``ftjax_time_to_first_token_seconds``, ``ftjax_time_per_output_token_seconds``,
  ``ftjax_request_queue_seconds`` (histograms, seconds): from each finished request's ``RequestStats``;
* ``ftjax_requests_total{finish_reason}`` (stop, length, cancelled, error), ``ftjax_requests_rejected_total{reason}``
  (invalid, queue_full), ``ftjax_generation_tokens_total``, ``ftjax_prompt_tokens_total``,
  ``ftjax_prompt_cached_tokens_total`` (counters);
* from ``Scheduler.metrics()`` at each scrape: ``ftjax_expert_cache_hits_total``,
  ``ftjax_expert_cache_misses_total``, ``ftjax_expert_cache_hit_rate`` (gauge, 0..1),
  ``ftjax_expert_bytes_h2d_total`` (expert bytes copied host to device), ``ftjax_kv_chunks_hit_total``,
  ``ftjax_kv_chunks_stored_total``.
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# No ``*_created`` series (the time each counter was made): they double the exposition for no use here.
disable_created_metrics()

FINISH_REASONS = ("stop", "length", "cancelled", "error")
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: Scheduler counters exported at each scrape: (metric name, help, where to find the value in
#: ``Scheduler.metrics()``: dotted paths, the first present wins).
ENGINE_COUNTERS = (
    ("ftjax_expert_cache_hits", "Expert-cache hits (routed (token, layer, expert) lookups found in a slot).",
     ("expert_cache_hits", "expert_cache.hits", "expert_hits", "hits")),
    ("ftjax_expert_cache_misses", "Expert-cache misses.",
     ("expert_cache_misses", "expert_cache.misses", "expert_misses", "misses")),
    ("ftjax_expert_bytes_h2d", "Expert weight bytes copied host to device.",
     ("expert_bytes_h2d", "bytes_h2d", "expert_cache.bytes_h2d", "expert_cache_bytes_h2d")),
    ("ftjax_kv_chunks_hit", "Stored KV chunks reused by a prompt's prefix (layerwise KV offload).",
     ("kv_chunks_hit", "kv.chunks_hit", "kv_store.chunks_hit", "chunks_hit")),
    ("ftjax_kv_chunks_stored", "KV chunks stored in host memory.",
     ("kv_chunks_stored", "kv.chunks_stored", "kv_store.chunks_stored", "chunks_stored")),
)


def lookup(values: Mapping[str, Any], paths) -> float | None:
    """The first number found at one of the dotted ``paths`` of the nested mapping ``values``, or None."""
    for path in paths:
        v: Any = values
        for part in path.split("."):
            v = v.get(part) if isinstance(v, Mapping) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


class _EngineCollector:
    """Exports the last ``Scheduler.metrics()`` snapshot (set by the server just before each scrape)."""

    def __init__(self):
        self.snapshot: Mapping[str, Any] = {}

    def collect(self):
        snap = self.snapshot
        for name, doc, paths in ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=lookup(snap, paths) or 0.0)
        hits = lookup(snap, ENGINE_COUNTERS[0][2]) or 0.0
        misses = lookup(snap, ENGINE_COUNTERS[1][2]) or 0.0
        yield GaugeMetricFamily("ftjax_expert_cache_hit_rate", "Expert-cache hits / (hits + misses) so far (0..1).",
                                value=hits / (hits + misses) if hits + misses else 0.0)


class ServerMetrics:
    """The metrics of one server (module docstring); thread-safe updates."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("ftjax_requests_running", "Requests in the scheduler's batch rows.", registry=r)
        self.waiting = Gauge("ftjax_requests_waiting", "Requests queued in the scheduler.", registry=r)
        self.ttft = Histogram("ftjax_time_to_first_token_seconds", "Time to first token of a request (seconds).",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ftjax_time_per_output_token_seconds", "Time between two output tokens (seconds).",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.queued = Histogram("ftjax_request_queue_seconds", "Seconds a request waited for a batch row.",
                                buckets=_TTFT_BUCKETS, registry=r)
        self.requests = Counter("ftjax_requests", "Finished requests, by finish reason.", ["finish_reason"],
                                registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.rejected = Counter("ftjax_requests_rejected", "Requests refused before any work, by reason.",
                                ["reason"], registry=r)
        for reason in ("invalid", "queue_full"):
            self.rejected.labels(reason)
        self.generation_tokens = Counter("ftjax_generation_tokens", "Tokens generated.", registry=r)
        self.prompt_tokens = Counter("ftjax_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("ftjax_prompt_cached_tokens", "Prompt tokens reused from stored KV.",
                                     registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)

    def finished(self, reason: str | None, stats) -> None:
        """Counts a finished request (``stats``: its ``RequestStats`` or None)."""
        self.requests.labels(reason if reason in FINISH_REASONS else "error").inc()
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.queued.observe(max(stats.queued_s, 0.0))
        if stats.completion_tokens > 0 and stats.ttft_s is not None:
            self.ttft.observe(max(stats.ttft_s, 0.0))
        for s in stats.tpot_s:
            self.tpot.observe(max(s, 0.0))

    def exposition(self, snapshot: Mapping[str, Any] | None = None, running: int | None = None,
                   waiting: int | None = None) -> bytes:
        """The text exposition, with the scheduler's counters from ``snapshot`` and the gauges set."""
        if snapshot is not None:
            self.engine.snapshot = snapshot
        if running is not None:
            self.running.set(running)
        if waiting is not None:
            self.waiting.set(waiting)
        return generate_latest(self.registry)
