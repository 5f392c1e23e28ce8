"""radixlm: structured LLM programs and the runtime that executes them.

    import radixlm as rl

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    with rl.Engine() as backend:                 # the embedded SmolLM2-135M-Instruct
        print(qa.run(question="What is 2 + 2?", backend=backend)["answer"])

Programs run on `rl.Engine` (in process), `rl.RuntimeEndpoint` (our server), `rl.Runtime`
(our server, started as a child process) or `rl.OpenAI` (any OpenAI-compatible server). The
language is a superset of SGLang's frontend; `radixlm.compat.sglang` gives an SGLang program
SGLang's exact names. The runtime itself is `radixlm.runtime`.
"""

from __future__ import annotations

from typing import Any

# First, before anything imports torch: libgomp's spin count (lang/openmp_spin.py); and a
# source checkout's root off sys.path before anything can import from it. Neither imports
# anything of the checkout's.
import radixlm.openmp_spin  # noqa: F401  (sorted first: keep both so)
import radixlm.source_checkout  # noqa: F401
from radixlm.backends.backend import (
    Backend,
    BackendError,
    flush_cache,
    get_server_info,
    set_default_backend,
    use_backend,
)
from radixlm.expr import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    tool,
    tool_call,
    user,
    user_begin,
    user_end,
    video,
)
from radixlm.interpreter import ProgramError
from radixlm.program import Program, function
from radixlm.runtime.programs.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.state import ForkGroup, ProgramState

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "Engine", "ForkGroup", "OpenAI", "Program", "ProgramError",
    "ProgramState", "Runtime", "RuntimeEndpoint", "assistant", "assistant_begin", "assistant_end",
    "flush_cache", "function", "gen", "gen_int", "gen_string", "get_server_info",
    "greedy_token_selection", "image", "select", "separate_reasoning", "set_default_backend",
    "system", "system_begin", "system_end", "token_length_normalized", "tool", "tool_call",
    "unconditional_likelihood_normalized", "use_backend", "user", "user_begin", "user_end",
    "video",
]

# The backends are imported on first use: rl.Engine pulls in torch and the model stack,
# which a program that only talks to a server does not need.
# `rl.Engine` is SGLang's name for the in-process backend; its class is `EngineBackend`, apart
# from the runtime's own `Engine` that it drives.
_BACKENDS = {
    "Engine": ("radixlm.backends.local", "EngineBackend"),
    "RuntimeEndpoint": ("radixlm.backends.runtime_endpoint", "RuntimeEndpoint"),
    "Runtime": ("radixlm.backends.runtime", "Runtime"),
    "OpenAI": ("radixlm.backends.openai_compat", "OpenAI"),
}


def __getattr__(name: str) -> Any:
    if name in _BACKENDS:
        import importlib

        module, cls = _BACKENDS[name]
        return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
