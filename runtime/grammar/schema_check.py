"""JSON Schema checks that need no grammar library: the cheap shape check done at the boundary
(size and depth, iteratively, so no schema can recurse the caller's stack), and the schema
preparation for llguidance (formats it cannot enforce, keywords located by JSON pointer).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Iterator

log = logging.getLogger(__name__)

# Bounds checked where a schema enters (SamplingParams): deeper or larger schemas are refused.
MAX_SCHEMA_DEPTH = 64  # nested JSON containers, counting every dict and list
MAX_SCHEMA_NODES = 100_000  # JSON values in the schema document

# JSON Schema 2020-12's formats that llguidance enforces; the other standard formats would be
# checked by a validator and cannot be generated, so they are refused. Formats outside the
# standard are annotations (validators ignore them), dropped with a warning.
ENFORCED_FORMATS = {"date-time", "date", "time", "duration", "email", "hostname", "ipv4",
                    "ipv6", "uuid", "uri"}
STANDARD_FORMATS = ENFORCED_FORMATS | {"idn-email", "idn-hostname", "uri-reference", "iri",
                                       "iri-reference", "uri-template", "json-pointer",
                                       "relative-json-pointer", "regex"}

# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if",
        "then", "else", "unevaluatedItems", "unevaluatedProperties", "items")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")


def check_schema_shape(schema: Any) -> None:
    """ValueError if the schema document nests deeper than MAX_SCHEMA_DEPTH or holds more than
    MAX_SCHEMA_NODES values. Iterative: any input is safe."""
    stack = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise ValueError(f"json_schema has more than {MAX_SCHEMA_NODES} values")
        if isinstance(value, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)


def subschemas(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict]]:
    """Every schema object in the document with its JSON pointer, root first. Values that are
    data (enum, const, default, examples) are not walked."""
    stack = [(schema, pointer)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        yield where, node
        found = []
        for key in _ONE:
            if isinstance(node.get(key), dict):
                found.append((node[key], f"{where}/{_escape(key)}"))
        for key in _MANY:
            if isinstance(node.get(key), list):
                found += [(s, f"{where}/{key}/{i}") for i, s in enumerate(node[key])]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                found += [(s, f"{where}/{_escape(key)}/{_escape(name)}")
                          for name, s in node[key].items()]
        stack.extend(reversed(found))


# An object schema with these keys composes with others; closing it would change their meaning.
_COMPOSED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies",
             "additionalProperties", "patternProperties", "unevaluatedProperties")


def prepare_schema(schema: Any) -> Any:
    """The schema as llguidance should compile it (llguidance checks keyword values itself):
    standard formats llguidance cannot enforce refused by pointer, non-standard formats
    dropped.

    An object schema that names its properties and says nothing about others is closed
    (`additionalProperties: false`), as OpenAI's strict mode, XGrammar and outlines-core do:
    a small model otherwise invents keys until it runs out of tokens. The output stays valid
    (a narrower language); a schema that wants other keys says so explicitly. Required names
    the schema does not describe stay allowed, with any value."""
    schema = json.loads(json.dumps(schema))  # a copy to edit
    for where, node in subschemas(schema):
        properties = node.get("properties")
        if (isinstance(properties, dict) and "/allOf/" not in f"{where}/"
                and not any(key in node for key in _COMPOSED)):
            for name in node.get("required", ()):
                if isinstance(name, str):
                    properties.setdefault(name, {})
            node["additionalProperties"] = False
        fmt = node.get("format")
        if not isinstance(fmt, str) or fmt in ENFORCED_FORMATS:
            continue
        if fmt in STANDARD_FORMATS:
            raise ValueError(f"format {fmt!r} at {where or '/'} cannot be enforced")
        log.warning("json_schema: non-standard format %r at %s ignored", fmt, where or "/")
        del node["format"]
    return schema


def unsupported_keyword_error(schema: Any, error: str) -> str | None:
    """llguidance's errors about keywords it does not implement, located in the schema: the
    keyword and the JSON pointer of the first schema object that uses it (None for other
    errors)."""
    match = re.search(r"Unimplemented keys: \[([^\]]*)\]", error)
    if match is not None:
        keys = re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(1))
    else:  # e.g. "oneOf constraints are not supported. Enable ..."
        match = re.match(r"(\$?\w+) constraints are not supported", error)
        if match is None:
            return None
        keys = [match.group(1)]
    for where, node in subschemas(schema):
        for key in keys:
            if key in node:
                return (f"json_schema: keyword {key!r} at {where or '/'} is not supported "
                        f"(the output could not be guaranteed to match it)")
    return f"json_schema: keywords {', '.join(keys)} are not supported"


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
