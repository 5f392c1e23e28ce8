"""JSON Schema normalisation: rewrite a schema into what outlines-core converts faithfully,
swap in our own regexes where it would not, and refuse, by name and location, what neither
can honour. See json_schema.py for the whole picture."""

from __future__ import annotations

import functools
import logging
import re
import secrets
from typing import Any

from radixlm.runtime.grammar.outlines import json_regex as jr
from radixlm.runtime.grammar.outlines import schema_combinators as combinators
from radixlm.runtime.grammar.regex_check import json_string_pattern, parse

log = logging.getLogger(__name__)

# Bounded repeats unroll into one automaton state per position, each scanned against the
# whole vocabulary: a maxLength of 32767 would never finish compiling. Larger bounds are
# clamped down (the output stays valid, only shorter); larger minimums are an error.
MAX_STRING_LENGTH = 64
MAX_ITEMS = 16
GENERIC_DEPTH = 1  # containers inside a value the schema leaves unconstrained

# Formats are our own patterns, not outlines-core's: its date allows 2023-02-31, its time
# omits the offset RFC 3339 requires, and its email and uri can put a raw quote inside the
# JSON string. These match subsets of each format, all safe inside a JSON string.
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,20}[A-Za-z0-9])?"
_HOST = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+"
_URI_CHARS = r"[A-Za-z0-9._~%!$&'()*+,;=:@-]"
_DATE = (r"[12][0-9]{3}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_HEX = "[0-9a-f]"
FORMATS = {
    "date": _DATE,  # February stops at the 28th: a leap day would need the year's value
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": rf"[A-Za-z0-9][A-Za-z0-9._%+-]*@{_HOST}",
    "uri": rf"https?://{_HOST}(?::[0-9]{{1,5}})?(?:/{_URI_CHARS}*)*(?:\?(?:{_URI_CHARS}|/)*)?",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,3}}",
}
# Standard formats a validator may check that we cannot generate. Other formats are
# annotations (validators ignore formats they do not know) and are dropped.
UNSUPPORTED_FORMATS = {"ipv6", "uri-reference", "iri", "iri-reference", "idn-email",
                       "idn-hostname", "json-pointer", "relative-json-pointer", "regex",
                       "uri-template", "duration"}
FORMAT_WIDTHS = {"date": (10, 10), "uuid": (36, 36)}
UNSUPPORTED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
               "dependencies", "propertyNames", "contains", "minContains", "maxContains",
               "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef",
               "extends", "disallow", "divisibleBy")
_TYPE_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}


