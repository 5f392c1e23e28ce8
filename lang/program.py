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

import functools
import inspect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

from tqdm.auto import tqdm

from radixlm.backends.backend import Backend, Prompt, resolve_backend
from radixlm.expr import (
    FIELD_NAMES,
    LANGUAGE_ONLY_FIELDS,
    SAMPLING_ALIASES,
    normalize_sampling,
)
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.choices import ChoiceScores
from radixlm.state import ProgramState, Run

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 64  # programs of a batch in flight at once


class Program:
    def __init__(self, fn: Callable[..., Any], bound: Mapping[str, Any] | None = None,
                 raise_errors: bool = False) -> None:
        self.fn = fn
        self.bound = dict(bound or {})
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
        return Program(self.fn, {**self.bound, **kwargs}, self.raise_errors)

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Run the program. Keyword arguments are the program's own, then sampling defaults
        for every gen in it (e.g. temperature=0, max_tokens=64; a gen's own fields win).
        With stream=True it returns at once; read the output with `state.text_iter()`.
        A failure is recorded in `state.error()` (reading a variable it prevented raises).
        (`use_thread` is SGLang's; a state always runs its expressions on a worker thread.)"""
        backend = resolve_backend(backend)
        call_args, defaults = self._arguments(args, kwargs)
        run = Run(backend, defaults, stream)
        state = ProgramState(run, run.interpreter())
        if stream:
            threading.Thread(target=self._execute, args=(run, state, call_args),
                             name="radixlm-program-body", daemon=True).start()
        else:
            self._execute(run, state, call_args)
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
        if isinstance(batch_kwargs, Mapping) or not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: pass a list of dicts (or tuples) of program arguments")
        if concurrency is None:
            concurrency = DEFAULT_CONCURRENCY if num_threads == "auto" else num_threads
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        prepared = [self._arguments(*_batch_item(self, item), defaults) for item in batch_kwargs]
        states = self._run_all(backend, prepared, concurrency, progress_bar)
        return states if generator_style else list(states)

    def _run_all(self, backend: Backend, prepared: list, concurrency: int,
                 progress_bar: bool) -> Iterator[ProgramState]:
        lease = self._warm(backend, prepared)
        try:
            with ThreadPoolExecutor(max_workers=concurrency,
                                    thread_name_prefix="radixlm-batch") as pool, \
                    tqdm(total=len(prepared), disable=not progress_bar,
                         desc=self.fn.__name__) as bar:
                def one(item: tuple[inspect.BoundArguments, dict[str, Any]]) -> ProgramState:
                    call_args, sampling = item
                    run = Run(backend, sampling, stream=False)
                    state = ProgramState(run, run.interpreter())
                    self._execute(run, state, call_args)
                    bar.update(1)
                    return state

                yield from pool.map(one, prepared)
        finally:
            if lease is not None:
                backend.release_prefix(lease)

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> str:
        """The text the program builds before its first gen or select, for these arguments
        (with the backend's chat template): the prefix its runs share."""
        backend = resolve_backend(backend)
        call_args, _ = self._arguments((), kwargs)
        prefix = self._trace(backend, call_args)
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
            elif key in FIELD_NAMES or key in SAMPLING_ALIASES or key in LANGUAGE_ONLY_FIELDS:
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
        if raised is not None and self.raise_errors:
            raise raised
        if state._interp.error is not None:
            log.warning("program %s failed: %s", self.fn.__name__, state._interp.error)

    def _warm(self, backend: Backend, prepared: list) -> Any:
        """Pin the text every run starts with before its first generation, found by tracing
        the program on each run's arguments."""
        if not backend.supports_cache_hints or len(prepared) < 2:
            return None
        prefixes = [self._trace(backend, call_args) for call_args, _ in prepared]
        if any(p is None for p in prefixes):
            return None
        shared = _common_prefix(prefixes)
        return backend.pin_prefix(shared) if shared else None

    def _trace(self, backend: Backend, call_args: inspect.BoundArguments) -> str | None:
        """The prompt of the program's first gen/select: run it against a backend that
        renders chat roles but stops at the first generation."""
        tracer = _Tracer(backend)
        run = Run(tracer, {}, stream=False)
        interp = run.interpreter()
        try:
            self.fn(ProgramState(run, interp), *call_args.args[1:], **call_args.kwargs)
        except BaseException:  # noqa: BLE001 - reading a traced value ends the trace
            pass
        run.finish()  # runs what was queued up to the first generation, which stops it
        return tracer.first_prompt


class _StopTrace(Exception):
    pass


class _Tracer(Backend):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.first_prompt: str | None = None

    def generate(self, prompt: Prompt, params: Any, on_delta: Any = None) -> Any:
        self._stop(prompt.text)

    def score(self, prefix: str, choices: Sequence[str], unconditional: bool) -> ChoiceScores:
        self._stop(prefix)

    def render_chat(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = False) -> str | None:
        return self.backend.render_chat(messages, add_generation_prompt)

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
    """Decorator: `def f(s, ...)` becomes a program (see Program.run / run_batch / bind).
    `@rl.function(num_api_spec_tokens=N)` is accepted as in SGLang; every gen is its own call
    (no speculative API execution), so the result is the same, only not the call count."""
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
        return lambda f: Program(f, raise_errors=raise_errors)
    return Program(fn, raise_errors=raise_errors)
