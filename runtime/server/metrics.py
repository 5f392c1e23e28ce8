"""Prometheus metrics of one server, in their own registry (two apps in one process, as in
tests, never share or clash). Every series has a `model_name` label, as vLLM's and SGLang's
do, so one dashboard serves several servers; docs/server.md#metrics lists them.

Counters and histograms are updated as requests go; the gauges that describe the engine
(queue lengths, KV usage, cache hit rate) and the engine's own counters (retractions,
speculative and grammar work) are refreshed from `Engine.stats()` at scrape time.
Token timings use the engine process's timestamps (CLOCK_MONOTONIC, shared by both processes
on one host), so batching chunks over the pipe does not distort inter-token latency.
Buckets span GPU latencies (milliseconds) to a laptop CPU's (seconds to minutes).
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# The `*_created` timestamp series only double what a scrape shows; vLLM drops them too.
prometheus_client.disable_created_metrics()

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
               1800.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0, 120.0, 300.0, 600.0)

# Engine.stats() counters exported as counters: stat -> (metric, help).
ENGINE_COUNTERS = {
    "steps": ("radixlm_engine_steps", "Forward steps the engine ran"),
    "graph_steps": ("radixlm_engine_graph_steps", "Of them, steps that replayed a CUDA graph "
                    "(the rest ran the model eagerly)"),
    "retractions": ("radixlm_num_preemptions", "Requests retracted (preempted) for memory; "
                    "they restart from the prefix cache"),
    "spec_drafted_tokens": ("radixlm_spec_decode_num_draft_tokens", "Speculative tokens "
                            "drafted"),
    "spec_accepted_tokens": ("radixlm_spec_decode_num_accepted_tokens", "Speculative tokens "
                             "accepted by verification"),
    "grammar_compiles": ("radixlm_grammar_compiles", "Grammars compiled (cache misses)"),
    "grammar_cache_hits": ("radixlm_grammar_cache_hits", "Grammars found compiled"),
    "grammar_compile_errors": ("radixlm_grammar_compile_errors", "Grammars refused"),
    "grammar_compile_seconds": ("radixlm_grammar_compile_seconds", "Time spent compiling "
                                "grammars"),
    "grammar_errors": ("radixlm_grammar_errors", "Requests ended by their grammar: it could "
                       "not be compiled, or it outgrew the matcher's limits while generating"),
    "disk_hit_tokens": ("radixlm_disk_cache_hit_tokens", "Prompt tokens loaded from the "
                        "prefix cache's disk tier instead of computed"),
    "disk_load_bytes": ("radixlm_disk_cache_load_bytes", "KV bytes read from the disk tier"),
    "disk_load_seconds": ("radixlm_disk_cache_load_seconds", "Time spent loading them"),
    "disk_store_bytes": ("radixlm_disk_cache_store_bytes", "KV bytes written to the disk tier"),
    "disk_store_seconds": ("radixlm_disk_cache_store_seconds", "Time the writer spent "
                           "writing them (off the engine thread)"),
    "disk_store_skipped_pages": ("radixlm_disk_cache_store_skipped_pages", "Pages not "
                                 "written: the writer fell behind, or the disk is full"),
    "disk_bad_files": ("radixlm_disk_cache_bad_files", "Truncated, corrupt or foreign files "
                       "found, skipped and removed"),
    "host_hit_tokens": ("radixlm_host_cache_hit_tokens", "Prompt tokens loaded from the "
                        "prefix cache's host-memory tier instead of computed"),
    "host_load_bytes": ("radixlm_host_cache_load_bytes", "KV bytes copied back from host memory"),
    "host_load_seconds": ("radixlm_host_cache_load_seconds", "Time from a load's start to its "
                          "copies' end"),
    "host_store_bytes": ("radixlm_host_cache_store_bytes", "KV bytes copied to host memory"),
    "lora_slot_loads": ("radixlm_lora_slot_loads", "LoRA adapters copied into a device slot "
                        "(growing fast: more adapters in use than max_loras_per_batch)"),
    # Per program only in the stats (/get_server_info): a label per program id would grow
    # without bound.
    "program_calls": ("radixlm_program_calls", "Finished requests that named a program"),
    "program_queue_seconds": ("radixlm_program_queue_seconds", "Time those requests waited "
                              "for admission"),
    "program_service_tokens": ("radixlm_program_service_tokens", "Tokens computed for those "
                               "requests (prompt tokens not cached, and generated ones)"),
    "program_preemptions": ("radixlm_program_preemptions", "Running requests put back for a "
                            "less served program's (program policy plas)"),
}


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, m, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, m, registry=r).labels(model_name)

        self._requests = Counter("radixlm_requests", "HTTP requests by route and status code",
                                 [*m, "route", "status"], registry=r)
        self._finished = Counter("radixlm_samples_finished", "Finished samples by finish "
                                 "reason (stop, length, abort)", [*m, "reason"], registry=r)
        self._kv_pages = Gauge("radixlm_kv_cache_pages", "KV pages by state", [*m, "state"],
                               registry=r)
        self.prompt_tokens = counter("radixlm_prompt_tokens", "Prompt tokens of finished "
                                     "generation requests")
        self.generation_tokens = counter("radixlm_generation_tokens", "Generated tokens")
        self.cached_tokens = counter("radixlm_cached_tokens", "Prompt tokens served from the "
                                     "prefix cache")
        self.ttft = histogram("radixlm_time_to_first_token_seconds", "Time from request "
                              "arrival to the first generated token", TTFT_BUCKETS)
        self.itl = histogram("radixlm_inter_token_latency_seconds", "Time between two "
                             "consecutive tokens of one sample", ITL_BUCKETS)
        self.e2e = histogram("radixlm_e2e_request_latency_seconds", "Time from request "
                             "arrival to its last token", E2E_BUCKETS)
        self.queue_time = histogram("radixlm_request_queue_time_seconds", "Time a sample "
                                    "waited in the engine before admission", PHASE_BUCKETS)
        self.prefill_time = histogram("radixlm_request_prefill_time_seconds", "Time from "
                                      "admission to the first token", PHASE_BUCKETS)
        self.decode_time = histogram("radixlm_request_decode_time_seconds", "Time from the "
                                     "first token to the last", PHASE_BUCKETS)
        self.in_flight = gauge("radixlm_num_requests_in_flight", "Engine requests (one per "
                               "sample) submitted by this server and not finished")
        self.running = gauge("radixlm_num_running_requests", "Requests in the engine's "
                             "running batch")
        self.waiting = gauge("radixlm_num_waiting_requests", "Requests waiting for admission "
                             "to the running batch")
        self.kv_usage = gauge("radixlm_kv_cache_usage_ratio", "Fraction of KV pages neither "
                              "free nor evictable (held by running requests or leases)")
        self.hit_rate = gauge("radixlm_prefix_cache_hit_rate", "Fraction of prompt tokens "
                              "served from the prefix cache since start")
        self.spec_acceptance = gauge("radixlm_spec_decode_acceptance_rate", "Accepted over "
                                     "drafted speculative tokens since start")
        self.lora_loaded = gauge("radixlm_lora_adapters_loaded", "LoRA adapters loaded "
                                 "(served by name)")
        self._engine_counters = {stat: counter(name, doc)
                                 for stat, (name, doc) in ENGINE_COUNTERS.items()}
        self._engine_seen: dict[str, float] = {}

    def request(self, route: str, status: int) -> None:
        self._requests.labels(self.model_name, route, str(status)).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def observe_stats(self, stats: dict[str, Any], in_flight: int) -> None:
        self.in_flight.set(in_flight)
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        total = stats.get("kv_pages_total", 0)
        free = stats.get("kv_pages_free", 0)
        evictable = stats.get("kv_pages_evictable", 0)
        self.kv_usage.set((total - free - evictable) / total if total else 0.0)
        for state in ("total", "free", "cached", "evictable", "leased", "loading"):
            self._kv_pages.labels(self.model_name, state).set(stats.get(f"kv_pages_{state}", 0))
        self.hit_rate.set(cache_hit_rate(stats))
        self.spec_acceptance.set(stats.get("spec_acceptance_rate", 0.0))
        self.lora_loaded.set(stats.get("lora_adapters_loaded", 0))
        for stat, metric in self._engine_counters.items():
            value = float(stats.get(stat, 0))
            grown = value - self._engine_seen.get(stat, 0.0)
            if grown > 0:  # the engine's counts only grow; a restart starts a new server
                metric.inc(grown)
                self._engine_seen[stat] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)


def cache_hit_rate(stats: dict[str, Any]) -> float:
    cached = stats.get("cached_tokens", 0)
    computed = stats.get("prefill_tokens_computed", 0)
    return cached / (cached + computed) if cached + computed else 0.0
