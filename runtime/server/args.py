"""Command-line flags of `radixlm serve`: the server's own, plus one per `EngineConfig` field.

The engine flags are generated from the dataclass (name, type, default and the comment above
the field as help), so a new engine option is a server flag without being listed twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Union

from radixlm.runtime.config.engine_config import (
    ATTENTION_BACKENDS,
    DISTRIBUTED_EXECUTORS,
    GRAMMAR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    OVERLAP_MODES,
    PROGRAM_POLICIES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
)
from radixlm.runtime.protocol.reasoning import PARSERS as REASONING_PARSERS
from radixlm.runtime.protocol.tool_formats import FORMATS as TOOL_CALL_FORMATS
from radixlm.runtime.replicas.routing import POLICIES as ROUTING_POLICIES


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    # Bearer token clients must send; None leaves the server open. /health is always open.
    api_key: str | None = None
    # Requests beyond what the engine runs at once (max_running_requests) that may wait;
    # more are refused with 503 + Retry-After instead of piling up.
    max_queued_requests: int = 2048
    max_request_bytes: int = 8 << 20  # larger bodies get 413
    # Samples one request may ask for (prompts x n); more is a 400. Also never more than
    # the server holds at once (max_running_requests + max_queued_requests).
    max_samples_per_request: int = 1024
    # A connection is closed when it has been idle this long: after connecting or after its
    # last response, without a complete request head (so a client that sends half a header
    # is cut off too). 0: never.
    keep_alive_timeout: float = 75.0
    # A request body must arrive within this long of its head; otherwise 408.
    body_timeout: float = 60.0
    # With work queued, an engine that makes no progress this long is declared stalled:
    # /health turns 503, in-flight requests fail, the engine is killed and the server exits
    # with status 1 (for its supervisor to restart it). 0: no watchdog.
    watchdog_timeout: float = 300.0
    # SIGTERM: in-flight requests get this long to finish, then they are aborted.
    shutdown_timeout: float = 30.0
    served_model_name: str | None = None  # the `model` id of the OpenAI routes
    log_level: str = "info"
    # How the model writes tool calls (hermes, llama3_json, mistral); None: from its chat
    # template (see docs/server.md#tool-calling).
    tool_call_parser: str | None = None
    # Split the thinking of reasoning models from their answer (qwen3, deepseek_r1); None:
    # replies are returned whole.
    reasoning_parser: str | None = None
    # Let clients replace the chat template (chat_template_kwargs.chat_template on
    # /v1/chat/completions); refused with 400 otherwise. Any template renders in a sandbox.
    trust_request_chat_template: bool = False
    # Seconds a chat template may take to render one request; longer is a 400 (and its worker
    # process is killed).
    chat_template_timeout: float = 10.0
    # Engine replicas behind this server (data parallelism on Ray; see docs/distributed.md).
    # 1: one engine process, no Ray.
    dp_size: int = 1
    # How requests are spread over the replicas (with dp_size > 1).
    router: str = "cache_aware"
    # The Ray cluster the replicas join (default: RAY_ADDRESS, else a local cluster).
    ray_address: str | None = None
    # Where Ray listens on this node (default: 127.0.0.1 for a local cluster).
    ray_host: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_queued_requests", "max_request_bytes", "shutdown_timeout",
                     "keep_alive_timeout", "body_timeout", "watchdog_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.chat_template_timeout <= 0:
            raise ValueError(f"chat_template_timeout must be > 0, got "
                             f"{self.chat_template_timeout}")
        if self.max_samples_per_request < 1:
            raise ValueError(f"max_samples_per_request must be >= 1, got "
                             f"{self.max_samples_per_request}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.router not in ROUTING_POLICIES:
            raise ValueError(f"router must be one of {', '.join(ROUTING_POLICIES)}, got "
                             f"{self.router!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_FORMATS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_call_parser!r}")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's default in --help, unless its help already says what the default is (or
    there is none to say: None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if ("default" in help_ or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return help_
        return f"{help_} (default: %(default)s)".strip()


class CommandParser(argparse.ArgumentParser):
    """The parser of our commands (`radixlm ...`, `python -m radixlm.runtime.server`): defaults
    in --help, and a misspelled flag refused in the usage of the subcommand it was given to,
    with the closest real flag suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._refuse(parsed, extras)
        return parsed

    def _refuse(self, parsed: argparse.Namespace, extras: list[str]) -> None:
        parser: argparse.ArgumentParser = self
        for action in self._actions:  # the subcommand given, whose flags these were meant for
            if isinstance(action, argparse._SubParsersAction):
                parser = action.choices.get(getattr(parsed, action.dest, None), self)
        flags = [flag for action in parser._actions for flag in action.option_strings]
        named = []
        for arg in extras:
            close = (difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
                     if arg.startswith("-") else [])
            named.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
        parser.error("unrecognized arguments: " + " ".join(named))


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add every `radixlm serve` flag to `parser`."""
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model")
    parser.add_argument("--model", "--model-path", default=None,
                        help="model folder, .gguf file, short name or Hub id "
                             "(default: the embedded smollm2-135m-instruct)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=ServerConfig.host,
                        help="the address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=ServerConfig.port,
                        help="0 picks a free port (the log says which)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: the RADIXLM_API_KEY environment variable, else none)")
    server.add_argument("--max-queued-requests", type=int,
                        default=ServerConfig.max_queued_requests,
                        help="requests that may wait beyond max_running_requests; more get "
                             "503 with Retry-After")
    server.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                        help="largest request body; larger ones get 413")
    server.add_argument("--max-samples-per-request", type=int,
                        default=ServerConfig.max_samples_per_request,
                        help="samples (prompts x n) one request may ask for; more get 400")
    server.add_argument("--keep-alive-timeout", type=float,
                        default=ServerConfig.keep_alive_timeout,
                        help="seconds a connection may stay idle, or take to send a request "
                             "head, before it is closed (0: never)")
    server.add_argument("--body-timeout", type=float, default=ServerConfig.body_timeout,
                        help="seconds a request body may take to arrive; slower ones get 408")
    server.add_argument("--watchdog-timeout", type=float, default=ServerConfig.watchdog_timeout,
                        help="seconds without engine progress, with work queued, after which "
                             "the server fails its requests and exits 1 (0: no watchdog)")
    server.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                        help="seconds in-flight requests get to finish after SIGTERM")
    server.add_argument("--served-model-name", default=None,
                        help="model id on the OpenAI routes (default: --model or the default "
                             "model's name)")
    server.add_argument("--log-level", default=ServerConfig.log_level, type=str.lower,
                        choices=["debug", "info", "warning", "error"],
                        help="the server's and the engine's log level")
    server.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_FORMATS,
                        help="how the model writes tool calls (default: picked from its chat "
                             "template; hermes for templates without tools)")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="return the thinking of reasoning models as reasoning_content, "
                             "apart from the answer (default: replies whole)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let clients send their own chat template "
                             "(chat_template_kwargs.chat_template); without it they get 400. "
                             "Only for trusted clients: a template is a program (it still "
                             "renders in a sandbox, bounded by --chat-template-timeout)")
    server.add_argument("--chat-template-timeout", type=float,
                        default=ServerConfig.chat_template_timeout,
                        help="seconds a chat template may take to render a request; longer "
                             "gets 400")
    dp = parser.add_argument_group("data parallelism (see docs/distributed.md)")
    dp.add_argument("--dp", "--dp-size", "--data-parallel-size", type=int,
                    default=ServerConfig.dp_size, dest="dp_size",
                    help="engine replicas, each with its own KV pool and prefix cache, started "
                         "as Ray actors (needs radixlm[ray]); 1: one engine, no Ray")
    dp.add_argument("--router", default=ServerConfig.router, choices=ROUTING_POLICIES,
                    help="which replica serves each request (with --dp > 1)")
    dp.add_argument("--ray-address", default=None,
                    help="join this Ray cluster (e.g. 10.0.0.1:6379; default: RAY_ADDRESS, "
                         "else start a local one)")
    dp.add_argument("--ray-host", default=None,
                    help="this node's address in the Ray cluster, where Ray listens (default: "
                         "127.0.0.1 for a local cluster; Ray's pick when joining one)")
    add_engine_args(parser.add_argument_group("engine (see docs/engine.md)"))


# Other spellings of some engine flags, as vLLM and SGLang users type them. Their memory
# fractions are of the whole GPU; ours is of the memory left free after the weights.
_ALIASES = {"tp_size": ["--tp", "--tensor-parallel-size", "-tp"],
            "pp_size": ["--pp", "--pipeline-parallel-size", "-pp"],
            "sp_size": ["--sp", "--sequence-parallel-size", "-sp"],
            "max_model_len": ["--context-length"],
            "kv_cache_memory_fraction": ["--mem-fraction-static", "--gpu-memory-utilization"]}
# Engine flags that take several values (a tuple of strings), with what each one is.
_LISTS = {"lora_modules": "NAME=PATH", "lora_target_modules": "MODULE"}
# Engine flags with a fixed set of values (listed in --help, checked by argparse).
_CHOICES = {"attention_backend": ATTENTION_BACKENDS, "schedule_policy": SCHEDULE_POLICIES,
            "program_policy": PROGRAM_POLICIES,
            "grammar_backend": GRAMMAR_BACKENDS, "overlap_schedule": OVERLAP_MODES,
            "speculative": SPECULATIVE_METHODS, "load_format": LOAD_FORMATS,
            "tp_all_reduce": ("auto", "symmetric", "nccl"),
            "distributed_executor_backend": DISTRIBUTED_EXECUTORS,
            "quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES}


def add_engine_args(group: Any) -> None:
    """One flag per EngineConfig field but `model`: --page-size, --disable-radix-cache, ..."""
    hints = typing.get_type_hints(EngineConfig)
    docs = _field_comments(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flags = ["--" + f.name.replace("_", "-")] + _ALIASES.get(f.name, [])
        help_ = f"{docs.get(f.name, '')} (default: {f.default})".strip()
        if f.name in _LISTS:
            group.add_argument(*flags, nargs="+", default=f.default, help=help_,
                               metavar=_LISTS[f.name])
            continue
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_)
        else:
            group.add_argument(*flags, type=kind, default=f.default, help=help_,
                               choices=_CHOICES.get(f.name))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments the parsed flags ask for (model included)."""
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    positional = getattr(args, "model_arg", None)
    if positional is not None:
        if options["model"] not in (None, positional):
            raise ValueError(f"the model is given twice: {positional!r} and --model "
                             f"{options['model']!r}")
        options["model"] = positional
    return options


def server_config(args: argparse.Namespace, api_key_env: str | None = None) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {name: getattr(args, name) for name in names}
    if values["api_key"] is None:
        values["api_key"] = api_key_env or None
    return ServerConfig(**values)


def _scalar_type(hint: Any) -> type:
    """`int | None` -> int; plain types pass through."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    if hint in (bool, int, float, str):
        return hint
    raise TypeError(f"no command-line type for EngineConfig field of type {hint}")


def _field_comments(cls: type) -> dict[str, str]:
    """The comments written beside or above each field in the class source, as help text."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (e.g. a frozen build): help without comments
        return {}
    docs: dict[str, str] = {}
    above: list[str] = []
    field_re = re.compile(r"^\s{4}(\w+):[^#]*?(?:#\s*(.*))?$")
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = field_re.match(line)
        if match and not stripped.startswith("def "):
            docs[match.group(1)] = " ".join(above + [match.group(2) or ""]).strip()
        above = []
    return docs
