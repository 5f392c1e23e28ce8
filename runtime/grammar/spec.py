"""What a request asks its output to match, and the checks done when it is submitted.

SamplingParams carries at most one of `regex`, `json_schema` (a dict or JSON text, kept as
compact JSON text) and `json_object`. They are checked when the params are built, so a bad
pattern or schema is a ValueError naming the field (HTTP 400 at the server) before anything
is queued; the expensive part, the token index, is built later in a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from radixlm.runtime.grammar.json_schema import json_object_regex, load_schema, schema_to_regex
from radixlm.runtime.grammar.regex_check import check_regex

GRAMMAR_FIELDS = ("regex", "json_schema", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "regex" | "json_schema" | "json_object"
    source: str  # the pattern, the schema as compact JSON, or "" for json_object

    def to_regex(self, max_spaces: int = 1) -> str:
        """The regex to compile. `max_spaces` bounds the whitespace between JSON tokens."""
        if self.kind == "regex":
            return check_regex(self.source)
        if self.kind == "json_schema":
            return schema_to_regex(self.source, max_spaces)
        return json_object_regex(max_spaces)

    @classmethod
    def of(cls, params: Any) -> "GrammarSpec | None":
        """The grammar a SamplingParams asks for, or None."""
        if params.regex is not None:
            return cls("regex", params.regex)
        if params.json_schema is not None:
            return cls("json_schema", params.json_schema)
        if params.json_object:
            return cls("json_object", "")
        return None


def check_grammar_fields(regex: Any, json_schema: Any, json_object: Any) -> str | None:
    """Validate the grammar fields of a SamplingParams; return json_schema as compact JSON.
    Raises ValueError naming the field and the cause."""
    given = [name for name, value in zip(GRAMMAR_FIELDS, (regex, json_schema, json_object))
             if value is not None and value is not False]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are exclusive: set at most one of "
                         f"{', '.join(GRAMMAR_FIELDS)}")
    if regex is not None:
        check_regex(regex, "regex")
    if json_schema is not None:
        json_schema = load_schema(json_schema)
        schema_to_regex(json_schema)  # cached: the engine's compile reuses the work
    return json_schema


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
