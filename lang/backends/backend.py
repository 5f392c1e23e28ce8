"""The one interface between the interpreter and a model.

The interpreter asks for three things: generate text after a prompt, score a list of choices
after a prompt, and render chat roles (and for a segment of a program, when the backend can run
one). It also passes the program's structure as cache hints
(`pin_prefix` / `release_prefix`): a backend that has a prefix cache keeps a prefix's KV
until the hint is released; one that has none ignores the hints. The interpreter knows nothing
of pages, and the runtime nothing of programs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from radixlm.backends import background
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.choices import ChoiceScores
from radixlm.runtime.programs.segment import Segment

if TYPE_CHECKING:
    from radixlm.runtime.programs.stream import SegmentStream


class BackendError(RuntimeError):
    """The backend failed a request (the engine aborted it, the server answered an error)."""


@dataclass
class Prompt:
    """What a `gen` continues: the state's text, and the same as chat messages (the completed
    ones plus the open role with its content so far) for backends that only take messages."""

    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: str | None = None


OnDelta = Callable[[str, dict[str, Any]], None]


@dataclass
class Generation:
    text: str
    meta: dict[str, Any] = field(default_factory=dict)  # tokens, finish_reason, logprobs, ...


class Backend:
    """A backend implements each call either as a coroutine (`agenerate`, `ascore`, ...: the
    built-in backends, which never block a thread) or as a plain method (`generate`,
    `score`, ...: simple custom backends). Each form has a default that calls the other: the
    plain method runs the coroutine on the background loop and waits; the coroutine runs the
    plain method on a worker thread."""

    # True when pin_prefix does something; the interpreter skips tracing work otherwise.
    supports_cache_hints = False
    # True when start_segment runs a program's segment as one request (radixlm/segments.py).
    supports_segments = False
    # True when `speculate` can answer a segment's gens from shared calls (speculation.py).
    supports_speculation = False

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        on_delta: OnDelta | None = None) -> Generation:
        """Generate after the prompt. With on_delta, call it with each new, non-empty piece of
        text as it is generated (the pieces add up to the returned text) and that piece's meta
        info (token counts so far; with logprobs, the entries of the tokens new since the last
        piece, see `logprob_meta`)."""
        return await self._plain("generate", prompt, params, on_delta)

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        """Token logprobs of each choice after `prefix` (and with no context when
        `unconditional`), in as few calls as the backend allows."""
        return await self._plain("score", prefix, choices, unconditional)

    async def arender_chat(self, messages: list[dict[str, Any]],
                           add_generation_prompt: bool = False) -> str | None:
        """The model's chat template applied to `messages`; None when there is none."""
        if not _overrides(self, "render_chat"):
            return None
        return await self._plain("render_chat", messages, add_generation_prompt)

    async def acall_tools(self, prompt: Prompt, tools: Any, params: SamplingParams
                          ) -> Generation:
        """The model's reply to `prompt.messages` (ending in an open, empty assistant message)
        given `tools` (a ToolRequest): its text, and in meta["tool_calls"] the calls it made
        in OpenAI's shape with the arguments as an object."""
        if not _overrides(self, "call_tools"):
            raise BackendError("tool_call: this backend does not support tool calling")
        return await self._plain("call_tools", prompt, tools, params)

    async def apin_prefix(self, text: str) -> Any:
        """Keep `text`'s KV cached until `release_prefix(handle)`; None when not pinned."""
        if not _overrides(self, "pin_prefix"):
            return None
        return await self._plain("pin_prefix", text)

    async def arelease_prefix(self, handle: Any) -> None:
        if _overrides(self, "release_prefix"):
            await self._plain("release_prefix", handle)

    async def arelease_program(self, program_id: str) -> None:
        """The program ended: the runtime may drop what it kept warm for its next call."""

    def start_segment(self, segment: Segment) -> SegmentStream:
        """Start executing a segment (when supports_segments), as a task of the running
        loop; its events come through the returned stream as the runtime produces them."""
        raise NotImplementedError

    def speculate(self, segment: Segment, spec_tokens: int) -> SegmentStream:
        """Start a segment whose gens share calls of at least `spec_tokens` tokens (when
        supports_speculation); a segment of a program without roles."""
        raise NotImplementedError

    # The plain forms.

    def generate(self, prompt: Prompt, params: SamplingParams,
                 on_delta: OnDelta | None = None) -> Generation:
        return self._coroutine("agenerate", prompt, params, on_delta)

    def score(self, prefix: str, choices: Sequence[str], unconditional: bool) -> ChoiceScores:
        return self._coroutine("ascore", prefix, choices, unconditional)

    def render_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = False) -> str | None:
        if not _overrides(self, "arender_chat"):
            return None
        return self._coroutine("arender_chat", messages, add_generation_prompt)

    def call_tools(self, prompt: Prompt, tools: Any, params: SamplingParams) -> Generation:
        if not _overrides(self, "acall_tools"):
            raise BackendError("tool_call: this backend does not support tool calling")
        return self._coroutine("acall_tools", prompt, tools, params)

    def pin_prefix(self, text: str) -> Any:
        if not _overrides(self, "apin_prefix"):
            return None
        return self._coroutine("apin_prefix", text)

    def release_prefix(self, handle: Any) -> None:
        if _overrides(self, "arelease_prefix"):
            self._coroutine("arelease_prefix", handle)

    def _coroutine(self, name: str, *args: Any) -> Any:
        if not _overrides(self, name):
            raise NotImplementedError(f"{type(self).__name__} implements neither "
                                      f"{name.removeprefix('a')} nor {name}")
        return background.run(getattr(self, name)(*args))

    async def _plain(self, name: str, *args: Any) -> Any:
        if not _overrides(self, name):
            raise NotImplementedError(f"{type(self).__name__} implements neither {name} nor "
                                      f"a{name}")
        call = functools.partial(contextvars.copy_context().run, getattr(self, name), *args)
        return await asyncio.get_running_loop().run_in_executor(_plain_calls(), call)

    def flush_cache(self) -> bool:
        """Drop the backend's cached prefixes; False when it has no cache to flush."""
        return False

    def server_info(self) -> dict[str, Any]:
        """What the backend says about itself (model, limits, statistics)."""
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _overrides(backend: Backend, name: str) -> bool:
    return getattr(type(backend), name) is not getattr(Backend, name)


