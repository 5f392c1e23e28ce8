"""SGLang's frontend API on radixlm: `import radixlm.compat.sglang as sgl` runs an SGLang
program with no other change.

    import radixlm.compat.sglang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://localhost:30000"))
    print(qa.run(question="Why is the sky blue?")["answer"])

radixlm's own language is a superset of SGLang's; what this module adds is SGLang's meaning
where the two differ: an exception the program's own code raises propagates out of `run()`
(radixlm records it in the state), `sgl.user()` with no content is an empty message (in
radixlm it opens the role), a `gen(dtype=int)` variable holds its text (radixlm converts it),
`global_config.default_backend`, and SGLang's backend constructors' arguments.
docs/sglang.md lists what is not supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import radixlm
from radixlm import (
    ForkGroup,
    ProgramState,
    assistant_begin,
    assistant_end,
    flush_cache,
    get_server_info,
    greedy_token_selection,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user_begin,
    user_end,
    video,
)
from radixlm.backends import backend
from radixlm.expr import Expr, Gen, Role, RoleBegin, RoleEnd, Select, to_expr
from radixlm.program import sglang_function as function

__all__ = [
    "ForkGroup", "OpenAI", "ProgramState", "Runtime", "RuntimeEndpoint", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_server_info", "global_config", "greedy_token_selection", "image", "select",
    "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
    "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end", "video",
]


def gen(*args: Any, **kwargs: Any) -> Gen | Select:
    """SGLang's `gen`: radixlm's, except that a `dtype=` variable holds the constrained text
    (`"1969"`), as SGLang stores it; radixlm converts it (`1969`)."""
    return _as_text(radixlm.gen(*args, **kwargs))


def gen_int(*args: Any, **kwargs: Any) -> Gen:
    return _as_text(radixlm.gen_int(*args, **kwargs))


def gen_string(*args: Any, **kwargs: Any) -> Gen:
    return _as_text(radixlm.gen_string(*args, **kwargs))


def _as_text(expr: Any) -> Any:
    return dataclasses.replace(expr, convert=False) if isinstance(expr, Gen) else expr


def _message(role: str, content: Any) -> Expr:
    if content is None:  # SGLang: an empty message
        return RoleBegin(role) + RoleEnd(role)
    return Role(role, to_expr(content))


def system(expr: Any = None) -> Expr:
    return _message("system", expr)


def user(expr: Any = None) -> Expr:
    return _message("user", expr)


def assistant(expr: Any = None) -> Expr:
    return _message("assistant", expr)


class _GlobalConfig:
    """SGLang's `sgl.global_config`: only `default_backend`, the backend of
    `set_default_backend`."""

    @property
    def default_backend(self) -> Any:
        return backend.default_backend()

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        set_default_backend(backend)


global_config = _GlobalConfig()


def RuntimeEndpoint(base_url: str, api_key: str | None = None, verify: Any = None,  # noqa: N802
                    chat_template_name: str | None = None) -> Any:
    """SGLang's arguments; the chat template is always the model's own."""
    from radixlm.backends.runtime_endpoint import RuntimeEndpoint as Endpoint

    if verify is not None:
        raise ValueError("RuntimeEndpoint: verify= (TLS certificate checks) is not supported")
    if chat_template_name is not None:
        raise ValueError("RuntimeEndpoint: chat_template_name= is not supported; the "
                         "server applies the model's own chat template")
    return Endpoint(base_url, api_key)


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
    """A `radixlm serve` child process (SGLang's `model_path=` and the server's flags)."""
    from radixlm.backends.runtime import Runtime as ServerRuntime

    return ServerRuntime(*args, **kwargs)


def OpenAI(model_name: str, is_chat_model: bool | None = None,  # noqa: N802
           chat_template: Any = None, is_azure: bool = False, *,
           base_url: str | None = None, api_key: str | None = None) -> Any:
    """SGLang's arguments; radixlm picks the chat or completion route from the program."""
    from radixlm.backends.openai_compat import OpenAI as OpenAIBackend

    if chat_template is not None or is_azure:
        raise ValueError("OpenAI: chat_template= and is_azure= are not supported")
    return OpenAIBackend(model_name, base_url=base_url, api_key=api_key)


_NOT_OFFERED = {
    "Engine": "SGLang's offline engine; use radixlm.runtime.Engine (its own API) or rl.Engine",
    "Anthropic": "only OpenAI-compatible servers are supported as remote backends",
    "LiteLLM": "only OpenAI-compatible servers are supported as remote backends",
    "VertexAI": "only OpenAI-compatible servers are supported as remote backends",
}


def __getattr__(name: str) -> Any:
    if name in _NOT_OFFERED:
        raise AttributeError(f"radixlm.compat.sglang has no {name}: {_NOT_OFFERED[name]}")
    raise AttributeError(f"module 'radixlm.compat.sglang' has no attribute {name!r}")
