"""The synchronous engine core: schedule -> run -> postprocess, one step at a time.

It owns the model, the KV memory, the scheduler and every live request. It is driven by one
thread (the offline `Engine`'s loop, later the server's engine process); nothing here locks.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any

import torch

from radixlm.runtime.attention.base import create_backend
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.kv_manager import KVManager
from radixlm.runtime.leases import LeaseTable
from radixlm.runtime.loader import LoadedModel
from radixlm.runtime.memory import KVCache, PageAllocator, ReqToTokenTable
from radixlm.runtime.model_runner import ModelRunner, StepResult
from radixlm.runtime.radix_cache import RadixCache
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device,
                 dtype: torch.dtype) -> None:
        mc = loaded.config
        self.config = config
        self.device = device
        self.page_size = config.page_size
        num_pages = _pool_pages(config, mc, dtype, device)
        self.max_model_len = _max_model_len(config, mc, num_pages * config.page_size)
        self.kv_cache = KVCache(mc.num_layers, num_pages * config.page_size, mc.num_kv_heads,
                                mc.head_dim, dtype, device, config.page_size)
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.table = ReqToTokenTable(config.max_running_requests,
                                     num_pages * config.page_size, config.page_size, device)
        self.cache = (None if config.disable_radix_cache
                      else RadixCache(config.page_size, self.allocator))
        self.kv = KVManager(self.allocator, self.table, self.cache)
        self.leases = (None if self.cache is None else
                       LeaseTable(self.cache, int(num_pages * config.lease_memory_fraction)))
        self.scheduler = Scheduler(config, self.kv)
        attn = create_backend(config.attention_backend, scale=mc.head_dim ** -0.5)
        self.runner = ModelRunner(loaded.model, attn, self.kv_cache, self.table, device)
        self.requests: dict[str, Request] = {}
        self.counters: Counter[str] = Counter()

    # -- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"
            request.error = f"duplicate request_id {request.request_id!r}"
            self._emit(request)
            return
        request.max_total_len = self.max_model_len
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.error = error
        self._finish(request, "abort")
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def flush_cache(self) -> None:
        """Drop every cached prefix and every lease. Refused while requests are running or
        waiting."""
        if self.scheduler.has_work:
            raise ValueError(
                f"cannot flush the prefix cache while {len(self.scheduler.running)} requests "
                f"are running and {len(self.scheduler.waiting)} waiting")
        if self.cache is not None:
            self.leases.release_all()
            self.cache.reset()

    def release_lease(self, lease_id: str) -> bool:
        return self.leases is not None and self.leases.release(lease_id)

    def expire_leases(self) -> None:
        if self.leases is not None and len(self.leases):
            self.leases.expire()

    # -- one step --------------------------------------------------------------------------

    def step(self) -> int:
        """Run one batch; return the number of tokens it computed (0 when idle)."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            if self.scheduler.has_work and self.leases is not None and self.leases.release_oldest():
                # Work is waiting but nothing fits: only leased pages can be in the way (alone,
                # any request fits the pool). Pins are hints; they give way.
                log.warning("released a prefix lease: its pages were needed to make progress")
            return 0
        try:
            result = self.runner.execute(scheduled)
        except Exception as exc:  # a bad batch must not take the engine down
            log.exception("step failed; aborting the %d requests in it", len(scheduled.requests))
            for request in scheduled.requests:
                request.error = f"internal error: {exc}"
                self._finish(request, "abort")
            return 0
        self._postprocess(scheduled, result)
        return scheduled.num_tokens

    def _postprocess(self, scheduled: ScheduledBatch, result: StepResult) -> None:
        for request, count in zip(scheduled.requests, scheduled.num_new_tokens):
            # Prefill of the prompt counts as such; recomputation after retraction too.
            self.counters["prefill_tokens_computed"] += min(
                count, max(0, request.prompt_len - request.num_computed_tokens))
            request.num_computed_tokens += count
            self.kv.cache_computed(request)  # the next request (or chat turn) can hit it
        self.counters["batched_tokens"] += scheduled.num_tokens
        self.counters["steps"] += 1
        for request, entries in result.prompt_logprobs.items():
            start = request.prompt_logprob_start or 0
            for position, entry in entries:  # recomputation rewrites the same values
                request.prompt_logprobs[position - start] = entry
        for request, token, logprob in zip(result.sampled, result.next_tokens,
                                           result.logprobs):
            self._append_token(request, token, logprob)

    def _append_token(self, request: Request, token: int, logprob: Any) -> None:
        params = request.params
        if request.num_output_tokens >= params.max_new_tokens:
            self._finish(request, "length")  # max_new_tokens=0: prompt processing only
            return
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        request.token_ids.append(token)
        self.counters["generated_tokens"] += 1
        if logprob is not None:
            request.logprobs.append(logprob)
        enough = request.num_output_tokens >= params.min_new_tokens
        is_eos = token in request.eos_token_ids and not params.ignore_eos
        if enough and (is_eos or token in params.stop_token_ids):
            request.matched_stop = token
            self._finish(request, "stop")
            return
        detok = request.detokenizer
        if detok is not None:
            detok.push(token)
            if detok.stopped_on is not None:
                request.matched_stop = detok.stopped_on
                self._finish(request, "stop")
                return
        if (request.num_output_tokens >= params.max_new_tokens
                or len(request.token_ids) >= request.max_total_len):
            self._finish(request, "length")
        elif request.stream:
            delta = detok.take_delta() if detok is not None else ""
            self._emit(request, delta)

    def _finish(self, request: Request, reason: str) -> None:
        if request.finished:
            return
        if request.pin_ttl is not None and reason != "abort" and self.leases is not None:
            # The prompt is computed and its full pages are in the tree under cache_node
            # (cache_computed ran after the step); lock them before release() unlocks.
            self.kv.cache_computed(request)
            request.lease_id = self.leases.pin(request.cache_node, request.pin_ttl)
        self.scheduler.finish(request, reason)
        self.requests.pop(request.request_id, None)
        self.counters["requests_finished"] += 1
        delta = ""
        if request.detokenizer is not None:
            request.detokenizer.finish()
            delta = request.detokenizer.take_delta()
        self._emit(request, delta)

    @staticmethod
    def _emit(request: Request, delta: str = "") -> None:
        # The consumer may be gone (a closed event loop, a dropped stream); that is its
        # problem, never the engine's.
        try:
            request.on_output(request.make_output(delta))
        except Exception:
            log.warning("dropping output of request %s: its consumer failed",
                        request.request_id, exc_info=True)

    # -- introspection ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "prefill_tokens_computed": self.counters["prefill_tokens_computed"],
            "cached_tokens": self.scheduler.num_cached_tokens,
            "generated_tokens": self.counters["generated_tokens"],
            "batched_tokens": self.counters["batched_tokens"],
            "steps": self.counters["steps"],
            "requests_finished": self.counters["requests_finished"],
            "retractions": self.scheduler.num_retractions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_total": self.allocator.num_pages,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_cached": self.cache.total_pages if self.cache else 0,
            "kv_pages_evictable": self.cache.evictable_pages if self.cache else 0,
            "leases": len(self.leases) if self.leases else 0,
            "kv_pages_leased": self.leases.leased_pages if self.leases else 0,
            "page_size": self.page_size,
            "max_model_len": self.max_model_len,
        }


def _pool_pages(config: EngineConfig, mc: Any, dtype: torch.dtype,
                device: torch.device) -> int:
    if config.max_total_tokens is not None:
        return config.max_total_tokens // config.page_size
    per_slot = KVCache.bytes_per_slot(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = int(free * config.kv_cache_memory_fraction)
    # On CPU the pool shares memory with everything else on the machine: cap it at 1 GiB
    # unless max_total_tokens asks for more.
    if device.type != "cuda":
        budget = min(budget, 1 << 30)
    return max(1, budget // per_slot // config.page_size)


def _max_model_len(config: EngineConfig, mc: Any, pool_tokens: int) -> int:
    limit = mc.max_position_embeddings
    if mc.sliding_window:  # full attention is only exact inside the window
        limit = min(limit, mc.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"limit ({limit})")
        limit = config.max_model_len
    return min(limit, pool_tokens)
