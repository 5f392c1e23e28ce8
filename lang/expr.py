"""The expressions a program appends to its state: text, `gen`, `select`, roles.

Expressions are plain data. The interpreter (`interpreter.py`) gives them meaning; building one
only validates it, so a typo in a sampling field fails on the line that wrote it.

    s += "Q: " + question + "\\nA:" + rl.gen("answer", max_tokens=32, stop="\\n")
    s += rl.user("Hi!") + rl.assistant(rl.gen("reply"))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from radixlm.runtime.config.sampling_params import FIELD_NAMES, SamplingParams
from radixlm.runtime.programs.choices import ChoicesMethod, token_length_normalized
from radixlm.runtime.protocol.fields import ApiError, Fields

# Friendlier names users know from the OpenAI API and SGLang's frontend, mapped onto the
# runtime's one SamplingParams. Every other field keeps its SamplingParams name.
SAMPLING_ALIASES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "return_logprob": "logprobs",
    "grammar": "ebnf",  # a Lark or GBNF grammar
}

# SGLang's fields that are not SamplingParams fields: the token text is always in our logprob
# entries, so asking for it changes nothing.
LANGUAGE_ONLY_FIELDS = frozenset({"return_text_in_logprobs"})

# The LoRA adapter a call runs with, by name: a field of gen and tool_call (and of run()'s
# defaults, for every call of the program), kept beside the sampling fields but not one.
ADAPTER = "lora"

# Regexes behind `dtype=`: bounded, so a constrained number can't run to max_tokens. A number
# may end with one space or newline, so a model that wants to end it can (EOS is rarely
# likely mid-sentence); the value and the text appended are the number without it.
NUMBER_END = "[ \n]?"
DTYPE_REGEX = {
    int: r"-?(0|[1-9][0-9]{0,17})" + NUMBER_END,
    float: r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,12})?" + NUMBER_END,
    bool: r"(True|False)",
    # No control characters (JSON forbids them raw); unbounded: max_tokens bounds it.
    str: r'"[^"\\\x00-\x1f]*"',
}
DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str, "string": str}

# SGLang's positional order of gen()'s fields after the name (gen_int and gen_string have no
# min_tokens), so `gen("answer", 64)` is max_tokens=64 as there.
GEN_POSITIONAL = ("max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex",
                  "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                  "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "return_text_in_logprobs", "dtype", "choices",
                  "choices_method", "regex", "json_schema")
TYPED_GEN_POSITIONAL = tuple(f for f in GEN_POSITIONAL[:17] if f != "min_tokens")


class Expr:
    """Something that can be appended to a program state."""

    def __add__(self, other: Any) -> "Concat":
        return Concat([self, *_parts(other)])

    def __radd__(self, other: Any) -> "Concat":
        return Concat([*_parts(other), self])


def _parts(value: Any) -> list["Expr"]:
    if isinstance(value, Concat):
        return list(value.parts)
    return [to_expr(value)]


def to_expr(value: Any) -> "Expr":
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append a {type(value).__name__} to a program state; "
                    f"use a string, rl.gen(...), rl.select(...) or a role")


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Concat(Expr):
    parts: list[Expr]


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    # Sampling fields the program set (SamplingParams names); run() defaults fill the rest.
    sampling: dict[str, Any] = field(default_factory=dict)
    dtype: type | None = None  # the variable's Python type (int, float, bool, str)
    # False: the variable keeps the constrained text, as SGLang's frontend stores it.
    convert: bool = True

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        return sampling_params({**defaults, **self.sampling})

    def adapter(self, defaults: dict[str, Any]) -> str | None:
        return adapter_name({**defaults, **self.sampling}.get(ADAPTER))


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: ChoicesMethod
    lora: str | bool | None = None  # False: the base model, whatever the default

    def adapter(self, defaults: dict[str, Any]) -> str | None:
        return adapter_name(defaults.get(ADAPTER) if self.lora is None else self.lora)


@dataclass(frozen=True)
class Role(Expr):
    """A whole message: `rl.user("Hi")`, or with generated content `rl.assistant(rl.gen())`."""

    role: str
    content: Expr
    fields: tuple[tuple[str, Any], ...] = ()  # other message fields (a tool's tool_call_id)


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str
    fields: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class ToolCalls(Expr):
    """Let the model call the tools; the variable is the list of calls it made."""

    name: str | None
    tools: Any  # the server-side ToolRequest: tools, choice, parallel
    sampling: dict[str, Any] = field(default_factory=dict)

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        return sampling_params({**defaults, **self.sampling})

    def adapter(self, defaults: dict[str, Any]) -> str | None:
        return adapter_name({**defaults, **self.sampling}.get(ADAPTER))


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


def sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """The SamplingParams of normalized fields (the adapter is not one of them)."""
    return SamplingParams.from_dict({k: v for k, v in fields.items() if k != ADAPTER})


def check_adapter(value: Any, where: str) -> str | bool | None:
    """A LoRA adapter's name; False for the base model even where a default names one (a
    gen inside `run(lora=...)`); None for the default."""
    if value is not None and value is not False and (not isinstance(value, str) or not value):
        raise ValueError(f"{where}: lora must be a LoRA adapter's name (or False: the base "
                         f"model), got {value!r:.60}")
    return value


def adapter_name(value: str | bool | None) -> str | None:
    """The adapter to run with: None for the base model (False says so explicitly)."""
    return value or None


def normalize_sampling(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """Map aliases onto SamplingParams names and check every value now, naming the field.
    A None value is left out (unset), as in SGLang's signatures. `lora` (the adapter) is
    kept as it is."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if value is None or key in LANGUAGE_ONLY_FIELDS:
            continue
        if key == ADAPTER:
            out[ADAPTER] = check_adapter(value, where)
            continue
        name = SAMPLING_ALIASES.get(key, key)
        if name not in FIELD_NAMES:
            known = sorted(FIELD_NAMES | set(SAMPLING_ALIASES))
            raise TypeError(f"{where}: unknown sampling field {key!r}; known fields are "
                            f"{', '.join(known)}")
        if name in out:
            raise TypeError(f"{where}: {key!r} and its alias both given")
        out[name] = value
    try:
        sampling_params(out)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return out


