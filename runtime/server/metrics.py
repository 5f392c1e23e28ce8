"""Prometheus metrics of one server, in their own registry (two apps in one process, as in
tests, never share or clash).

Counters and histograms are updated as requests go; the gauges that describe the engine
(queue lengths, KV usage, cache hit rate) are refreshed from `Engine.stats()` at scrape time.
Token timings use the engine process's timestamps (CLOCK_MONOTONIC, shared by both processes
on one host), so batching chunks over the pipe does not distort inter-token latency.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixlm_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens of finished "
                                     "generation requests", registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens", "Generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("radixlm_cached_tokens", "Prompt tokens served from the "
                                     "prefix cache", registry=r)
        self.finished = Counter("radixlm_samples_finished", "Finished samples by finish "
                                "reason", ["reason"], registry=r)
        self.ttft = Histogram("radixlm_time_to_first_token_seconds", "Time from request "
                              "arrival to the first generated token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("radixlm_inter_token_latency_seconds", "Time between two "
                             "consecutive tokens of one sample", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("radixlm_e2e_request_latency_seconds", "Time from request arrival "
                             "to its last token", buckets=E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("radixlm_num_requests_in_flight", "Engine requests (one per "
                               "sample) submitted by this server and not finished", registry=r)
        self.running = Gauge("radixlm_num_running_requests", "Requests in the engine's "
                             "running batch", registry=r)
        self.waiting = Gauge("radixlm_num_waiting_requests", "Requests waiting for admission "
                             "to the running batch", registry=r)
        self.kv_usage = Gauge("radixlm_kv_cache_usage_ratio", "Fraction of KV pages neither "
                              "free nor evictable (held by running requests or leases)",
                              registry=r)
        self.kv_pages = Gauge("radixlm_kv_cache_pages", "KV pages by state", ["state"],
                              registry=r)
        self.hit_rate = Gauge("radixlm_prefix_cache_hit_rate", "Fraction of prompt tokens "
                              "served from the prefix cache since start", registry=r)

    def observe_stats(self, stats: dict[str, Any], in_flight: int) -> None:
        self.in_flight.set(in_flight)
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        total = stats.get("kv_pages_total", 0)
        free = stats.get("kv_pages_free", 0)
        evictable = stats.get("kv_pages_evictable", 0)
        self.kv_usage.set((total - free - evictable) / total if total else 0.0)
        for state in ("total", "free", "cached", "evictable", "leased"):
            self.kv_pages.labels(state).set(stats.get(f"kv_pages_{state}", 0))
        self.hit_rate.set(cache_hit_rate(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cache_hit_rate(stats: dict[str, Any]) -> float:
    cached = stats.get("cached_tokens", 0)
    computed = stats.get("prefill_tokens_computed", 0)
    return cached / (cached + computed) if cached + computed else 0.0
