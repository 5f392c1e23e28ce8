"""JSON Schema -> regex, with nothing silently ignored.

outlines-core's `build_regex_from_schema` does the structural work (objects, arrays, enums,
anyOf, ...), but it ignores some keywords (numeric bounds, minProperties, uniqueItems,
required names without a property), mangles others (allOf, formats that allow 2023-02-31 or a
raw quote in a string) and builds needlessly large automata for others (generic objects, huge
maxLength). So a schema is first normalised (schema_normaliser.py):

- keywords we can honour are rewritten into forms outlines handles, or into a placeholder
  `{"const": "<nonce>"}` whose quoted text is later swapped for our own regex (numeric ranges,
  generic values, formats);
- keywords we cannot honour are an error that names the keyword and where it is;
- annotations (title, description, examples, unknown keywords and formats) are dropped, as the
  JSON Schema specification says validators do.

Every rewrite keeps the output inside what the schema allows, at worst narrower (clamped
lengths, digit limits): a finished output always validates.
"""

from __future__ import annotations

import functools
import json

from radixlm.runtime.grammar.outlines import json_regex as jr
from radixlm.runtime.grammar.outlines.schema_normaliser import GENERIC_DEPTH, Normaliser
from radixlm.runtime.grammar.regex_check import check_regex
from radixlm.runtime.grammar.spec import GrammarSpec


@functools.lru_cache(maxsize=256)
def schema_to_regex(schema_text: str, max_spaces: int = 1) -> str:
    """The regex for a schema (JSON text). ValueError names the field and the cause."""
    from outlines_core.json_schema import build_regex_from_schema

    schema = json.loads(schema_text)
    check_schema(schema)
    ws = jr.whitespace_pattern(max_spaces)
    normaliser = Normaliser(schema, ws, schema_text)
    normalised = normaliser.schema(schema, "")
    try:
        regex = build_regex_from_schema(json.dumps(normalised), ws)
    except Exception as exc:  # outlines reports everything as ValueError or a panic
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"json_schema: {first}") from None
    for key, sub in normaliser.subs.items():
        regex = regex.replace(f'"{key}"', f"(?:{sub})")
    for old, new in jr.OUTLINES_DIGIT_RUNS.items():
        regex = regex.replace(old, new)
    return regex


def json_object_regex(max_spaces: int = 1) -> str:
    """Any JSON object (OpenAI's json_object mode), containers nested two deep."""
    ws = jr.whitespace_pattern(max_spaces)
    return jr.generic_object(jr.generic_value(GENERIC_DEPTH, ws), ws)


def check_schema(schema: dict) -> None:
    """Is it a valid JSON Schema for the draft it names (the latest one by default)?"""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/" + "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"json_schema is not a valid JSON Schema: {exc.message} "
                         f"(at {where})") from None


def spec_regex(spec: GrammarSpec, max_spaces: int = 1) -> str:
    """The regex outlines-core compiles for a grammar spec. `max_spaces` bounds the whitespace
    between JSON tokens. Can be slow and large for big schemas: run it where that is bounded."""
    if spec.kind == "regex":
        return check_regex(spec.source)
    if spec.kind == "json_schema":
        return schema_to_regex(spec.source, max_spaces)
    if spec.kind == "json_object":
        return json_object_regex(max_spaces)
    raise ValueError(f"{spec.kind} grammars have no regex form")
