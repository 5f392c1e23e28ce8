"""The synchronous engine core: schedule -> run -> postprocess, one step at a time.

It owns the model, the KV memory, the scheduler and every live request. It is driven by one
thread (the offline `Engine`'s loop, later the server's engine process); nothing here locks
(except the lazy creation of the grammar engine, which callers may trigger early).

A request with a grammar (regex / json_schema / ebnf / json_object) is queued at once while
its grammar compiles in the background; the scheduler prefills all but its last prompt token
meanwhile, and each step attaches the grammars that became ready. A grammar that fails to
compile (or times out: the grammar engine enforces grammar_compile_timeout) fails its request
as invalid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from radixlm.kernels import cpu_decode as cpu_decode_kernel
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.kv_cache import KVCache, kv_storage_dtype
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.distributed.groups import (
    check_nccl_in_graphs,
    choose_all_reduce,
    setup_all_reduce,
)
from radixlm.runtime.engine.kv_sizing import max_model_len, pool_pages
from radixlm.runtime.engine.overlap import follow_up_batch
from radixlm.runtime.execution.cpu_decode import CpuDecode, unsupported
from radixlm.runtime.execution.cuda_graph import DecodeGraphs
from radixlm.runtime.execution.model_runner import LaunchedStep, ModelRunner, StepResult
from radixlm.runtime.execution.speculative.draft_model import DraftModel
from radixlm.runtime.execution.speculative.speculator import Speculator
from radixlm.runtime.grammar import create_grammar_engine
from radixlm.runtime.grammar.engine import GrammarCompileError, GrammarLimitError
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.models.loader import LoadedModel
from radixlm.runtime.parallel.sharded import ShardedModel
from radixlm.runtime.scheduling.kv_manager import KVManager
from radixlm.runtime.scheduling.leases import LeaseTable
from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
from radixlm.runtime.scheduling.radix_cache import RadixCache
from radixlm.runtime.scheduling.request import Request, RequestStatus
from radixlm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler

log = logging.getLogger(__name__)


def uses_decode_graphs(config: EngineConfig, device: torch.device, attn: Any) -> bool:
    """Whether decode steps replay CUDA graphs (see cuda_graph). Off the GPU the graph
    runner can still run uncaptured: tests switch it on here to check its bookkeeping."""
    return (device.type == "cuda" and not config.disable_cuda_graph
            and attn.supports_cuda_graph)


def _cpu_decode(model: Any, attn: Any, kv_cache: KVCache) -> CpuDecode | None:
    """The C++ decode kernel for this model, when it covers it and builds here."""
    reason = unsupported(model, attn, kv_cache)
    if reason is None:
        kernel = cpu_decode_kernel.load()
        if kernel is not None:
            return CpuDecode(model, kv_cache, kernel)
        reason = "it did not build"
    log.debug("CPU decode kernel off: %s", reason)
    return None


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device,
                 dtype: torch.dtype, draft: LoadedModel | None = None) -> None:
        mc = loaded.config
        self.config = config
        self.device = device
        self.page_size = config.page_size
        num_pages = pool_pages(config, [mc] + ([draft.config] if draft else []), dtype, device)
        self.max_model_len = max_model_len(config, mc, num_pages * config.page_size)
        attn = create_backend(config.attention_backend, scale=mc.head_dim ** -0.5,
                              device=device, dtype=dtype, head_dim=mc.head_dim)
        graphs = uses_decode_graphs(config, device, attn)
        self.jump_forward = (config.enable_jump_forward if config.enable_jump_forward is not None
                             else not graphs)
        # Tensor parallelism: rank 0's model is the stand-in that sends each call to the other
        # ranks; graphs capture the shard itself, and send each replay (see cuda_graph).
        tp_group = loaded.model.group if isinstance(loaded.model, ShardedModel) else None
        mode = (choose_all_reduce(config.tp_all_reduce, device) if tp_group is not None
                else "none")
        check_nccl_in_graphs(mode, graphs, device)  # before the KV pool is allocated
        # With CUDA graphs, one page past the allocator's: padded rows write their K/V there.
        scratch_pages = 1 if graphs else 0
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
        self.kv_cache = KVCache(mc.num_layers, (num_pages + scratch_pages) * config.page_size,
                                mc.num_kv_heads, mc.head_dim, dtype, device, config.page_size,
                                kv_dtype)
        if loaded.kv_scales is not None and self.kv_cache.quantized:
            self.kv_cache.set_scales(*loaded.kv_scales)
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.table = ReqToTokenTable(config.max_running_requests,
                                     num_pages * config.page_size, config.page_size, device)
        self.cache = (None if config.disable_radix_cache
                      else RadixCache(config.page_size, self.allocator))
        self.kv = KVManager(self.allocator, self.table, self.cache)
        self.leases = (None if self.cache is None else
                       LeaseTable(self.cache, int(num_pages * config.lease_memory_fraction)))
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(loaded.model, attn, self.kv_cache, self.table, device)
        if device.type == "cpu" and not config.disable_cpu_kernel:
            self.runner.cpu_decode = _cpu_decode(loaded.model, attn, self.kv_cache)
        # Verify steps replay as one decode row per token: up to 1 + k rows per request.
        rows = config.max_running_requests * (1 + (config.num_speculative_tokens
                                                    if config.speculative else 0))
        self._graph_args = (dict(scratch_slot=num_pages * config.page_size,
                                 max_batch_size=rows, max_len=self.max_model_len,
                                 capture=device.type == "cuda")
                            if graphs else None)
        if tp_group is not None:  # the other ranks allocate their KV and capture alongside
            numel = rows * mc.hidden_size  # a decode step's activations, verify rows included
            tp_group.start(self.kv_cache.num_slots, self._graph_args, mode, numel)
            log.info("tensor parallelism: %d ranks, %s all-reduce", tp_group.size,
                     setup_all_reduce(mode, numel, dtype, device))
        if graphs:
            self.runner.cuda_graphs = DecodeGraphs(
                loaded.model.model if tp_group else loaded.model, attn, self.kv_cache,
                self.table, **self._graph_args, followers=tp_group)
        self.speculator = (None if config.speculative is None
                           else self._build_speculator(draft, mc.vocab_size, dtype))
        self.requests: dict[str, Request] = {}
        self.counters: Counter[str] = Counter()
        self.tokenizer = loaded.tokenizer
        self._vocab_size = mc.vocab_size
        self._grammar: Any = None  # GrammarEngine, built on first use
        self._grammar_init = threading.Lock()
        self._grammar_waiting: list[Request] = []  # compiling; attached in step()
        # Speculation needs each step's verified tokens on the host before the next step.
        self.overlap = self.speculator is None and (
            config.overlap_schedule == "on"
            or config.overlap_schedule == "auto" and device.type == "cuda")
        self._inflight: LaunchedStep | None = None  # launched, not yet post-processed

    def _build_speculator(self, draft: LoadedModel | None, vocab_size: int,
                          dtype: torch.dtype) -> Speculator:
        config, device = self.config, self.device
        draft_model = None
        if draft is not None:
            dc = draft.config
            attn = create_backend(config.attention_backend, scale=dc.head_dim ** -0.5,
                                  device=device, dtype=dtype, head_dim=dc.head_dim)
            # Same slots as the target's pool (scratch page included): see draft_model.
            kv_cache = KVCache(dc.num_layers, self.kv_cache.k.shape[1], dc.num_kv_heads,
                               dc.head_dim, dtype, device, config.page_size,
                               self.kv_cache.storage_dtype)
            if draft.kv_scales is not None and kv_cache.quantized:
                kv_cache.set_scales(*draft.kv_scales)
            draft_model = DraftModel(draft.model, attn, kv_cache, self.table, vocab_size)
            if self._graph_args is not None:
                draft_model.cuda_graphs = DecodeGraphs(draft.model, attn, kv_cache, self.table,
                                                       **self._graph_args)
            self.runner.draft = draft_model
        return Speculator(config.speculative, config.num_speculative_tokens, self.kv,
                          config.max_num_batched_tokens, draft_model,
                          config.speculative_adaptive)

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
        if request.params.constrained:
            self._start_grammar(request)

    def abort(self, request_id: str, error: str | None = None) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.error = error
        self._finish(request, "abort")
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def flush_cache(self) -> None:
        """Drop every cached prefix and every lease. Refused while requests are running or
        waiting."""
        if self.has_work:
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
        """Run one batch; return the number of tokens it computed (0 when idle).

        With overlap scheduling a step is left running on the device and post-processed in
        the next call, right after the step that follows it has been launched, so the host's
        bookkeeping hides behind the device's work (see `_follow_up`)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            follow = self._follow_up(inflight)
            self._complete(inflight)
            if follow is not None:
                self._inflight = follow
                self.counters["overlapped_steps"] += 1
                return follow.scheduled.num_tokens
        if self._grammar_waiting:
            self._attach_grammars()
        scheduled = self.scheduler.schedule()
        if scheduled is None and self._grammar_waiting:
            # Only compiles to wait for (not pages: held-back requests hold few): don't spin.
            wait_futures([r.grammar_future for r in self._grammar_waiting], timeout=0.01,
                         return_when=FIRST_COMPLETED)
            return 0
        if scheduled is None:
            if self.scheduler.has_work and self.leases is not None and self.leases.release_oldest():
                # Work is waiting but nothing fits: only leased pages can be in the way (alone,
                # any request fits the pool). Pins are hints; they give way.
                log.warning("released a prefix lease: its pages were needed to make progress")
            return 0
        if self.speculator is not None:
            self.speculator.propose(scheduled)
        launched = self._launch(scheduled)
        if launched is None:
            return 0
        if self.overlap:
            self._inflight = launched
        else:
            self._complete(launched)
        return scheduled.num_tokens

    def _follow_up(self, prev: LaunchedStep) -> LaunchedStep | None:
        batch = follow_up_batch(prev, self.scheduler, self.kv, self.config,
                                bool(self._grammar_waiting))
        return None if batch is None else self._launch(batch)

    def _launch(self, scheduled: ScheduledBatch) -> LaunchedStep | None:
        try:
            return self.runner.launch(scheduled)
        except Exception as exc:  # a bad batch must not take the engine down
            self._abort_batch(scheduled, exc)
            return None

    def _complete(self, launched: LaunchedStep) -> None:
        try:
            result = launched.result()
        except Exception as exc:
            self._abort_batch(launched.scheduled, exc)
            return
        self._postprocess(launched.scheduled, result)

    def _abort_batch(self, scheduled: ScheduledBatch, exc: Exception) -> None:
        log.error("step failed; aborting the %d requests in it", len(scheduled.requests),
                  exc_info=exc)
        for request in scheduled.requests:
            request.error = f"internal error: {exc}"
            self._finish(request, "abort")

    def _postprocess(self, scheduled: ScheduledBatch, result: StepResult) -> None:
        for request, count in zip(scheduled.requests, scheduled.num_new_tokens):
            if request.finished:  # stopped (or aborted) while a follow-up step ran
                continue
            if request in result.verified:
                count = 1  # the drafts count as computed only once accepted, below
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
        for request, error in result.failed.items():
            self._fail_grammar(request, error)
        for request, token, logprob in zip(result.sampled, result.next_tokens,
                                           result.logprobs):
            if request.finished:
                continue
            self._append_token(request, token, logprob)
            if request.grammar is not None and not request.finished:
                self._jump_forward(request)
        for request, emitted in result.verified.items():
            if not request.finished:
                self._append_verified(request, emitted,
                                      result.verified_logprobs.get(request, [None] * len(emitted)))
            self.speculator.finish(request, emitted)

    def _append_verified(self, request: Request, emitted: list[int],
                         logprobs: list[Any]) -> None:
        """Append a speculating request's accepted drafts and the token after them. Each
        accepted draft's KV was computed by the step, so it counts as computed once it is
        in token_ids; a stop among them ends the request there."""
        *accepted, last = emitted
        for token, logprob in zip(accepted, logprobs):
            self._append_token(request, token, logprob)
            if request.finished:
                return
            request.num_computed_tokens += 1
        self._append_token(request, last, logprobs[-1])
        if not request.finished:
            self.kv.cache_computed(request)

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
            if params.no_stop_trim and request.detokenizer is not None:
                request.detokenizer.push(token)  # its text stays in the output
            self._finish(request, "stop")
            return
        if request.grammar is not None:
            try:
                request.grammar.accept(token)
                complete = request.grammar.is_terminated
            except Exception as exc:
                self._fail_grammar(request, exc)
                return
        detok = request.detokenizer
        if detok is not None:
            detok.push(token)
            if detok.stopped_on is not None:
                request.matched_stop = detok.stopped_on
                self._finish(request, "stop")
                return
        if request.grammar is not None and complete:
            self._finish(request, "stop")  # nothing but EOS could follow: no step for it
        elif (request.num_output_tokens >= params.max_new_tokens
                or len(request.token_ids) >= request.max_total_len):
            self._finish(request, "length")
        elif request.stream:
            delta = detok.take_delta() if detok is not None else ""
            self._emit(request, delta)

    # -- structured output -----------------------------------------------------------------

    def grammar_engine(self) -> Any:
        """The GrammarEngine, built on first use (wrapping the tokenizer takes ~0.5 s).
        Thread-safe: the offline Engine builds it in the caller's thread."""
        with self._grammar_init:
            if self._grammar is None:
                self._grammar = create_grammar_engine(self.config.grammar_backend,
                                                      self.tokenizer, self._vocab_size,
                                                      self.config)
            return self._grammar

    def _start_grammar(self, request: Request) -> None:
        self.counters["grammar_requests"] += 1
        if self.tokenizer is None:
            self._fail_grammar(request, "structured output needs a tokenizer; this model "
                                        "has none")
            return
        request.grammar_future = self.grammar_engine().submit(GrammarSpec.of(request.params))
        self._grammar_waiting.append(request)

    def _attach_grammars(self) -> None:
        waiting, self._grammar_waiting = self._grammar_waiting, []
        for request in waiting:
            future = request.grammar_future
            if request.finished:
                continue
            if not future.done():
                self._grammar_waiting.append(request)
                continue
            request.grammar_future = None
            try:
                compiled = future.result()
                request.grammar = compiled.matcher()
                request.grammar_warnings = compiled.warnings
                complete = request.grammar.is_terminated
            except GrammarCompileError as exc:  # the request's own grammar is at fault
                self._fail_grammar(request, str(exc), invalid=True)
                continue
            except Exception as exc:
                self._fail_grammar(request, exc)
                continue
            if complete:  # the grammar matches only the empty string
                self._finish(request, "stop")
            else:
                self._jump_forward(request)

    def _jump_forward(self, request: Request) -> None:
        """Append the tokens the grammar forces next; the next step computes them at once."""
        if not self.jump_forward or request.params.wants_logprobs:
            return  # (forced tokens would have no logprobs)
        try:
            tokens = request.grammar.forced_tokens(request.token_ids)
        except Exception as exc:
            self._fail_grammar(request, exc)
            return
        for token in tokens[: request.remaining_new_tokens]:
            self.counters["jump_forward_tokens"] += 1
            self._append_token(request, token, None)
            if request.finished:
                break

    def _fail_grammar(self, request: Request, error: str | Exception,
                      invalid: bool = False) -> None:
        """End the request with `error`; `invalid`: its grammar is at fault, not the engine
        (always so for a grammar that outgrew the matcher's limits)."""
        if isinstance(error, Exception):
            if isinstance(error, GrammarLimitError):
                invalid = True
                spec = GrammarSpec.of(request.params)
                error = f"{spec.kind if spec else 'grammar'}: {error}"
            else:
                error = f"grammar error: {error}"
        self.counters["grammar_errors"] += 1
        log.warning("request %s: %s", request.request_id, error)
        request.error = error
        request.error_invalid = invalid
        self._finish(request, "abort")

    def shutdown(self) -> None:
        """Stop background work (the grammar compile workers)."""
        if self._grammar is not None:
            self._grammar.close()

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
            "overlapped_steps": self.counters["overlapped_steps"],
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
            "grammar_requests": self.counters["grammar_requests"],
            "grammar_errors": self.counters["grammar_errors"],
            "grammar_waiting": len(self._grammar_waiting),
            "jump_forward_tokens": self.counters["jump_forward_tokens"],
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self._grammar.stats() if self._grammar is not None else {}),
        }
