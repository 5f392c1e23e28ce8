"""The expressions a program appends to its state: text, `gen`, `select`, roles.

Expressions are plain data. The interpreter (`interpreter.py`) gives them meaning; building one
only validates it, so a typo in a sampling field fails on the line that wrote it.

    s += "Q: " + question + "\\nA:" + rl.gen("answer", max_tokens=32, stop="\\n")
    s += rl.user("Hi!") + rl.assistant(rl.gen("reply"))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from radixlm.choices import ChoicesMethod, token_length_normalized
from radixlm.runtime.config.sampling_params import SamplingParams

# Friendlier names users know from the OpenAI API and SGLang's frontend, mapped onto the
# runtime's one SamplingParams. Every other field keeps its SamplingParams name.
SAMPLING_ALIASES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "return_logprob": "logprobs",
    "grammar": "ebnf",  # a Lark or GBNF grammar
}
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# Regexes behind `dtype=`: bounded, so a constrained number can't run to max_tokens.
DTYPE_REGEX = {
    int: r"-?(0|[1-9][0-9]{0,17})",
    float: r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,12})?",
    bool: r"(True|False)",
    str: r'"[^"\\\n]*"',  # unbounded: max_tokens bounds it, and it compiles fast
}


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

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        return SamplingParams.from_dict({**defaults, **self.sampling})


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: ChoicesMethod


@dataclass(frozen=True)
class Role(Expr):
    """A whole message: `rl.user("Hi")`, or with generated content `rl.assistant(rl.gen())`."""

    role: str
    content: Expr


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


def normalize_sampling(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """Map aliases onto SamplingParams names and check every value now, naming the field."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = SAMPLING_ALIASES.get(key, key)
        if name not in SAMPLING_FIELDS:
            known = sorted(SAMPLING_FIELDS | set(SAMPLING_ALIASES))
            raise TypeError(f"{where}: unknown sampling field {key!r}; known fields are "
                            f"{', '.join(known)}")
        if name in out:
            raise TypeError(f"{where}: {key!r} and its alias both given")
        out[name] = value
    try:
        SamplingParams.from_dict(out)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return out


def gen(name: str | None = None, *, choices: Sequence[str] | None = None,
        dtype: type | None = None, **sampling: Any) -> Gen | Select:
    """Generate text into variable `name`. Takes every SamplingParams field (and the aliases
    max_tokens, min_tokens, return_logprob, grammar for ebnf). `choices=[...]` is `select`;
    `dtype=int|float|bool|str` constrains the text with a regex and converts the value."""
    if choices is not None:
        if sampling or dtype is not None:
            raise TypeError("gen: choices= takes no sampling fields or dtype; use select()")
        return select(name, choices)
    _check_name(name, "gen")
    params = normalize_sampling(sampling, "gen")
    if dtype is not None:
        if dtype not in DTYPE_REGEX:
            raise TypeError(f"gen: dtype must be one of int, float, bool, str; got {dtype!r}")
        if any(k in params for k in ("regex", "json_schema", "ebnf", "json_object")):
            raise TypeError("gen: dtype= builds its own regex; don't pass another grammar")
        params["regex"] = DTYPE_REGEX[dtype]
    return Gen(name, params, dtype)


def gen_int(name: str | None = None, **sampling: Any) -> Gen:
    return gen(name, dtype=int, **sampling)


def gen_string(name: str | None = None, **sampling: Any) -> Gen:
    return gen(name, dtype=str, **sampling)


def select(name: str | None = None, choices: Sequence[str] | None = None,
           choices_method: ChoicesMethod = token_length_normalized) -> Select:
    """Pick one of `choices` by the model's likelihood of each, scored in one engine call
    over the shared prefix. The chosen text is appended and stored in `name`."""
    _check_name(name, "select")
    if (choices is None or isinstance(choices, str)
            or not all(isinstance(c, str) and c for c in choices) or not choices):
        raise ValueError("select: choices must be a non-empty list of non-empty strings")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError("select: choices_method must be rl.token_length_normalized, "
                        "rl.greedy_token_selection or rl.unconditional_likelihood_normalized")
    return Select(name, tuple(choices), choices_method)


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


def _check_name(name: Any, where: str) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"{where}: name must be a non-empty string or None, got {name!r}")


ExprLike = Union[Expr, str]
