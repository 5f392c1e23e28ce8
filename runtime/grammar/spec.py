"""What a request asks its output to match, and the checks done when it is submitted.

SamplingParams carries at most one of `regex`, `json_schema` (a dict or JSON text, kept as
compact JSON text), `ebnf` (a Lark or GBNF grammar) and `json_object`. Submission only checks
what is cheap and bounded: types, sizes, that a schema is JSON, not too deep and not too large.
Everything else (is the regex valid, can every schema keyword be enforced) is found by the
grammar engine's compile, off the caller's thread, and reported as the request's error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from radixlm.runtime.grammar.schema_check import check_schema_shape
from radixlm.runtime.grammar.structural_tag import check as check_structural_tag

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "json_object", "structural_tag")
MAX_GRAMMAR_CHARS = 1 << 20  # a regex, a grammar or a schema's JSON text


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "regex" | "json_schema" | "ebnf" | "json_object" | "structural_tag"
    # The pattern, the schema as compact JSON, the grammar, "" for json_object, the structural
    # tag as compact JSON.
    source: str
    strict: bool = True  # False: what cannot be enforced is left out and reported

    @classmethod
    def of(cls, params: Any) -> "GrammarSpec | None":
        """The grammar a SamplingParams asks for, or None."""
        if params.json_schema is not None:
            return cls("json_schema", params.json_schema, params.json_schema_strict)
        for kind in ("regex", "ebnf", "structural_tag"):
            if getattr(params, kind) is not None:
                return cls(kind, getattr(params, kind))
        if params.json_object:
            return cls("json_object", "")
        return None


def check_grammar_fields(regex: Any, json_schema: Any, ebnf: Any, json_object: Any,
                         structural_tag: Any = None) -> dict[str, str | None]:
    """Validate the grammar fields of a SamplingParams; return json_schema and structural_tag
    as compact JSON text. Raises ValueError naming the field and the cause. Bounded in time
    and memory."""
    values = (regex, json_schema, ebnf, json_object, structural_tag)
    given = [name for name, value in zip(GRAMMAR_FIELDS, values)
             if value is not None and value is not False]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are exclusive: set at most one of "
                         f"{', '.join(GRAMMAR_FIELDS)}")
    for name, value in (("regex", regex), ("ebnf", ebnf)):
        if value is not None:
            _check_text(value, name)
    if json_schema is not None:
        if isinstance(json_schema, str):
            _check_text(json_schema, "json_schema")
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError("json_schema nests too deeply") from None
        check_schema_shape(json_schema)  # iterative: safe before anything recursive
        json_schema = load_schema(json_schema)
        if len(json_schema) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"json_schema is longer than {MAX_GRAMMAR_CHARS} characters")
    if structural_tag is not None:
        if isinstance(structural_tag, str):
            _check_text(structural_tag, "structural_tag")
        structural_tag = check_structural_tag(structural_tag)
        if len(structural_tag) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structural_tag is longer than {MAX_GRAMMAR_CHARS} characters")
    return {"json_schema": json_schema, "structural_tag": structural_tag}


def _check_text(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not value and name != "regex":  # the empty regex matches just the empty string
        raise ValueError(f"{name} must not be empty")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid text (it holds a lone surrogate)") from None


def choices_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of the given strings (for `choices`)."""
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c
                                                          for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    return "(" + "|".join(escape(c) for c in choices) + ")"


def escape(text: str) -> str:
    """Escape regex metacharacters in a way both Python's re and Rust's regex accept (Python's
    re.escape also escapes spaces and other characters Rust rejects escaped)."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def load_schema(value: Any) -> str:
    """A dict or JSON text -> compact JSON text of a schema object (ValueError otherwise)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON object (a dict), got "
                         f"{type(value).__name__}")
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema is not JSON-serialisable: {exc}") from None
