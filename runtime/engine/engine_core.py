"""The synchronous engine core: schedule -> run -> postprocess, one step at a time.

It owns the model, the KV memory, the scheduler and every live request. It is driven by one
thread (the offline `Engine`'s loop, later the server's engine process); nothing here locks
(except the lazy creation of the grammar engine, which callers may trigger early).
Grammar-constrained requests are handled by `StructuredOutput` (see structured_output), the
model's runner and speculator are built by `ExecutionSetup` (see execution_setup).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

import torch

from radixlm.runtime.attention import create_backend
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.engine.execution_setup import ExecutionSetup
from radixlm.runtime.engine.kv_sizing import max_model_len, pool_pages
from radixlm.runtime.engine.lora_registry import LoRARegistry
from radixlm.runtime.engine.overlap import follow_up_batch
from radixlm.runtime.engine.structured_output import Compiled, StructuredOutput
from radixlm.runtime.execution.step_result import LaunchedStep, StepResult
from radixlm.runtime.models.loader import LoadedModel
from radixlm.runtime.parallel.sharded import ShardedModel
from radixlm.runtime.parallel.sharded_tier import ShardedTier
from radixlm.runtime.scheduling.kv_manager import KVManager
from radixlm.runtime.scheduling.leases import LeaseTable
from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
from radixlm.runtime.scheduling.radix_cache import RadixCache
from radixlm.runtime.scheduling.request import Request, RequestStatus
from radixlm.runtime.scheduling.scheduler import ScheduledBatch, Scheduler
from radixlm.runtime.scheduling.tiers import make_tier, tier_numerics

log = logging.getLogger(__name__)


def uses_decode_graphs(config: EngineConfig, device: torch.device, attn: Any) -> bool:
    """Whether decode steps replay CUDA graphs (see cuda_graph). Off the GPU the graph
    runner can still run uncaptured: tests switch it on here to check its bookkeeping."""
    return (device.type == "cuda" and not config.disable_cuda_graph
            and attn.supports_cuda_graph and config.pp_size == 1 and config.sp_size == 1)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device,
                 dtype: torch.dtype, draft: LoadedModel | None = None) -> None:
        mc = loaded.config
        self.config = config
        self.device = device
        self.page_size = config.page_size
        # Adapters first: on a GPU their slots take memory the KV pool must not count on.
        # (With tensor parallelism: rank 0's own shard, not the stand-in that drives it.)
        shard = loaded.model.model if isinstance(loaded.model, ShardedModel) else loaded.model
        self.lora = (LoRARegistry(config, shard, device, dtype)
                     if config.lora_enabled else None)
        num_pages = pool_pages(config, [mc] + ([draft.config] if draft else []), dtype, device)
        self.max_model_len = max_model_len(config, mc, num_pages * config.page_size)
        attn = create_backend(config.attention_backend, scale=mc.head_dim ** -0.5,
                              device=device, dtype=dtype, head_dim=mc.head_dim,
                              deterministic=config.deterministic_on(device),
                              fp8_attention=config.fp8_attention)
        graphs = uses_decode_graphs(config, device, attn)
        setup = ExecutionSetup(config, loaded, device, dtype, num_pages, self.max_model_len,
                               graphs)
        self.kv_cache = setup.kv_cache(loaded)
        self.allocator = PageAllocator(num_pages, config.page_size)
        # A row holds one request's slots: at most max_model_len tokens and a verify step's
        # drafts, in whole pages (not the whole pool: a small model's pool on a large GPU
        # holds hundreds of millions of tokens, which rows that wide would not fit).
        drafts = config.num_speculative_tokens + 1 if config.speculative else 0
        row_pages = -(-(self.max_model_len + drafts) // config.page_size)
        self.table = ReqToTokenTable(config.max_running_requests,
                                     min(num_pages, row_pages) * config.page_size,
                                     config.page_size, device)
        self.cache = (None if config.disable_radix_cache
                      else RadixCache(config.page_size, self.allocator))
        numerics = tier_numerics(mc, device, dtype, attn, config, tp_rank=0)
        shard = (loaded.model.model if isinstance(loaded.model, ShardedModel)
                 else loaded.model)  # this rank's weights, which its KV comes from
        self.tier = make_tier(config, shard, self.kv_cache.k, self.kv_cache.v,
                              self.kv_cache.storage_dtype, numerics)
        if self.tier is not None and setup.tp_group is not None:
            self.tier = ShardedTier(self.tier, setup.tp_group)
        self.kv = KVManager(self.allocator, self.table, self.cache, self.tier)
        self.leases = (None if self.cache is None else
                       LeaseTable(self.cache, int(num_pages * config.lease_memory_fraction)))
        self.scheduler = Scheduler(config, self.kv)
        self.runner = setup.runner(loaded, attn, self.kv_cache, self.table,
                                   None if self.lora is None else self.lora.slots)
        self.speculator = (None if config.speculative is None
                           else setup.speculator(draft, self.runner, self.kv, mc.vocab_size))
        self.requests: dict[str, Request] = {}
        self._warm: dict[str, str] = {}  # program id -> the lease keeping its context warm
        self.counters: Counter[str] = Counter()
        self.tokenizer = loaded.tokenizer
        jump_forward = (config.enable_jump_forward if config.enable_jump_forward is not None
                        else not graphs)
        self.structured = StructuredOutput(config, loaded.tokenizer, mc.vocab_size,
                                           self.counters, jump_forward)
        # Speculation needs each step's verified tokens on the host before the next step.
        self.overlap = (self.speculator is None and config.pp_size == 1
                        and config.sp_size == 1) and (
            config.overlap_schedule == "on"
            or config.overlap_schedule == "auto" and device.type == "cuda")
        self._inflight: LaunchedStep | None = None  # launched, not yet post-processed
        # Pipeline parallelism: up to one step per stage in flight, on disjoint requests,
        # post-processed in launch order (see _step_pipelined).
        self.pipeline_depth = config.pp_size
        self._pipeline: deque[LaunchedStep] = deque()

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
        if request.params.constrained and not self.structured.start(request):
            self._finish(request, "abort")

    def abort(self, request_id: str, error: str | None = None) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.error = error
        self._finish(request, "abort")
        return True

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or self._inflight is not None or bool(self._pipeline)
                or self.kv.loading)

    def flush_cache(self) -> None:
        """Drop every cached prefix and every lease. Refused while requests are running or
        waiting."""
        if self.has_work:
            raise ValueError(
                f"cannot flush the prefix cache while {len(self.scheduler.running)} requests "
                f"are running and {len(self.scheduler.waiting)} waiting")
        if self.cache is not None:
            self.leases.release_all()
            self._warm.clear()
            self.cache.reset()

    def release_lease(self, lease_id: str) -> bool:
        return self.leases is not None and self.leases.release(lease_id)

    def load_lora(self, name: Any, path: Any) -> None:
        """Load an adapter while serving with tensor parallelism (on the engine thread,
        between steps): rank 0 reads and checks it, then every rank loads its share at the
        same catalog index; if any rank cannot, it is unloaded again and the error raised."""
        assert self.lora is not None and self.lora.slots.followers is not None
        adapter = self.lora.load(name, path)
        held = {id(r.lora) for r in self.requests.values() if r.lora is not None}
        index = self.lora.catalog_index(held - {id(adapter)})
        self.lora.slots.set_catalog(index, adapter)
        if not self.lora.slots.followers.lora_load(index, name, path):
            self.lora.unload(name)
            raise ValueError(f"lora_path: a tensor-parallel rank could not load {path!r} "
                             "(is it on every host?)")

    def release_program(self, program_id: str) -> bool:
        """The program ended: drop the pin that kept its context warm (program_ttl)."""
        lease = self._warm.pop(program_id, None)
        return lease is not None and self.release_lease(lease)

    def expire_leases(self) -> None:
        if self.leases is not None and len(self.leases):
            self.leases.expire()
            self._warm = {p: lease for p, lease in self._warm.items() if lease in self.leases}

    # -- one step --------------------------------------------------------------------------

    def step(self) -> int:
        """Run one batch; return the number of tokens it computed (0 when idle).

        With overlap scheduling a step is left running on the device and post-processed in
        the next call, right after the step that follows it has been launched, so the host's
        bookkeeping hides behind the device's work (see `_follow_up`)."""
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        if self._inflight is not None:
            follow_up = self._step_overlapped()
            if follow_up is not None:
                return follow_up.scheduled.num_tokens
        scheduled = self._schedule()
        if scheduled is None:
            return 0
        launched = self._run(scheduled)
        if launched is None:  # it failed to launch; its requests are aborted
            return 0
        if self.overlap:
            self._inflight = launched  # post-processed by the next step
        else:
            self._complete(launched)
        return scheduled.num_tokens

    def _step_overlapped(self) -> LaunchedStep | None:
        """Launch the step after the one in flight, then post-process the one in flight
        while the device runs the new one, which is in flight now. None when there is no
        such step: the scheduler decides anew, from the post-processed state."""
        inflight, self._inflight = self._inflight, None
        follow = self._follow_up(inflight)
        self._complete(inflight)
        if follow is not None:
            self._inflight = follow
            self.counters["overlapped_steps"] += 1
        return follow

    def _step_pipelined(self) -> int:
        """Pipeline parallelism: launch a batch of requests that are not in flight (rank 0
        runs the first stage, then hands the batch on), while up to pipeline_depth - 1
        earlier batches are still in the later stages; post-process the oldest once the
        pipeline is full or nothing else can start. Each batch takes about a
        1/pipeline_depth share of the requests, so every stage has one to work on."""
        if len(self._pipeline) >= self.pipeline_depth:
            self._complete(self._pipeline.popleft())
        busy = {r for launched in self._pipeline for r in launched.scheduled.requests}
        scheduled = self._schedule(busy, self.pipeline_depth)
        if scheduled is None:
            if not self._pipeline:
                return 0
            oldest = self._pipeline.popleft()
            self._complete(oldest)
            return oldest.scheduled.num_tokens
        launched = self._run(scheduled)
        if launched is None:  # it failed to launch; its requests are aborted
            return 0
        if self._pipeline:
            self.counters["pipelined_steps"] += 1
        self._pipeline.append(launched)
        return scheduled.num_tokens

    def _schedule(self, busy: set[Request] | None = None,
                  shares: int = 1) -> ScheduledBatch | None:
        """The next batch, once the grammars that compiled are attached; None when nothing
        can run now. `busy`, `shares`: see Scheduler.schedule."""
        if self.structured.compiling:
            self._attach_grammars()
        if self.kv.loading:
            self.kv.finish_loads()
        scheduled = self.scheduler.schedule(busy or frozenset(), shares)
        if scheduled is None and not busy:  # in-flight requests may be all there is
            self._unblock()
        return scheduled

    def _unblock(self) -> None:
        """Nothing could be scheduled: wait a little for a grammar compile, or give up a
        lease whose pages are in the way."""
        if self.structured.compiling or self.kv.loading:
            # Only compiles or loads to wait for (not pages: held-back requests hold few, a
            # load's are taken): don't spin.
            if self.kv.loading:
                self.kv.wait_for_a_load(timeout=0.01)
            else:
                self.structured.wait_for_a_compile(timeout=0.01)
        elif (self.scheduler.has_work and self.leases is not None
                and self.leases.release_oldest()):
            # Work is waiting but nothing fits: only leased pages can be in the way (alone,
            # any request fits the pool). Pins are hints; they give way.
            log.warning("released a prefix lease: its pages were needed to make progress")

    def _run(self, scheduled: ScheduledBatch) -> LaunchedStep | None:
        """Launch the batch on the device, with speculative drafts when speculating."""
        if self.speculator is not None:
            self.speculator.propose(scheduled)
        return self._launch(scheduled)

    def _follow_up(self, prev: LaunchedStep) -> LaunchedStep | None:
        batch = follow_up_batch(prev, self.scheduler, self.kv, self.config,
                                bool(self.structured.compiling))
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
        # max_new_tokens=0: prompt processing only. (The context is never full here: prompts
        # are shorter than it, and the check below ends a request that fills it.)
        if request.remaining_new_tokens == 0:
            self._finish(request, "length")
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
        elif request.remaining_new_tokens == 0:
            self._finish(request, "length")
        elif request.stream:
            delta = detok.take_delta() if detok is not None else ""
            self._emit(request, delta)

    # -- structured output (the grammar side is StructuredOutput's) ----------------------------

    def _attach_grammars(self) -> None:
        for request, compiled in self.structured.attach_compiled():
            if compiled is Compiled.FAILED:
                self._finish(request, "abort")
            elif compiled is Compiled.COMPLETE:
                self._finish(request, "stop")
            else:
                self._jump_forward(request)

    def _jump_forward(self, request: Request) -> None:
        """Append the tokens the grammar forces next; the next step computes them at once."""
        tokens = self.structured.forced_tokens(request)
        if tokens is None:
            self._finish(request, "abort")
            return
        for token in tokens:
            self.counters["jump_forward_tokens"] += 1
            self._append_token(request, token, None)
            if request.finished:
                break

    def _fail_grammar(self, request: Request, error: str | Exception) -> None:
        self.structured.record_failure(request, error)
        self._finish(request, "abort")

    def grammar_engine(self) -> Any:
        """The GrammarEngine, built on first use; any thread may call this (see
        StructuredOutput.grammar_engine)."""
        return self.structured.grammar_engine()

    def shutdown(self) -> None:
        """Stop background work (the grammar compile workers; the disk tier's writer, once
        the pages given to it are written)."""
        self.structured.close()
        if self.tier is not None:
            self.tier.close()

    def _finish(self, request: Request, reason: str) -> None:
        if request.finished:
            return
        if request.pin_ttl is not None and reason != "abort" and self.leases is not None:
            # The prompt is computed and its full pages are in the tree under cache_node
            # (cache_computed ran after the step); lock them before release() unlocks.
            self.kv.cache_computed(request)
            request.lease_id = self.leases.pin(request.cache_node, request.pin_ttl)
        elif (request.program_id is not None and reason != "abort"
              and self.leases is not None and self.config.program_ttl > 0):
            self.kv.cache_computed(request)
            self._keep_warm(request)
        self.scheduler.finish(request, reason)
        self.requests.pop(request.request_id, None)
        self.counters["requests_finished"] += 1
        self.scheduler.programs.record(request)
        delta = ""
        if request.detokenizer is not None:
            request.detokenizer.finish()
            delta = request.detokenizer.take_delta()
        self._emit(request, delta)

    def _keep_warm(self, request: Request) -> None:
        """Pin what the program's request computed (its prompt and output) until its next call
        ends, the program ends or program_ttl passes; the program's previous pin goes."""
        assert self.leases is not None and request.program_id is not None
        old = self._warm.pop(request.program_id, None)
        if old is not None:
            self.leases.release(old)
        lease = self.leases.pin(request.cache_node, self.config.program_ttl, quiet=True)
        if lease is not None:
            self._warm[request.program_id] = lease

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
            "graph_steps": self.runner.graph_steps,
            "overlapped_steps": self.counters["overlapped_steps"],
            "pipelined_steps": self.counters["pipelined_steps"],
            "requests_finished": self.counters["requests_finished"],
            "programs": self.scheduler.programs.snapshot(),
            **self.scheduler.programs.totals(),
            "retractions": self.scheduler.num_retractions,
            "program_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_total": self.allocator.num_pages,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_cached": self.cache.total_pages if self.cache else 0,
            "kv_pages_evictable": self.cache.evictable_pages if self.cache else 0,
            "kv_pages_loading": self.kv.loading_pages,
            "leases": len(self.leases) if self.leases else 0,
            "kv_pages_leased": self.leases.leased_pages if self.leases else 0,
            "page_size": self.page_size,
            "max_model_len": self.max_model_len,
            **self.structured.stats(),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.tier.stats() if self.tier is not None else {}),
            **(self.lora.stats() if self.lora is not None else {}),
            **self.structured.engine_stats(),
        }
