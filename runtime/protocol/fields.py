"""Client input checked field by field: errors in OpenAI's shape (`ApiError`, with the HTTP
status it maps to), JSON bodies, and typed access to an object's fields that names the field
(`param`) on failure. Shared by the server's routes and the language's tool calls.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Mapping

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 409: "conflict_error",
    413: "invalid_request_error", 415: "invalid_request_error", 500: "internal_server_error",
    501: "not_implemented_error", 503: "service_unavailable_error",
}


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
