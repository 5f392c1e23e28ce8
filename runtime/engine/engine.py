"""The public offline engine: `Engine().generate(...)`, streaming, chat, abort, stats.

The engine core runs in a background thread of the caller's process (see engine_thread). Calls
validate and tokenize in the caller's thread (so bad input raises before anything is queued),
hand requests to that thread's loop through its inbox, and wait for results (or stream them to
an asyncio loop).

An engine left open is closed at interpreter exit (an atexit hook that holds it weakly): its
thread must not be running a step while the interpreter tears itself down, which aborts the
process ("terminate called without an active exception"). Closing fails the calls waiting on
the engine with EngineClosedError, from whichever thread it comes.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import sys
import weakref
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from tqdm.auto import tqdm

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.config.program_tags import check_program_id
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.engine.engine_core import EngineCore
from radixlm.runtime.engine.engine_thread import CLOSED, EngineClosedError, EngineThread
from radixlm.runtime.engine.model_loading import load_engine_models
from radixlm.runtime.engine.request_factory import RequestFactory
from radixlm.runtime.models.loader import declared_quantization
from radixlm.runtime.parallel.sharded import TensorParallelGroup
from radixlm.runtime.scheduling.request import Output, Request

log = logging.getLogger(__name__)

ParamsArg = SamplingParams | Mapping[str, Any] | None

__all__ = ["Engine", "EngineClosedError"]


class Engine:
    """An LLM engine in this process.

    >>> with Engine() as engine:                      # the embedded SmolLM2-135M-Instruct
    ...     out = engine.generate("The capital of France is", {"max_new_tokens": 8,
    ...                                                        "temperature": 0})
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **options)
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype(self.device, declared_quantization(
            self.config.model, self.config.load_format, self.config.revision))
        # tp_size, pp_size or sp_size > 1: this process is rank 0; the other ranks start now
        # and load their shards (stages, copies) while this one loads its own.
        ranks = self.config.tp_size * self.config.pp_size * self.config.sp_size
        self._tp = (TensorParallelGroup(self.config, self.device, self.dtype)
                    if ranks > 1 else None)
        try:
            self._engine_thread = EngineThread(self._build_core, self._tp,
                                               self.config.tp_timeout)
        except BaseException:
            if self._tp is not None:
                self._tp.shutdown(graceful=False)
            raise
        self.core: EngineCore | None = self._engine_thread.core
        self.max_model_len = self.core.max_model_len
        self._factory = RequestFactory(self.tokenizer, self.model_config.vocab_size,
                                       frozenset(self._eos_ids()), self.max_model_len,
                                       self.device, self.config.seed)
        _open_engines.add(self)

    # -- public API ---------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: ParamsArg | Sequence[ParamsArg] = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 request_id: str | Sequence[str] | None = None,
                 cache_salt: str | None = None,
                 use_tqdm: bool | None = None, program_id: str | None = None,
                 priority: int = 0,
                 lora: str | Sequence[str | None] | None = None) -> Output | list[Output]:
        """Generate for one prompt (-> Output, or a list of n Outputs when n > 1) or a list of
        prompts (-> a flat list, n Outputs per prompt, in order).

        Requests with different `cache_salt`s never share cached KV (e.g. one per tenant).
        `program_id` names the program the requests belong to (per-program statistics);
        `priority` orders admission, lower first. `lora` names the LoRA adapter to run with
        (one for every prompt, or one per prompt; None: the base model)."""
        single, prompts = self._normalize_prompts(prompt, input_ids)
        requests = self._make_requests(prompts, sampling_params, request_id, cache_salt,
                                       stream=False, program_id=program_id, priority=priority,
                                       lora=lora)
        show = use_tqdm if use_tqdm is not None else len(requests) >= 16 and sys.stderr.isatty()
        ordered = self._run(requests, show)
        return ordered[0] if single and len(ordered) == 1 else ordered

    async def generate_stream(self, prompt: str | None = None,
                              sampling_params: ParamsArg = None, *,
                              input_ids: Sequence[int] | None = None,
                              request_id: str | None = None,
                              cache_salt: str | None = None,
                              queue_rank: int | None = None, program_id: str | None = None,
                              priority: int = 0, lora: str | None = None
                              ) -> AsyncIterator[Output]:
        """Yield an Output per new token (with `delta`), the last one with `finish_reason`.
        `queue_rank`: where this prompt's samples stand in a batch that a caller (a server)
        submits one prompt at a time, for fair admission (see Request.queue_rank)."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[Output] = asyncio.Queue()
        ids = self.submit_stream(_threadsafe_put(loop, chunks), prompt, sampling_params,
                                 input_ids=input_ids, request_id=request_id,
                                 cache_salt=cache_salt, queue_rank=queue_rank,
                                 program_id=program_id, priority=priority, lora=lora)
        remaining = len(ids)
        try:
            while remaining:
                out = await chunks.get()
                remaining -= out.finished
                if _closed_under(out):
                    raise EngineClosedError("the engine was closed during generate_stream")
                yield out
        finally:
            if remaining:  # the consumer stopped early
                for rid in ids:
                    self.abort(rid)

    def submit_stream(self, on_output: Callable[[Output], None], prompt: str | None = None,
                      sampling_params: ParamsArg = None, *,
                      input_ids: Sequence[int] | None = None,
                      request_id: str | None = None,
                      cache_salt: str | None = None,
                      queue_rank: int | None = None, program_id: str | None = None,
                      priority: int = 0, lora: str | None = None) -> list[str]:
        """Start one prompt's samples and return their request ids; `on_output` gets an
        Output per new token, the last one with `finish_reason`. It is called on the engine
        thread, so it must be quick and never block (e.g. put the Output on a queue): it is
        what a server uses to collect a whole step's outputs without one event-loop wake-up
        per token. Bad input raises ValueError here, before anything is queued."""
        single, prompts = self._normalize_prompts(prompt, input_ids)
        if not single:
            raise ValueError("prompt: a stream takes one prompt")
        requests = self._make_requests(prompts, sampling_params, request_id, cache_salt,
                                       stream=True, first_rank=queue_rank,
                                       program_id=program_id, priority=priority, lora=lora)
        for request in requests:
            request.on_output = on_output
        self._submit(requests)
        return [r.request_id for r in requests]

    async def async_generate(self, prompt: str | None = None,
                             sampling_params: ParamsArg = None, *,
                             input_ids: Sequence[int] | None = None,
                             request_id: str | None = None,
                             cache_salt: str | None = None, program_id: str | None = None,
                             priority: int = 0, lora: str | None = None
                             ) -> Output | list[Output]:
        """`generate` for one prompt, awaited without blocking the event loop (and without a
        thread): an Output, or a list of n Outputs when n > 1."""
        single, prompts = self._normalize_prompts(prompt, input_ids)
        if not single:
            raise ValueError("prompt: async_generate takes one prompt")
        ordered = await self._run_async(self._make_requests(
            prompts, sampling_params, request_id, cache_salt, stream=False,
            program_id=program_id, priority=priority, lora=lora))
        return ordered[0] if len(ordered) == 1 else ordered

    def pin_prefix(self, prompt: str | None = None, *,
                   input_ids: Sequence[int] | None = None, cache_salt: str | None = None,
                   ttl: float = 600.0, lora: str | None = None) -> str | None:
        """Compute a prefix and pin its KV pages in the prefix cache for `ttl` seconds, so
        requests that extend it always hit, even under memory pressure. Returns the lease id
        for `release_prefix`, or None when nothing was pinned: the radix cache is off, the
        prefix is shorter than a page, or leased memory is at `lease_memory_fraction` (a
        warning is logged; requests still run, unpinned)."""
        return _pinned(self._run(self._pin_requests(prompt, input_ids, cache_salt, ttl, lora)))

    async def async_pin_prefix(self, prompt: str | None = None, *,
                               input_ids: Sequence[int] | None = None,
                               cache_salt: str | None = None, ttl: float = 600.0,
                               lora: str | None = None) -> str | None:
        """`pin_prefix`, awaited."""
        return _pinned(await self._run_async(self._pin_requests(prompt, input_ids, cache_salt,
                                                                ttl, lora)))

    def _pin_requests(self, prompt: str | None, input_ids: Sequence[int] | None,
                      cache_salt: str | None, ttl: float, lora: str | None) -> list[Request]:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        single, prompts = self._normalize_prompts(prompt, input_ids)
        if not single:
            raise ValueError("prompt: pin_prefix takes one prefix")
        requests = self._make_requests(prompts, SamplingParams(max_new_tokens=0, temperature=0),
                                       None, cache_salt, stream=False, lora=lora)
        requests[0].pin_ttl = float(ttl)
        return requests

    def release_prefix(self, lease_id: str) -> bool:
        """Release a lease from `pin_prefix`; False when it is unknown or already expired."""
        if not isinstance(lease_id, str):
            raise ValueError(f"lease_id must be a string, got {type(lease_id).__name__}")
        return self._call(lambda core: core.release_lease(lease_id))

    def release_program(self, program_id: str) -> bool:
        """The program ended: drop the pin that kept its context warm between its calls
        (program_ttl); False when there was none (or it expired)."""
        check_program_id(program_id)
        return self._call(lambda core: core.release_program(program_id))

    def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` (a PEFT folder or a GGUF adapter file) as `name` (needs
        allow_runtime_lora_loading; PermissionError otherwise, ValueError naming the field
        when it cannot be served).
        With tensor parallelism every rank loads its share, between two steps."""
        registry = self._lora_registry()
        if registry.slots.followers is None:
            registry.load(name, path)
        else:
            self._call(lambda core: core.load_lora(name, path))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`: new requests naming it are refused; requests already
        running with it finish with it."""
        self._lora_registry().unload(name)

    def loras(self) -> list[dict[str, Any]]:
        """The adapters served: name, path and rank of each."""
        registry = self._live_core().lora
        return [] if registry is None else registry.listing()

    def _lora_registry(self) -> Any:
        registry = self._live_core().lora
        if registry is None:
            raise PermissionError("this engine serves no adapters: start it with "
                                  "allow_runtime_lora_loading to load them while serving")
        return registry

    def score(self, prefix_ids: Sequence[int], continuation_ids: Sequence[Sequence[int]], *,
              cache_salt: str | None = None, request_id: str | None = None,
              program_id: str | None = None, priority: int = 0,
              lora: str | None = None) -> list[list[float]]:
        """Logprob of every token of each continuation, given the prefix and the
        continuation's earlier tokens. One batch: the prefix is computed once and shared
        (prompt-token logprobs; nothing is generated). With a `request_id`, its requests are
        "<id>#<i>", so abort(request_id) stops them all."""
        return _scores(self._run(self._score_requests(prefix_ids, continuation_ids, cache_salt,
                                                      request_id, program_id, priority, lora)))

    async def async_score(self, prefix_ids: Sequence[int],
                          continuation_ids: Sequence[Sequence[int]], *,
                          cache_salt: str | None = None, request_id: str | None = None,
                          program_id: str | None = None, priority: int = 0,
                          lora: str | None = None) -> list[list[float]]:
        """`score`, awaited."""
        return _scores(await self._run_async(self._score_requests(
            prefix_ids, continuation_ids, cache_salt, request_id, program_id, priority, lora)))

    def _score_requests(self, prefix_ids: Sequence[int],
                        continuation_ids: Sequence[Sequence[int]], cache_salt: str | None,
                        request_id: str | None, program_id: str | None,
                        priority: int, lora: str | None) -> list[Request]:
        prefix = self._check_ids(prefix_ids)
        if not isinstance(continuation_ids, (list, tuple)) or not continuation_ids:
            raise ValueError("continuation_ids must be a non-empty list of token id lists")
        prompts = [prefix + self._check_ids(ids) for ids in continuation_ids]
        params = SamplingParams(max_new_tokens=0, temperature=0, logprob_start_len=len(prefix))
        ids = None if request_id is None else [f"{request_id}#{i}" for i in range(len(prompts))]
        return self._make_requests(prompts, params, ids, cache_salt, stream=False,
                                   program_id=program_id, priority=priority, lora=lora)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping]],
             sampling_params: ParamsArg | Sequence[ParamsArg] = None,
             **kwargs: Any) -> Output | list[Output]:
        """Apply the tokenizer's chat template and generate. A list of conversations batches."""
        batch = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if batch else [messages]
        ids = [self.encode_chat(c) for c in conversations]
        return self.generate(input_ids=ids if batch else ids[0],
                             sampling_params=sampling_params, **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of a conversation with the assistant prompt appended. The template
        already writes the special tokens (e.g. BOS), so the tokenizer must not add them."""
        return self.tokenizer.encode(self.apply_chat_template(messages),
                                     add_special_tokens=False)

    def is_special_token(self, text: str) -> bool:
        """Is `text` one of the tokenizer's special tokens (which detokenizing skips unless
        `skip_special_tokens` is off)?"""
        from radixlm.runtime.grammar.structural_tag import special_tokens

        return self.tokenizer is not None and text in special_tokens(self.tokenizer)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as the chat template writes it (`tools` in OpenAI's shape, for
        templates that render them)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        if not messages:
            raise ValueError("messages must not be empty")
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools or []) or None,
                                                  tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def abort(self, request_id: str) -> None:
        """Stop a request (and its n samples); it finishes with finish_reason "abort"."""
        self._engine_thread.abort(request_id)

    def flush_cache(self) -> None:
        """Drop every cached prefix (e.g. after changing weights). Refused with a ValueError
        while requests are running."""
        self._call(EngineCore.flush_cache)

    def stats(self) -> dict[str, Any]:
        """The engine's counters and gauges; after close, as they were when it stopped."""
        core = self.core
        return core.stats() if core is not None else dict(self._engine_thread.final_stats)

    @property
    def has_work(self) -> bool:
        """Requests running or waiting (read from any thread: a snapshot)."""
        core = self.core
        return core is not None and core.has_work

    @property
    def loop_rounds(self) -> int:
        """Rounds of the engine loop so far: a watchdog on another thread reads it (with
        has_work) to tell a busy engine from a stalled one."""
        return self._engine_thread.rounds

    def close(self) -> None:
        """Stop the engine thread and free what it holds. Safe from any thread and more than
        once; calls waiting on the engine raise EngineClosedError, and so do later calls."""
        _open_engines.discard(self)
        # The engine thread lets go of the core (and with it the device memory) as it ends.
        self.core = None
        self._engine_thread.stop()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live_core(self) -> EngineCore:
        core = self.core
        if core is None:
            raise EngineClosedError("the engine is closed")
        return core

    def _build_core(self) -> EngineCore:
        """Load the models and build the core (on the engine thread)."""
        models = load_engine_models(self.config, self.device, self.dtype, self._tp)
        self.model_config = models.model_config
        self.tokenizer = models.target.tokenizer
        return EngineCore(self.config, models.target, self.device, self.dtype, models.draft)

    # -- building requests (caller's thread) --------------------------------------------------

    def _normalize_prompts(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        return self._factory.prompts(prompt, input_ids)

    def _check_ids(self, ids: Any) -> list[int]:
        return self._factory.check_ids(ids)

    def _make_requests(self, prompts: list[list[int]], sampling_params: Any,
                       request_id: Any, cache_salt: Any, stream: bool,
                       first_rank: int | None = None, program_id: Any = None,
                       priority: Any = 0, lora: Any = None) -> list[Request]:
        requests = self._factory.requests(prompts, sampling_params, request_id, cache_salt,
                                          stream, on_output=_ignore, first_rank=first_rank,
                                          program_id=program_id, priority=priority,
                                          loras=self._adapters(lora, len(prompts)))
        if any(r.params.constrained for r in requests):
            self._live_core().grammar_engine()  # built here, not on the engine thread
        return requests

    def _adapters(self, lora: Any, count: int) -> list[Any] | None:
        """Each prompt's adapter from `lora`: a name for all, or a list with one per prompt."""
        if lora is None:
            return None
        registry = self._live_core().lora
        if registry is None:
            raise ValueError("lora: this engine serves no adapters (start it with "
                             "lora_modules or allow_runtime_lora_loading)")
        names = list(lora) if isinstance(lora, (list, tuple)) else [lora] * count
        if len(names) != count:
            raise ValueError(f"lora: got {len(names)} adapter names for {count} prompts")
        return [None if name is None else registry.resolve(name) for name in names]

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _run(self, requests: list[Request], show_progress: bool = False) -> list[Output]:
        """Submit requests and wait for all of them; outputs in request order."""
        results: queue.SimpleQueue[Output] = queue.SimpleQueue()
        for request in requests:
            request.on_output = results.put
        outputs: dict[str, Output] = {}
        self._submit(requests)
        try:
            with tqdm(total=len(requests), disable=not show_progress, desc="generate") as bar:
                while len(outputs) < len(requests):
                    out = results.get()
                    outputs[out.request_id] = out
                    bar.update(1)
        except BaseException:  # e.g. KeyboardInterrupt: don't leave work behind
            self._abort_all(requests)
            raise
        return _in_order(requests, outputs)

    async def _run_async(self, requests: list[Request]) -> list[Output]:
        """`_run` for a coroutine: the outputs arrive on its loop; cancelling aborts."""
        results: asyncio.Queue[Output] = asyncio.Queue()
        put = _threadsafe_put(asyncio.get_running_loop(), results)
        for request in requests:
            request.on_output = put
        outputs: dict[str, Output] = {}
        self._submit(requests)
        try:
            while len(outputs) < len(requests):
                out = await results.get()
                outputs[out.request_id] = out
        except BaseException:
            self._abort_all(requests)
            raise
        return _in_order(requests, outputs)

    def _abort_all(self, requests: list[Request]) -> None:
        for request in requests:
            self.abort(request.request_id)

    def _call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread; return its result or raise its exception."""
        return self._engine_thread.call(fn)

    def _submit(self, requests: list[Request]) -> None:
        self._engine_thread.submit(requests)


def _ignore(_: Output) -> None:
    pass


def _in_order(requests: list[Request], outputs: dict[str, Output]) -> list[Output]:
    """The outputs of a finished call, in request order; the engine's closing raises."""
    if any(_closed_under(out) for out in outputs.values()):
        raise EngineClosedError("the engine was closed while a call waited on it")
    return [outputs[r.request_id] for r in requests]


def _pinned(outputs: list[Output]) -> str | None:
    if outputs[0].error is not None:
        raise RuntimeError(f"pin_prefix failed: {outputs[0].error}")
    return outputs[0].lease_id


def _scores(outputs: list[Output]) -> list[list[float]]:
    failed = [o.error for o in outputs if o.error is not None or o.finish_reason == "abort"]
    if failed:
        raise RuntimeError(f"score failed: {failed[0]}")
    return [[entry.logprob for entry in out.prompt_logprobs] for out in outputs]


def _closed_under(out: Output) -> bool:
    """Whether the request was failed by the engine closing (engine_thread.CLOSED)."""
    return out.finish_reason == "abort" and out.error == CLOSED


def _threadsafe_put(loop: asyncio.AbstractEventLoop,
                    chunks: asyncio.Queue[Output]) -> Callable[[Output], None]:
    def put(out: Output) -> None:
        try:
            loop.call_soon_threadsafe(chunks.put_nowait, out)
        except RuntimeError:  # the loop is closed: a consumer that went away needs no more
            pass
    return put


# Engines not closed yet, held weakly: the hook below closes them at interpreter exit, and a
# dropped engine is still freed at once (no reference keeps it alive until then).
_open_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except Exception:  # one engine failing to close must not keep the others open
            log.exception("closing an engine at exit failed")