def _positional(where: str, order: tuple[str, ...], args: tuple, kwargs: dict[str, Any]
                ) -> dict[str, Any]:
    if len(args) > len(order):
        raise TypeError(f"{where}: takes at most {len(order) + 1} positional arguments")
    for key, value in zip(order, args):
        if key in kwargs:
            raise TypeError(f"{where}: {key!r} given by position and by name")
        kwargs[key] = value
    return kwargs


def gen(name: str | None = None, *args: Any, **kwargs: Any) -> Gen | Select:
    """Generate text into variable `name`. Takes every SamplingParams field (and the aliases
    max_tokens, min_tokens, return_logprob, grammar for ebnf), by name or in SGLang's
    positional order (`gen("answer", 64)` is max_tokens=64). `choices=[...]` is `select`;
    `dtype=int|float|bool|str` (or its name) constrains the text with a regex and converts
    the value. `lora="name"` runs it with that LoRA adapter of the server's (run()'s
    `lora=` sets one for every call of the program; `lora=False` runs this one on the base
    model all the same)."""
    kwargs = _positional("gen", GEN_POSITIONAL, args, kwargs)
    choices = kwargs.pop("choices", None)
    dtype = kwargs.pop("dtype", None)
    if choices is not None:
        method = kwargs.pop("choices_method", None) or token_length_normalized
        temperature = kwargs.pop("temperature", None) or 0.0
        lora = kwargs.pop(ADAPTER, None)
        if dtype is not None or any(v is not None for v in kwargs.values()):
            raise TypeError("gen: choices= takes no sampling fields or dtype; use select()")
        return select(name, choices, temperature, method, lora=lora)
    if kwargs.pop("choices_method", None) is not None:
        raise TypeError("gen: choices_method= goes with choices=")
    _check_name(name, "gen")
    params = normalize_sampling(kwargs, "gen")
    if dtype is not None:
        dtype = DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if dtype not in DTYPE_REGEX:
            raise TypeError(f"gen: dtype must be one of int, float, bool, str (or their names); "
                            f"got {dtype!r}")
        if any(k in params for k in ("regex", "json_schema", "ebnf", "json_object")):
            raise TypeError("gen: dtype= builds its own regex; don't pass another grammar")
        params["regex"] = DTYPE_REGEX[dtype]
    return Gen(name, params, dtype)


def gen_int(name: str | None = None, *args: Any, **kwargs: Any) -> Gen:
    """`gen(name, dtype=int)`: an integer, bounded to 18 digits."""
    return gen(name, dtype=int, **_positional("gen_int", TYPED_GEN_POSITIONAL, args, kwargs))


def gen_string(name: str | None = None, *args: Any, **kwargs: Any) -> Gen:
    """`gen(name, dtype=str)`: a double-quoted string on one line."""
    return gen(name, dtype=str, **_positional("gen_string", TYPED_GEN_POSITIONAL, args, kwargs))