class Normaliser:
    def __init__(self, root: dict, ws: str, text: str) -> None:
        self.root = root
        self.ws = ws
        self.subs: dict[str, str] = {}
        self.nonce = secrets.token_hex(4)
        while self.nonce in text:
            self.nonce = secrets.token_hex(4)
        self.ref_stack: list[str] = []

    def placeholder(self, regex: str) -> dict:
        key = f"RDXSUB{self.nonce}N{len(self.subs)}"
        self.subs[key] = regex
        return {"const": key}

    def fail(self, path: str, message: str) -> ValueError:
        return ValueError(f"json_schema: {message} (at {path or '/'})")

    # -- dispatch ----------------------------------------------------------------------------

    def schema(self, s: Any, path: str) -> dict:
        if s is True or s == {}:
            return self.placeholder(jr.generic_value(GENERIC_DEPTH, self.ws))
        if s is False:
            raise self.fail(path, "the schema `false` allows no value")
        if not isinstance(s, dict):
            raise self.fail(path, f"expected a schema object, got {type(s).__name__}")
        for keyword in UNSUPPORTED:
            if keyword in s:
                raise self.fail(path, f"'{keyword}' is not supported")
        s = {k: v for k, v in s.items() if k not in ("definitions", "$defs")}
        if "$ref" in s:
            return self.ref(s, path)
        if "allOf" in s:
            branches = [self.resolve(b, f"{path}/allOf/{i}") for i, b in enumerate(s.pop("allOf"))]
            merged = functools.reduce(lambda a, b: self.merge(a, b, path), branches, s)
            return self.schema(merged, path)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.alternatives(s, key, path)
        if "enum" in s or "const" in s:
            return self.listed_values(s, path)
        kind = self.kind(s, path)
        if isinstance(kind, list):
            return self.schema({"anyOf": [{**s, "type": t} for t in kind]}, path)
        if kind is None:
            return self.placeholder(jr.generic_value(GENERIC_DEPTH, self.ws))
        handler = {"object": self.object, "array": self.array, "string": self.string,
                   "integer": self.number, "number": self.number}.get(kind)
        return handler(s, path, kind) if handler else {"type": kind}

    def listed_values(self, s: dict, path: str) -> dict:
        """enum / const, keeping only the values the rest of the schema allows (a `type` beside
        them narrows them: `{"enum": ["a", null], "type": "string"}` is just "a")."""
        import jsonschema

        values = list(s["enum"]) if "enum" in s else []
        if "const" in s:
            values = [v for v in values if v == s["const"]] if "enum" in s else [s["const"]]
        rest = {k: v for k, v in s.items() if k not in ("enum", "const")}
        if rest:
            validator = jsonschema.Draft202012Validator(rest)
            values = [v for v in values if validator.is_valid(v)]
        if not values:
            raise self.fail(path, "no value of enum/const is allowed by the rest of the schema")
        return {"enum": values}

    def kind(self, s: dict, path: str) -> str | list[str] | None:
        kind = s.get("type")
        if isinstance(kind, list):
            kinds = list(dict.fromkeys(kind))
            if len(kinds) == 1:
                return kinds[0]
            return kinds if kinds else None
        if kind is not None:
            return kind
        for name, keywords in _TYPE_KEYWORDS.items():  # untyped, but its keywords tell
            if any(k in s for k in keywords):
                return name
        return None

    # -- references and combinators ---------------------------------------------------------

    def resolve(self, s: Any, path: str) -> Any:
        """Inline a $ref (one level), keeping sibling keywords."""
        if isinstance(s, dict) and "$ref" in s:
            target = self.target(s["$ref"], path)
            rest = {k: v for k, v in s.items() if k != "$ref"}
            return self.merge(self.resolve(target, path), rest, path) if rest else target
        return s

    def merge(self, a: Any, b: Any, path: str) -> dict:
        return combinators.merge(a, b, lambda s: self.resolve(s, path),
                                 lambda m: self.fail(path, m))

    def ref(self, s: dict, path: str) -> dict:
        ref = s["$ref"]
        if ref in self.ref_stack:
            raise self.fail(path, f"recursive $ref {ref!r} is not supported")
        self.ref_stack.append(ref)
        try:
            return self.schema(self.resolve(s, path), path)
        finally:
            self.ref_stack.pop()

    def target(self, ref: Any, path: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.fail(path, f"$ref {ref!r}: only local references ('#/...') are supported")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self.fail(path, f"$ref {ref!r} points nowhere")
        return node

    def alternatives(self, s: dict, key: str, path: str) -> dict:
        branches = s[key]
        rest = {k: v for k, v in s.items() if k not in ("anyOf", "oneOf")}
        if "anyOf" in s and "oneOf" in s:
            raise self.fail(path, "anyOf together with oneOf is not supported")
        resolved = []
        for i, branch in enumerate(branches):
            branch = self.resolve(branch, f"{path}/{key}/{i}")
            if rest:  # keywords beside anyOf apply to every branch
                branch = self.merge(dict(rest), branch, path)
            resolved.append(branch)
        if key == "oneOf":
            resolved = combinators.exclusive(resolved, lambda m: self.fail(path, m))
        return {"anyOf": [self.schema(b, f"{path}/{key}/{i}") for i, b in enumerate(resolved)]}

    # -- types -------------------------------------------------------------------------------

    def object(self, s: dict, path: str, kind: str) -> dict:
        props = dict(s.get("properties") or {})
        required = s.get("required") if isinstance(s.get("required"), list) else []
        required = [r for r in required if isinstance(r, str)]
        for name in required:
            props.setdefault(name, {})  # required but not described: any value
        out_props = {}
        for name, sub in props.items():
            if re.search(r'["\\\x00-\x1f]', name):
                raise self.fail(path, f"property name {name!r}: quotes, backslashes and "
                                      "control characters in names are not supported")
            if sub is False:
                if name in required:
                    raise self.fail(path, f"required property {name!r} has the schema false")
                continue
            out_props[name] = self.schema(sub, f"{path}/properties/{name}")
        patterns = s.get("patternProperties") or {}
        if patterns and (not out_props or any(re.search(p, n) for p in patterns
                                              for n in out_props)):
            raise self.fail(path, "'patternProperties' is not supported (it is only accepted "
                                  "when no listed property matches a pattern)")
        if s.get("minProperties", 0) > len(required):
            raise self.fail(path, "'minProperties' above the number of required properties "
                                  "is not supported")
        if "maxProperties" in s and s["maxProperties"] < len(out_props):
            raise self.fail(path, "'maxProperties' below the number of properties is not "
                                  "supported")
        if out_props:
            # Only listed properties are generated, so additionalProperties needs nothing.
            return {"type": "object", "properties": out_props,
                    "required": [r for r in required if r in out_props]}
        extra = s.get("additionalProperties", True)
        if extra is False:
            return self.placeholder(rf"\{{{self.ws}\}}")
        if extra is True or extra == {}:
            value = jr.generic_value(GENERIC_DEPTH, self.ws)
            return self.placeholder(jr.generic_object(value, self.ws))
        return {"type": "object",
                "additionalProperties": self.schema(extra, f"{path}/additionalProperties")}

    def array(self, s: dict, path: str, kind: str) -> dict:
        items = s.get("items", True)
        prefix = s.get("prefixItems")
        if isinstance(items, list):  # draft 4 tuples
            prefix, items = items, True
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if hi is not None and hi > MAX_ITEMS:
            log.warning("json_schema: maxItems %d clamped to %d at %s", hi, MAX_ITEMS, path)
            hi = MAX_ITEMS
        if lo > MAX_ITEMS:
            raise self.fail(path, f"minItems {lo} is above the supported {MAX_ITEMS}")
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            raise self.fail(path, "'uniqueItems' is not supported")
        if prefix is not None:
            if lo > len(prefix):
                raise self.fail(path, "minItems beyond prefixItems is not supported")
            # Exactly the tuple is generated: always valid, whatever follows it.
            return {"type": "array", "prefixItems": [
                self.schema(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]}
        out: dict[str, Any] = {"type": "array", "items": self.schema(items, f"{path}/items")}
        if lo:
            out["minItems"] = lo
        if hi is not None:
            out["maxItems"] = hi
        return out

    def string(self, s: dict, path: str, kind: str) -> dict:
        fmt, pattern = s.get("format"), s.get("pattern")
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if fmt is not None and fmt not in FORMATS:
            if fmt in UNSUPPORTED_FORMATS:
                raise self.fail(path, f"format {fmt!r} is not supported")
            fmt = None  # an annotation
        if fmt is not None and pattern is not None:
            raise self.fail(path, "'format' together with 'pattern' is not supported")
        if pattern is not None:
            regex = json_string_pattern(pattern, f"json_schema: pattern at {path or '/'}")
            self.check_width(parse(regex, "json_schema").getwidth(), lo, hi, "pattern", path)
            return {"type": "string", "pattern": regex}
        if fmt is not None:
            if lo or hi is not None:
                self.check_width(FORMAT_WIDTHS.get(fmt, (0, None)), lo, hi, fmt, path)
            return self.placeholder(f'"{FORMATS[fmt]}"')
        if lo > MAX_STRING_LENGTH:
            raise self.fail(path, f"minLength {lo} is above the supported {MAX_STRING_LENGTH}")
        out: dict[str, Any] = {"type": "string"}
        if hi is not None and hi > MAX_STRING_LENGTH:
            log.warning("json_schema: maxLength %d clamped to %d at %s", hi, MAX_STRING_LENGTH,
                        path or "/")
            hi = MAX_STRING_LENGTH
        if (lo or hi is not None) and not _inside_container(path):
            length = f"{{{lo},{'' if hi is None else hi}}}"
            return self.placeholder(f'"{jr.TOP_LEVEL_STRING_CHAR}{length}"')
        if lo:
            out["minLength"] = lo
        if hi is not None:
            out["maxLength"] = hi
        return out

    def check_width(self, width: tuple, lo: int, hi: int | None, what: str, path: str) -> None:
        """Length bounds beside a pattern or format are only accepted when implied by it."""
        least, most = width
        if least < lo or hi is not None and (most is None or most > hi):
            raise self.fail(path, f"minLength/maxLength together with {what} are only "
                                  f"supported when the {what} implies them")

    def number(self, s: dict, path: str, kind: str) -> dict:
        step = s.get("multipleOf")
        if step is not None and not (kind == "integer" and step == 1):
            raise self.fail(path, "'multipleOf' is not supported")
        lo, lo_x = _bound(s, "minimum", "exclusiveMinimum")
        hi, hi_x = _bound(s, "maximum", "exclusiveMaximum")
        if lo is None and hi is None:
            return {"type": kind}
        if kind == "integer":
            int_lo = None if lo is None else (_floor(lo) + 1 if lo_x else _ceil(lo))
            int_hi = None if hi is None else (_ceil(hi) - 1 if hi_x else _floor(hi))
            regex = jr.integer_range(int_lo, int_hi)
        else:
            regex = jr.number_range(lo, hi, lo_x, hi_x)
        if regex is None:
            raise self.fail(path, f"no {kind} with at most {jr.MAX_INT_DIGITS} digits fits "
                                  "the bounds")
        return self.placeholder(regex)


def _inside_container(path: str) -> bool:
    """Does the schema at `path` describe a value inside an object or an array (rather than
    the whole output, reached only through combinators and references)?"""
    return any(part in _CONTAINER_KEYWORDS for part in path.split("/"))


_CONTAINER_KEYWORDS = frozenset({"properties", "additionalProperties", "items", "prefixItems"})


def _bound(s: dict, inclusive: str, exclusive: str) -> tuple[float | None, bool]:
    """(bound, is_exclusive) from draft 6+ numbers or draft 4 booleans; the tighter wins."""
    value, flag = s.get(inclusive), s.get(exclusive)
    if isinstance(flag, bool):  # draft 4: exclusiveMinimum: true modifies minimum
        return value, flag and value is not None
    if flag is None:
        return value, False
    if value is None:
        return flag, True
    tighter_exclusive = flag >= value if inclusive == "minimum" else flag <= value
    return (flag, True) if tighter_exclusive else (value, False)


def _floor(x: float) -> int:
    return int(x // 1)


def _ceil(x: float) -> int:
    return -int(-x // 1)
