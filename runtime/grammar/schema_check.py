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

# llguidance's date allows February 29th in every year, which a validator rejects in most:
# dates (and date-times) get a pattern of our own, with real month lengths and leap years.
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         f"|{_LEAP_YEAR}-02-29)")
_TIME = ("(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:[.][0-9]{1,9})?"
         "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
DATE_PATTERNS = {"date": f"^{_DATE}$", "date-time": f"^{_DATE}T{_TIME}$"}

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
_OBJECT_KEYWORDS = ("properties", "required", "patternProperties", "additionalProperties",
                    "minProperties", "maxProperties", "propertyNames")


def _composed(schema: Any) -> set[int]:
    """ids of the schema objects whose meaning combines with another's: allOf branches, anyOf
    and oneOf branches beside object keywords of their parent, the targets of a `$ref` beside
    other keywords, everything inside those, and what they reference in turn."""
    stack: list[Any] = []
    for _, node in subschemas(schema):
        keyed = any(key in node for key in _OBJECT_KEYWORDS)
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list) and (key == "allOf" or keyed):
                stack += node[key]
        if isinstance(node.get("$ref"), str) and len(node) > 1:
            stack.append(_local_ref(schema, node["$ref"]))
    marked: set[int] = set()
    while stack:
        top = stack.pop()
        if not isinstance(top, dict) or id(top) in marked:
            continue
        for _, node in subschemas(top):
            marked.add(id(node))
            if isinstance(node.get("$ref"), str):
                stack.append(_local_ref(schema, node["$ref"]))
    return marked


def _local_ref(schema: Any, ref: str) -> Any:
    """The object a local `$ref` ("#/definitions/x") points at, or None."""
    if not ref.startswith("#"):
        return None
    node = schema
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def prepare_schema(schema: Any, strict: bool = True) -> tuple[Any, list[str]]:
    """The schema as llguidance should compile it (llguidance checks keyword values itself):
    standard formats llguidance cannot enforce refused by pointer, non-standard formats
    dropped. With `strict=False` the unenforceable formats are dropped too. Returns the schema
    and warnings saying what was dropped.

    An object schema that names its properties and says nothing about others is closed
    (`additionalProperties: false`), as OpenAI's strict mode, XGrammar and outlines-core do:
    a small model otherwise invents keys until it runs out of tokens. The output stays valid
    (a narrower language); a schema that wants other keys says so explicitly. Required names
    the schema does not describe stay allowed, with any value. Objects that combine with
    others (see _composed) stay open: closing them could leave nothing to generate."""
    schema = json.loads(json.dumps(schema))  # a copy to edit
    warnings = []
    composed = _composed(schema)
    for where, node in subschemas(schema):
        properties = node.get("properties")
        if (isinstance(properties, dict) and id(node) not in composed
                and not any(key in node for key in _COMPOSED)):
            for name in node.get("required", ()):
                if isinstance(name, str):
                    properties.setdefault(name, {})
            node["additionalProperties"] = False
        fmt = node.get("format")
        if fmt in DATE_PATTERNS:  # (format and pattern both apply to strings only)
            if "pattern" in node:
                raise ValueError(f"format {fmt!r} beside a pattern at {where or '/'} cannot "
                                 "be enforced")
            node["pattern"] = DATE_PATTERNS[fmt]
            del node["format"]
            continue
        if not isinstance(fmt, str) or fmt in ENFORCED_FORMATS:
            continue
        if fmt in STANDARD_FORMATS and strict:
            raise ValueError(f"format {fmt!r} at {where or '/'} cannot be enforced "
                             "(json_schema_strict=false ignores it)")
        if fmt in STANDARD_FORMATS:
            warnings.append(f"json_schema: format {fmt!r} at {where or '/'} was not enforced")
        else:
            log.warning("json_schema: non-standard format %r at %s ignored", fmt, where or "/")
        del node["format"]
    return schema, warnings


def located_keyword(schema: Any, message: str) -> str | None:
    """For an llguidance message about keywords it does not implement ("Unimplemented keys:
    [...]", "oneOf constraints are not supported", "oneOf not fully supported"), the first
    such keyword and the JSON pointer of the schema object using it: "'not' at /properties/a".
    None for other messages."""
    match = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if match is not None:
        keys = re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(1))
    else:
        match = re.match(r"(\$?\w+) (?:constraints are )?not (?:fully )?supported", message)
        if match is None:
            return None
        keys = [match.group(1)]
    for where, node in subschemas(schema):
        for key in keys:
            if key in node:
                return f"{key!r} at {where or '/'}"
    return ", ".join(repr(k) for k in keys)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
