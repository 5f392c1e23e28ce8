"""`@rl.function`: a Python function over a state `s` becomes a program you can run, batch
and stream on any backend.

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    state = qa.run(question="Why is the sky blue?", backend=rl.Engine(), temperature=0)
    print(state["answer"])
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

from tqdm.auto import tqdm

from radixlm.backends import background
from radixlm.backends.backend import Backend, Prompt, resolve_backend, using_adapter
from radixlm.expr import (
    ADAPTER,
    FIELD_NAMES,
    LANGUAGE_ONLY_FIELDS,
    SAMPLING_ALIASES,
    adapter_name,
    normalize_sampling,
)
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.choices import ChoiceScores
from radixlm.state import ProgramState, Run

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64  # programs of a batch in flight at once
# Streamed arun bodies still running: the loop only keeps weak references to its tasks.
_background_tasks: set[asyncio.Task[None]] = set()


class Program:
    def __init__(self, fn: Callable[..., Any], bound: Mapping[str, Any] | None = None,
                 raise_errors: bool = False, num_api_spec_tokens: int | None = None) -> None:
        self.fn = fn
        self.bound = dict(bound or {})
        # Speculative API execution on backends that support it (see backends/speculation.py).
        self.num_api_spec_tokens = num_api_spec_tokens
        # True: an exception the program's own code raises also propagates out of run() (and
        # run_batch()), as in SGLang, besides being recorded in the state.
        self.raise_errors = raise_errors
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters)
        if not params:
            raise TypeError(f"@rl.function {fn.__name__}: the first parameter must be the "
                            f"state (def {fn.__name__}(s, ...))")
        self.arg_names = params[1:]
        functools.update_wrapper(self, fn)

    def bind(self, **kwargs: Any) -> "Program":
        """A program with some arguments fixed."""
        self._split(kwargs)  # unknown names fail here, not at run time
        return Program(self.fn, {**self.bound, **kwargs}, self.raise_errors,
                       self.num_api_spec_tokens)

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Run the program. Keyword arguments are the program's own, then sampling defaults
        for every gen in it (e.g. temperature=0, max_tokens=64; a gen's own fields win).
        With stream=True it returns at once; read the output with `state.text_iter()`.
        A failure is recorded in `state.error()` (reading a variable it prevented raises).
        The program's code runs on this thread (an `async def` program on the background
        loop); its expressions execute on the background loop. (`use_thread` is SGLang's.)"""
        backend = resolve_backend(backend)  # here: `use_backend` is this thread's context
        if self.is_async:
            return background.run(self.arun(*args, backend=backend, stream=stream, **kwargs))
        call_args, defaults = self._arguments(args, kwargs)
        run = Run(backend, defaults, stream, background.loop(), self.num_api_spec_tokens)
        state = ProgramState(run, run.interpreter())
        if stream:
            threading.Thread(target=self._execute, args=(run, state, call_args),
                             name="radixlm-program-body", daemon=True).start()
        else:
            self._execute(run, state, call_args)
        return state

    async def arun(self, *args: Any, backend: Backend | None = None, stream: bool = False,
                   **kwargs: Any) -> ProgramState:
        """`run` for asyncio code: the program and its expressions run as tasks of the
        running loop, with no thread of their own. An `async def` program reads values with
        `await s.aget(name)` (and forks with `await s.afork(n)`, joins with
        `await s.ajoin(forks)`); a plain `def` program may only append (a read would block
        the loop, and raises ProgramError). Cancelling the call stops the program's requests.
        With stream=True it returns at once; read with `state.text_async_iter()`."""
        backend = resolve_backend(backend)
        call_args, defaults = self._arguments(args, kwargs)
        run = Run(backend, defaults, stream, asyncio.get_running_loop(),
                  self.num_api_spec_tokens)
        state = ProgramState(run, run.interpreter())
        if stream:
            task = asyncio.create_task(self._aexecute(run, state, call_args))
            _background_tasks.add(task)
            task.add_done_callback(_background_tasks.discard)
        else:
            await self._aexecute(run, state, call_args)
        return state

    def run_batch(self, batch_kwargs: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                  backend: Backend | None = None, concurrency: int | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = True,
                  generator_style: bool = False, **defaults: Any
                  ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per item of `batch_kwargs` (a dict of arguments, or a tuple of
        them in the program's order), `concurrency` (SGLang: `num_threads`; "auto" is 64) at a
        time. The states come back in input order, each with its own error (one failure stops
        nothing else); `generator_style=True` yields each as soon as it and those before it
        are done. The prefix all runs share is computed once first and kept cached."""
        backend = resolve_backend(backend)
        concurrency = _concurrency(concurrency, num_threads)
        prepared = self._prepare(batch_kwargs, defaults)
        if self.is_async:
            states = background.run(self._arun_all(backend, prepared, concurrency,
                                                   progress_bar))
            return iter(states) if generator_style else states
        states = self._run_all(backend, prepared, concurrency, progress_bar)
        return states if generator_style else list(states)

    async def arun_batch(self, batch_kwargs: Sequence[Mapping[str, Any] | Sequence[Any]], *,
                         backend: Backend | None = None, concurrency: int | None = None,
                         num_threads: int | str = "auto", progress_bar: bool = True,
                         **defaults: Any) -> list[ProgramState]:
        """`run_batch` for asyncio code: every run is a task of the running loop (at most
        `concurrency` at once), with no thread per program; see `arun`."""
        backend = resolve_backend(backend)
        concurrency = _concurrency(concurrency, num_threads)
        return await self._arun_all(backend, self._prepare(batch_kwargs, defaults),
                                    concurrency, progress_bar)

    @property
    def is_async(self) -> bool:
        """An `async def` program (it awaits its reads)."""
        return inspect.iscoroutinefunction(self.fn)

    def _prepare(self, batch_kwargs: Any, defaults: Mapping[str, Any]) -> list:
        if isinstance(batch_kwargs, Mapping) or not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: pass a list of dicts (or tuples) of program arguments")
        return [self._arguments(*_batch_item(self, item), defaults) for item in batch_kwargs]

    def _run_all(self, backend: Backend, prepared: list, concurrency: int,
                 progress_bar: bool) -> Iterator[ProgramState]:
        lease = background.run(self._warm(backend, prepared))
        try:
            with ThreadPoolExecutor(max_workers=concurrency,
                                    thread_name_prefix="radixlm-batch") as pool, \
                    tqdm(total=len(prepared), disable=not progress_bar,
                         desc=self.fn.__name__) as bar:
                def one(item: tuple[inspect.BoundArguments, dict[str, Any]]) -> ProgramState:
                    call_args, sampling = item
                    run = Run(backend, sampling, False, background.loop(),
                              self.num_api_spec_tokens)
                    state = ProgramState(run, run.interpreter())
                    self._execute(run, state, call_args)
                    bar.update(1)
                    return state

                yield from pool.map(one, prepared)
        finally:
            if lease is not None:
                backend.release_prefix(lease)

    async def _arun_all(self, backend: Backend, prepared: list, concurrency: int,
                        progress_bar: bool) -> list[ProgramState]:
        lease = await self._warm(backend, prepared)
        slots = asyncio.Semaphore(concurrency)
        loop = asyncio.get_running_loop()
        try:
            with tqdm(total=len(prepared), disable=not progress_bar,
                      desc=self.fn.__name__) as bar:
                async def one(call_args: inspect.BoundArguments,
                              sampling: dict[str, Any]) -> ProgramState:
                    async with slots:
                        run = Run(backend, sampling, False, loop, self.num_api_spec_tokens)
                        state = ProgramState(run, run.interpreter())
                        await self._aexecute(run, state, call_args)
                        bar.update(1)
                        return state

                return list(await asyncio.gather(*(one(*item) for item in prepared)))
        finally:
            if lease is not None:
                await backend.arelease_prefix(lease)

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> str:
        """The text the program builds before its first gen or select, for these arguments
        (with the backend's chat template): the prefix its runs share."""
        backend = resolve_backend(backend)
        call_args, _ = self._arguments((), kwargs)
        prefix = background.run(self._trace(backend, call_args))
        return prefix or ""

    def cache(self, backend: Backend | None = None, **kwargs: Any) -> str:
        """Compute the KV of the program's prefix (see `trace`) into the backend's prefix
        cache now, so the first runs find it there; it stays cached like any prefix (until
        evicted). Returns the prefix."""
        backend = resolve_backend(backend)
        prefix = self.trace(backend=backend, **kwargs)
        if prefix and backend.supports_cache_hints:
            backend.generate(Prompt(prefix), SamplingParams(max_new_tokens=0))
        return prefix

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    # -- internals ---------------------------------------------------------------------------

    def _split(self, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Program arguments vs sampling defaults; a name the program takes is its own."""
        program, sampling = {}, {}
        for key, value in kwargs.items():
            if key in self.arg_names:
                program[key] = value
            elif (key in FIELD_NAMES or key in SAMPLING_ALIASES or key in LANGUAGE_ONLY_FIELDS
                  or key == ADAPTER):
                sampling[key] = value
            else:
                raise TypeError(f"{self.fn.__name__}() got an unexpected argument {key!r}: "
                                f"not a parameter of the program nor a sampling field")
        return program, sampling

    def _arguments(self, args: tuple, kwargs: Mapping[str, Any],
                   defaults: Mapping[str, Any] | None = None
                   ) -> tuple[inspect.BoundArguments, dict[str, Any]]:
        program, sampling = self._split({**(defaults or {}), **self.bound, **kwargs})
        try:
            call_args = self.signature.bind(None, *args, **program)
        except TypeError as exc:
            raise TypeError(f"{self.fn.__name__}(): {exc}") from None
        call_args.apply_defaults()
        return call_args, normalize_sampling(sampling, f"{self.fn.__name__}.run")

    def _execute(self, run: Run, state: ProgramState, call_args: inspect.BoundArguments) -> None:
        raised = None
        try:
            self.fn(state, *call_args.args[1:], **call_args.kwargs)
        except BaseException as exc:  # noqa: BLE001 - recorded in the state, see run()
            state._interp.fail(exc)
            raised = exc
        finally:
            run.finish()
        self._report(state, raised)

    async def _aexecute(self, run: Run, state: ProgramState,
                        call_args: inspect.BoundArguments) -> None:
        raised = None
        try:
            body = self.fn(state, *call_args.args[1:], **call_args.kwargs)
            if inspect.isawaitable(body):
                await body
        except asyncio.CancelledError as exc:  # the caller gave up: so does every request
            run.cancel(exc)
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded in the state, see run()
            state._interp.fail(exc)
            raised = exc
        try:
            await run.afinish()
        except asyncio.CancelledError as exc:
            run.cancel(exc)
            raise
        self._report(state, raised)

    def _report(self, state: ProgramState, raised: BaseException | None) -> None:
        if raised is not None and self.raise_errors:
            raise raised
        if state._interp.error is not None:
            log.warning("program %s failed: %s", self.fn.__name__, state._interp.error)

    async def _warm(self, backend: Backend, prepared: list) -> Any:
        """Pin the text every run starts with before its first generation, found by tracing
        the program on each run's arguments."""
        if not backend.supports_cache_hints or len(prepared) < 2:
            return None
        prefixes = [await self._trace(backend, call_args) for call_args, _ in prepared]
        if any(p is None for p in prefixes):
            return None
        shared = _common_prefix(prefixes)
        adapters = {adapter_name(sampling.get(ADAPTER)) for _, sampling in prepared}
        if not shared or len(adapters) != 1:
            return None
        with using_adapter(adapters.pop()):  # cached under the adapter the runs use
            return await backend.apin_prefix(shared)

    async def _trace(self, backend: Backend, call_args: inspect.BoundArguments) -> str | None:
        """The prompt of the program's first gen/select: run it against a backend that
        renders chat roles but stops at the first generation. A plain program's body runs on
        a worker thread, where its reads (a fork's wait) can block."""
        tracer = _Tracer(backend)
        run = Run(tracer, {}, False, asyncio.get_running_loop())
        state = ProgramState(run, run.interpreter())

        def body() -> Any:
            return self.fn(state, *call_args.args[1:], **call_args.kwargs)

        try:
            if self.is_async:
                await body()
            else:
                await asyncio.to_thread(body)
        except Exception:  # noqa: BLE001 - reading a traced value ends the trace
            pass
        await run.afinish()  # runs what was queued up to the first generation, which stops it
        return tracer.first_prompt


class _StopTrace(Exception):
    pass


class _Tracer(Backend):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.first_prompt: str | None = None

    async def agenerate(self, prompt: Prompt, params: Any, on_delta: Any = None) -> Any:
        self._stop(prompt.text)

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        self._stop(prefix)

    async def arender_chat(self, messages: list[dict[str, str]],
                           add_generation_prompt: bool = False) -> str | None:
        return await self.backend.arender_chat(messages, add_generation_prompt)

    def _stop(self, text: str) -> Any:
        if self.first_prompt is None:
            self.first_prompt = text
        raise _StopTrace()


def _common_prefix(texts: list[str]) -> str:
    first, last = min(texts), max(texts)  # the LCP of all is the LCP of the extremes
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]


def _concurrency(concurrency: int | None, num_threads: int | str) -> int:
    if concurrency is None:
        concurrency = DEFAULT_CONCURRENCY if num_threads == "auto" else num_threads  # type: ignore[assignment]
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
    return concurrency


def _batch_item(program: Program, item: Any) -> tuple[tuple, dict[str, Any]]:
    """(positional, keyword) arguments of one run_batch item."""
    if isinstance(item, Mapping):
        return (), dict(item)
    if isinstance(item, (list, tuple)):
        return tuple(item), {}
    raise TypeError(f"run_batch: each item must be a dict or a tuple of {program.fn.__name__}'s "
                    f"arguments, got {type(item).__name__}")


def function(fn: Callable[..., Any] | None = None, *,
             num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `def f(s, ...)` (or `async def`) becomes a program (see Program.run /
    arun / run_batch / bind). `@rl.function(num_api_spec_tokens=N)` turns on speculative API
    execution on rl.OpenAI: a program's gens share calls of at least N tokens (see
    backends/speculation.py); other backends run segments (exact) and ignore it."""
    return _decorate(fn, num_api_spec_tokens, raise_errors=False)


def sglang_function(fn: Callable[..., Any] | None = None, *,
                    num_api_spec_tokens: int | None = None) -> Any:
    """`function` with SGLang's error semantics (see Program.raise_errors)."""
    return _decorate(fn, num_api_spec_tokens, raise_errors=True)


def _decorate(fn: Callable[..., Any] | None, num_api_spec_tokens: int | None,
              raise_errors: bool) -> Any:
    if num_api_spec_tokens is not None and (isinstance(num_api_spec_tokens, bool) or not
                                            isinstance(num_api_spec_tokens, int)
                                            or num_api_spec_tokens < 1):
        raise ValueError(f"num_api_spec_tokens must be a positive int, got "
                         f"{num_api_spec_tokens!r}")
    if fn is None:
        return lambda f: Program(f, raise_errors=raise_errors,
                                 num_api_spec_tokens=num_api_spec_tokens)
    return Program(fn, raise_errors=raise_errors, num_api_spec_tokens=num_api_spec_tokens)
