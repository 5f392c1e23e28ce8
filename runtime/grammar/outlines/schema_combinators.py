"""allOf, oneOf and friends for the schema normaliser: merging schemas, making branches
mutually exclusive. `resolve` inlines a $ref one level; `fail(message)` builds the ValueError
(it knows where in the schema we are)."""

from __future__ import annotations

from typing import Any, Callable

Fail = Callable[[str], ValueError]
Resolve = Callable[[Any], Any]

_MERGE_MAX = ("minimum", "minLength", "minItems", "minProperties")
_MERGE_MIN = ("maximum", "maxLength", "maxItems", "maxProperties")
_ANNOTATIONS = ("title", "description", "$comment", "examples", "default")


def merge(a: Any, b: Any, resolve: Resolve, fail: Fail) -> dict:
    """The schema both a and b allow (allOf), for the keywords that combine simply."""
    if b is True:
        return dict(a) if isinstance(a, dict) else {}
    if a is True:
        a = {}
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise fail("allOf with a non-object schema is not supported")
    a, b = dict(resolve(a)), resolve(b)
    # additionalProperties: false on one side rules out the other side's extra properties.
    closed = [set(s.get("properties") or ()) for s in (a, b)
              if s.get("additionalProperties") is False]
    for key, value in b.items():
        if key not in a:
            a[key] = value
        elif key == "properties":
            props = dict(a[key])
            for name, sub in value.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            a[key] = props
        elif key == "required":
            a[key] = list(dict.fromkeys([*a[key], *value]))
        elif key == "type":
            a[key] = merge_types(a[key], value, fail)
        elif key == "enum":
            a[key] = [v for v in a[key] if v in value]
        elif key in _MERGE_MAX:
            a[key] = max(a[key], value)
        elif key in _MERGE_MIN:
            a[key] = min(a[key], value)
        elif key == "additionalProperties" and False in (a[key], value):
            a[key] = False
        elif a[key] != value and key not in _ANNOTATIONS:
            raise fail(f"allOf with conflicting '{key}' is not supported")
    for allowed in closed:
        extra = [r for r in a.get("required") or () if r not in allowed]
        if extra:
            raise fail(f"allOf: required property {extra[0]!r} is excluded by "
                       "additionalProperties: false")
        a["properties"] = {k: v for k, v in (a.get("properties") or {}).items() if k in allowed}
    return a


def merge_types(a: Any, b: Any, fail: Fail) -> Any:
    left = set(a if isinstance(a, list) else [a])
    right = set(b if isinstance(b, list) else [b])
    both = left & right
    if "number" in left and "integer" in right or "integer" in left and "number" in right:
        both.add("integer")
    if not both:
        raise fail(f"allOf of types {a!r} and {b!r} allows no value")
    return sorted(both)[0] if len(both) == 1 else sorted(both)


def exclusive(branches: list, fail: Fail) -> list:
    """oneOf: an output must match exactly one branch. Object branches that differ in what
    they require are made exclusive by not generating, in one branch, the optional properties
    another branch requires. A branch whose outputs could still match another branch (by
    type, value or required properties) is not generated; if none is left, the oneOf is
    refused."""
    objs = [b if isinstance(b, dict) else {} for b in branches]
    required = [set(b.get("required") or ()) for b in objs]
    out = []
    for i, b in enumerate(objs):
        others = set().union(*(r for j, r in enumerate(required) if j != i))
        props = b.get("properties")
        if isinstance(props, dict) and others - required[i]:
            b = {**b, "properties": {k: v for k, v in props.items()
                                     if k in required[i] or k not in others}}
        out.append(b)
    kept = [a for i, a in enumerate(out)
            if all(excludes(a, b) for j, b in enumerate(out) if j != i)]
    if not kept:
        raise fail("oneOf whose branches may overlap is not supported (no branch excludes "
                   "all the others)")
    return kept


def excludes(a: dict, b: dict) -> bool:
    """Can no output generated for branch a also match branch b? (Sufficient checks only.)"""
    ta, tb = json_types(a), json_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    va, vb = values(a), values(b)
    if va is not None and vb is not None and not any(x == y for x in va for y in vb):
        return True
    # Only listed properties are generated for a: b requiring another one rules a out.
    props = a.get("properties")
    return isinstance(props, dict) and bool(props) and \
        bool(set(b.get("required") or ()) - set(props))


def json_types(s: dict) -> set[str] | None:
    """The JSON types a schema allows (integers count as numbers), None if unknown."""
    vals = values(s)
    if vals is not None:
        names = {"bool": "boolean", "int": "number", "float": "number", "str": "string",
                 "dict": "object", "list": "array", "NoneType": "null"}
        return {names[type(v).__name__] for v in vals}
    kind = s.get("type")
    if kind is None:
        return {"object"} if "properties" in s or "required" in s else None
    kinds = set(kind if isinstance(kind, list) else [kind])
    return {"number" if k == "integer" else k for k in kinds}


def values(s: dict) -> list | None:
    if "const" in s:
        return [s["const"]]
    return list(s["enum"]) if isinstance(s.get("enum"), list) else None