# Plain backend methods block a thread each while they run; the pool is large enough for a
# batch's programs (run_batch's 64) and their forks to call at once.
_PLAIN_WORKERS = 256
_plain_pool: ThreadPoolExecutor | None = None
_plain_lock = threading.Lock()


def _plain_calls() -> ThreadPoolExecutor:
    global _plain_pool
    with _plain_lock:
        if _plain_pool is None:
            _plain_pool = ThreadPoolExecutor(_PLAIN_WORKERS, thread_name_prefix="radixlm-call")
        return _plain_pool


def logprob_meta(entries: Sequence[tuple[float | None, int, Any]], total: int,
                 tops: Sequence[Any] | None = None) -> dict[str, Any]:
    """Logprobs as every backend reports them (SGLang's shape): `output_token_logprobs`, one
    [logprob, token_id, token_text] per token, `output_top_logprobs` alike per token (None
    without top_logprobs_num), and `output_token_logprobs_length`, the count so far (a streamed
    piece carries only its new tokens)."""
    return {"output_token_logprobs": [list(e) for e in entries],
            "output_top_logprobs": list(tops) if tops is not None else [None] * len(entries),
            "output_token_logprobs_length": total}


# The program a backend call is made for, set by the interpreter in the task that executes the
# program's state (and inherited by the tasks it starts): every backend sends it with its
# requests, so the runtime can tell one program's calls from another's.
current_program: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "radixlm_program", default=None)

# The LoRA adapter (by name) a backend call runs with, set by the interpreter around each call
# from the expression's `lora` (or run()'s): backends send it with the call's requests.
current_lora: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "radixlm_lora", default=None)


@contextlib.contextmanager
def using_adapter(name: str | None) -> Iterator[None]:
    """Calls made inside run with LoRA adapter `name` (None: the base model)."""
    token = current_lora.set(name)
    try:
        yield
    finally:
        current_lora.reset(token)


# The backend of `set_default_backend`, for the whole process; `use_backend` overrides it in
# its own context (thread or task).
_process_default: Backend | None = None
_current: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "radixlm_backend", default=None)


def set_default_backend(backend: Backend | None) -> None:
    """Use `backend` for every program run without `backend=`, from any thread (None unsets
    it). `with rl.use_backend(b):` overrides it for the code inside."""
    global _process_default
    if backend is not None:
        _check(backend)
    _process_default = backend


def default_backend() -> Backend | None:
    """The backend a program run here without `backend=` would use, if any."""
    current = _current.get()
    return current if current is not None else _process_default


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """`with rl.use_backend(b):` runs the programs inside on `b`."""
    _check(backend)
    token = _current.set(backend)
    try:
        yield backend
    finally:
        _current.reset(token)


def resolve_backend(backend: Backend | None) -> Backend:
    backend = backend if backend is not None else default_backend()
    if backend is None:
        raise ValueError("backend: no backend given; pass backend=rl.Engine(...) (or "
                         "rl.RuntimeEndpoint / rl.OpenAI), use `with rl.use_backend(b):`, or "
                         "rl.set_default_backend(b)")
    _check(backend)
    return backend


def _check(backend: Any) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be rl.Engine, rl.RuntimeEndpoint or rl.OpenAI, got "
                        f"{type(backend).__name__}")


def flush_cache(backend: Backend | None = None) -> bool:
    """Drop the cached prefixes of `backend` (default: the default backend); False when there
    is none, or it has no cache."""
    backend = backend if backend is not None else default_backend()
    return backend.flush_cache() if backend is not None else False


def get_server_info(backend: Backend | None = None) -> dict[str, Any] | None:
    """What `backend` (default: the default backend) says about itself; None without one."""
    backend = backend if backend is not None else default_backend()
    return backend.server_info() if backend is not None else None