def select(name: str | None = None, choices: Sequence[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized, *,
           lora: str | bool | None = None) -> Select:
    """Pick one of `choices` by the model's likelihood of each, scored in one engine call
    over the shared prefix. The chosen text is appended and stored in `name`. Selection is
    deterministic: `temperature` (SGLang's argument) must be 0. `lora`: score with that LoRA
    adapter (False: the base model, inside `run(lora=...)`)."""
    _check_name(name, "select")
    if (choices is None or isinstance(choices, str)
            or not all(isinstance(c, str) and c for c in choices) or not choices):
        raise ValueError("select: choices must be a non-empty list of non-empty strings")
    if isinstance(temperature, ChoicesMethod):  # select(name, choices, method), our old order
        temperature, choices_method = 0.0, temperature
    if temperature != 0:
        raise ValueError("select: temperature must be 0; the choice with the best score under "
                         "choices_method is taken")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError("select: choices_method must be rl.token_length_normalized, "
                        "rl.greedy_token_selection or rl.unconditional_likelihood_normalized")
    return Select(name, tuple(choices), choices_method, check_adapter(lora, "select"))


def _role(role: str, content: Any = None) -> Role | RoleBegin:
    if content is None:
        return RoleBegin(role)
    return Role(role, to_expr(content))


def system(content: Any = None) -> Role | RoleBegin:
    return _role("system", content)


def user(content: Any = None) -> Role | RoleBegin:
    return _role("user", content)


def assistant(content: Any = None) -> Role | RoleBegin:
    return _role("assistant", content)


# SGLang's explicit markers: `s += rl.user_begin()` ... `s += rl.user_end()`.
def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def tool(content: Any, tool_call_id: str | None = None) -> Role:
    """A tool's result, answering the call `tool_call_id` (a call's "id")."""
    fields = (("tool_call_id", tool_call_id),) if tool_call_id is not None else ()
    return Role("tool", to_expr(content), fields)


def tool_call(name: str | None = None, tools: Sequence[dict[str, Any]] = (),
              tool_choice: Any = "auto", parallel_tool_calls: bool = True,
              **sampling: Any) -> ToolCalls:
    """The model's tool calls, as the content of an assistant message:
    `s += rl.assistant(rl.tool_call("calls", tools=[...]))`. `tools` are OpenAI's function
    tools; `tool_choice` "auto", "required", "none" or a function's name. The variable is a
    list of calls, {"id", "name", "arguments": dict} each ([] when the model answered with
    text, which is appended as usual). On rl.Engine and rl.RuntimeEndpoint every call the model
    starts is held to its tool's schema (a structural tag), and "required" and a named
    function make the reply calls only."""
    from radixlm.runtime.protocol.tool_requests import parse_tools  # loads jsonschema

    _check_name(name, "tool_call")
    choice = tool_choice
    if isinstance(choice, str) and choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    try:
        request = parse_tools(Fields({"tools": list(tools), "tool_choice": choice,
                                      "parallel_tool_calls": parallel_tool_calls}))
    except ApiError as exc:
        raise ValueError(f"tool_call: {exc.message}") from None
    if not request.tools:
        raise ValueError("tool_call: tools must be a non-empty list of function tools")
    return ToolCalls(name, request, normalize_sampling(sampling, "tool_call"))


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """After gen `name`: split its thinking out (see separate_reasoning)."""

    name: str
    parser: str


REASONING_MODEL_TYPES = {"qwen3": "qwen3", "deepseek-r1": "deepseek_r1",
                         "deepseek_r1": "deepseek_r1"}


def separate_reasoning(expr: Gen, model_type: str = "qwen3") -> Expr:
    """`rl.separate_reasoning(rl.gen("answer"), model_type="deepseek-r1")`: the gen's variable
    and text keep only the answer; `answer_reasoning_content` holds the thinking (None when
    the reply did not think). model_type: "qwen3" (thinking opens with <think>) or
    "deepseek-r1" (the template opens it; the reply starts inside)."""
    if not isinstance(expr, Gen) or expr.name is None:
        raise TypeError("separate_reasoning: pass a named rl.gen(...)")
    if model_type not in REASONING_MODEL_TYPES:
        raise ValueError(f"separate_reasoning: model_type must be one of "
                         f"{', '.join(REASONING_MODEL_TYPES)}, got {model_type!r}")
    return Concat([expr, SeparateReasoning(expr.name, REASONING_MODEL_TYPES[model_type])])


def image(path: Any) -> Expr:
    raise ValueError("image: radixlm runs text-only models so far; a program cannot add an "
                     "image")


def video(path: Any, num_frames: int) -> Expr:
    raise ValueError("video: radixlm runs text-only models so far; a program cannot add a "
                     "video")


def _check_name(name: Any, where: str) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"{where}: name must be a non-empty string or None, got {name!r}")


ExprLike = Union[Expr, str]
