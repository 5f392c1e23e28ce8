"""Request checking shared by every route: errors in OpenAI's shape, JSON bodies, typed field
access that names the field on failure, and the one path from request fields to a validated
`SamplingParams` (plus the limits a server needs on top of it, and the context-length check).

Everything here raises `ApiError`; the app turns it into
`{"error": {"message", "type", "param", "code"}}` with the status it carries.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Iterable, Mapping

from radixlm.runtime.config.sampling_params import SamplingParams

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 409: "conflict_error",
    413: "invalid_request_error", 415: "invalid_request_error", 500: "internal_server_error",
    501: "not_implemented_error", 503: "service_unavailable_error",
}

# Server-side bounds on top of SamplingParams' own checks: hostile values that are valid
# Python but would cost the engine (or crash a torch call) are refused at the boundary.
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256  # scanned at every decode step
MAX_SEED = 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i; torch takes int64


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


# -- JSON bodies ------------------------------------------------------------------------------

def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf; NaN and inf poison sampling
        raise ValueError(f"number {text} is out of range")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object with finite numbers."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise bad("invalid JSON: nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"invalid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type(body)}",
                  code="invalid_json")
    # UTF-8 cannot carry a lone surrogate, only a \\uD800-\\uDFFF escape can; such a string
    # is not text (it cannot be encoded, tokenized or echoed back), so find it only then.
    if _SURROGATE_ESCAPE.search(raw):
        try:
            where = _lone_surrogate(body, "")
        except RecursionError:
            raise bad("invalid JSON: nested too deeply", code="invalid_json") from None
        if where is not None:
            raise bad(f"{where or 'a field name'} holds a lone UTF-16 surrogate (an unpaired "
                      f"\\uD800-\\uDFFF escape), which is not valid Unicode", where or None,
                      "invalid_json")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string holding a lone surrogate ("" for a field name); None if
    there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return None
        except UnicodeEncodeError:
            return path
    children: Iterable[tuple[str, Any]] = ()
    if isinstance(value, dict):
        if any(_lone_surrogate(key, "") is not None for key in value):
            return ""
        children = ((f"{path}.{key}" if path else key, item) for key, item in value.items())
    elif isinstance(value, list):
        children = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    for name, item in children:
        found = _lone_surrogate(item, name)
        if found is not None:
            return found
    return None


def _type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
             float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# -- typed fields -----------------------------------------------------------------------------

class Fields:
    """Typed access to a JSON object's fields; every error names the field (`param`)."""

    def __init__(self, body: Mapping[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def name(self, field: str) -> str:
        return f"{self.prefix}{field}"

    def only(self, allowed: Iterable[str]) -> None:
        unknown = sorted(set(self.body) - set(allowed))
        if unknown:
            raise bad(f"unknown field {self.name(unknown[0])!r}"
                      + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""),
                      self.name(unknown[0]), "unknown_field")

    def has(self, field: str) -> bool:
        return self.body.get(field) is not None

    def get(self, field: str, kinds: tuple[type, ...], default: Any = None,
            required: bool = False, what: str | None = None) -> Any:
        value = self.body.get(field)
        if value is None:
            if required:
                raise bad(f"{self.name(field)} is required", self.name(field), "missing_field")
            return default
        # JSON has no int/bool overlap; Python does (True is an int): keep them apart.
        if isinstance(value, bool) and bool not in kinds:
            value_ok = False
        else:
            value_ok = isinstance(value, kinds)
        if not value_ok:
            raise bad(f"{self.name(field)} must be {what or _kinds(kinds)}, got {_type(value)}",
                      self.name(field), "invalid_type")
        return value

    def integer(self, field: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None, required: bool = False) -> Any:
        value = self.get(field, (int,), default, required, "an integer")
        if value is not None:
            self.check_range(field, value, lo, hi)
        return value

    def number(self, field: str, default: float | None = None, lo: float | None = None,
               hi: float | None = None) -> Any:
        value = self.get(field, (int, float), default, what="a number")
        if value is not None:
            self.check_range(field, value, lo, hi)
        return value

    def boolean(self, field: str, default: bool | None = None) -> Any:
        return self.get(field, (bool,), default, what="a boolean")

    def string(self, field: str, default: str | None = None, required: bool = False) -> Any:
        return self.get(field, (str,), default, required, "a string")

    def object(self, field: str, required: bool = False) -> Any:
        return self.get(field, (dict,), None, required, "an object")

    def check_range(self, field: str, value: float, lo: float | None, hi: float | None) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = (f"in [{lo}, {hi}]" if lo is not None and hi is not None
                    else f">= {lo}" if lo is not None else f"<= {hi}")
            raise bad(f"{self.name(field)} must be {span}, got {value}", self.name(field))


def _kinds(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
             list: "an array", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def token_ids(value: Any, param: str, vocab_size: int) -> list[int]:
    """A non-empty list of in-vocabulary token ids."""
    if not isinstance(value, list):
        raise bad(f"{param} must be an array of token ids, got {_type(value)}", param,
                  "invalid_type")
    if not value:
        raise bad(f"{param} must not be empty", param)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad(f"{param} must hold token ids in [0, {vocab_size}), got {t!r}", param)
    return value


def is_id_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and not isinstance(value[0], (list, str))


# -- sampling parameters ----------------------------------------------------------------------

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(values: Mapping[str, Any], names: Mapping[str, str],
                    prefix: str = "") -> SamplingParams:
    """Build SamplingParams from engine-named `values`; a bad value is a 400 naming the request
    field it came from (`names` maps engine field -> request field; a field not in it is
    named `prefix + field`)."""
    for field in ("stop", "stop_token_ids", "stop_regex"):  # SamplingParams would take keys
        if isinstance(values.get(field), dict):
            param = names.get(field, prefix + field)
            raise bad(f"{param} must be a string or an array, got object", param, "invalid_type")
    try:
        params = SamplingParams.from_dict(values)
    except ValueError as exc:
        raise bad(str(exc), _param_of(str(exc), names, prefix)) from None
    except TypeError as exc:  # e.g. a list where a scalar belongs
        raise bad(str(exc)) from None
    check_limits(params, names, prefix)
    return params


def _param_of(message: str, names: Mapping[str, str], prefix: str) -> str | None:
    """The field a SamplingParams error is about: its messages start with the field name."""
    field = re.match(r"unknown sampling field\(s\): (\w+)", message)
    if field is None:
        field = re.match(r"(\w+)", message)
        if field is None or field.group(1) not in SAMPLING_FIELDS:
            return None
    return names.get(field.group(1), prefix + field.group(1))


def check_limits(p: SamplingParams, names: Mapping[str, str], prefix: str = "") -> None:
    def name(field: str) -> str:
        return names.get(field, prefix + field)

    if p.n > MAX_N:
        raise bad(f"{name('n')} must be <= {MAX_N}, got {p.n}", name("n"))
    if p.top_logprobs_num > MAX_TOP_LOGPROBS:
        raise bad(f"{name('top_logprobs_num')} must be <= {MAX_TOP_LOGPROBS}, "
                  f"got {p.top_logprobs_num}", name("top_logprobs_num"))
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        raise bad(f"{name('seed')} must be in [0, {MAX_SEED}], got {p.seed}", name("seed"))
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise bad(f"{name('stop')}: at most {MAX_STOP_STRINGS} strings of at most "
                  f"{MAX_STOP_CHARS} characters", name("stop"))
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"{name('stop_token_ids')}: at most {MAX_STOP_TOKEN_IDS} token ids, got "
                  f"{len(p.stop_token_ids)}", name("stop_token_ids"))


def fit_context(params: SamplingParams, prompt_len: int, max_model_len: int,
                explicit_max: bool, prompt_param: str, max_param: str) -> SamplingParams:
    """Refuse a prompt (or prompt + explicit max tokens) beyond the context; clip a default
    max_new_tokens to what is left."""
    check_prompt_len(prompt_len, max_model_len, prompt_param)
    room = max_model_len - prompt_len
    if params.max_new_tokens <= room:
        return params
    if explicit_max:
        raise bad(f"the prompt ({prompt_len} tokens) plus {max_param} "
                  f"({params.max_new_tokens}) exceeds this model's context of {max_model_len} "
                  f"tokens", max_param, "context_length_exceeded")
    return params.replace(max_new_tokens=room,
                          min_new_tokens=min(params.min_new_tokens, room))


def check_prompt_len(prompt_len: int, max_model_len: int, param: str) -> None:
    """The engine needs room for at least one more position after the prompt."""
    if prompt_len >= max_model_len:
        raise bad(f"the prompt is {prompt_len} tokens; this model's context holds "
                  f"{max_model_len} tokens, prompt and completion together", param,
                  "context_length_exceeded")
