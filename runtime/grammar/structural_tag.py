"""Structural tags: output that is free text except where the model opens a tag, whose body is
then held to a schema or a grammar until the tag closes. Tool calls in running text are the
main use (`<tool_call>` ... `</tool_call>`), and the server's tool calling is built on them.

A structural tag is JSON, in either of the two shapes vLLM and XGrammar accept:

    {"type": "structural_tag", "triggers": ["<function="],
     "structures": [{"begin": "<function=f>", "schema": {...}, "end": "</function>"}]}

    {"type": "structural_tag", "format": <format>}

where a format is one of
    {"type": "const_string", "value": "..."}
    {"type": "json_schema", "json_schema": {...}}
    {"type": "regex", "pattern": "..."}
    {"type": "grammar", "grammar": "<Lark or GBNF with a start rule>"}
    {"type": "any_text"}
    {"type": "sequence", "elements": [<format>, ...]}
    {"type": "or", "elements": [<format>, ...]}
    {"type": "tag", "begin": "...", "content": <format>, "end": "..."}
    {"type": "triggered_tags", "triggers": [...], "tags": [<tag>, ...],
     "at_least_one": false, "stop_after_first": false}
    {"type": "tags_with_separator", "tags": [<tag>, ...], "separator": "...",
     "at_least_one": false, "stop_after_first": false}

`triggered_tags` is free text until a trigger appears; the trigger must then continue as the
`begin` of one of the tags that start with it, the tag's content and its `end` follow, and
free text resumes. `at_least_one`: the output holds a tag (text may come first);
`stop_after_first`: the output ends after its first tag. `tags_with_separator` is only tags,
separated. `any_text` followed (in a sequence) by a string or a tag ends at that string's
first occurrence; elsewhere it runs to the end of the output.

check() validates the shape when a request is submitted (bounded: the document's size and
depth are checked before anything recursive); to_lark() writes the llguidance grammar, where
strings that are special tokens of the model's tokenizer (`<|python_tag|>`, `[TOOL_CALLS]`)
become those tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from radixlm.runtime.grammar.schema_check import check_schema_shape, prepare_schema

FIELD = "structural_tag"
FORMAT_TYPES = ("const_string", "json_schema", "regex", "grammar", "any_text", "sequence",
                "or", "tag", "triggered_tags", "tags_with_separator")
_TEXT = r"(.|\n)*"


# -- the shape, checked at submission ---------------------------------------------------------

def check(value: Any) -> str:
    """The structural tag (a dict or its JSON text) as compact JSON text of its normal form
    (the `format` shape). ValueError naming the place and the cause otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{FIELD} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{FIELD} must be a JSON object, got {type(value).__name__}")
    try:
        check_schema_shape(value)  # size and depth, iteratively
    except ValueError as exc:
        raise ValueError(str(exc).replace("json_schema", FIELD)) from None
    _only(value, FIELD, ("type", "format", "structures", "triggers"))
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{FIELD}.type must be 'structural_tag'")
    if "format" in value:
        if "structures" in value or "triggers" in value:
            raise ValueError(f"{FIELD}: give either format or structures and triggers")
        normal = _format(value["format"], f"{FIELD}.format")
    else:
        normal = _legacy(value)
    return json.dumps(normal, separators=(",", ":"), ensure_ascii=False)


def _legacy(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's {structures, triggers} as the equivalent triggered_tags."""
    structures = _list(value.get("structures"), f"{FIELD}.structures")
    tags = []
    for i, s in enumerate(structures):
        where = f"{FIELD}.structures[{i}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where} must be an object")
        _only(s, where, ("begin", "schema", "end"))
        schema = s.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(f"{where}.schema must be a JSON Schema object")
        tags.append({"type": "tag", "begin": _string(s.get("begin"), f"{where}.begin"),
                     "content": {"type": "json_schema", "json_schema": schema},
                     "end": _string(s.get("end"), f"{where}.end", empty=True)})
    return _format({"type": "triggered_tags", "triggers": value.get("triggers"), "tags": tags},
                   FIELD)


def _format(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"{where}.type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}")
    if kind == "const_string":
        _only(value, where, ("type", "value"))
        return {"type": kind, "value": _string(value.get("value"), f"{where}.value")}
    if kind == "json_schema":
        _only(value, where, ("type", "json_schema"))
        if not isinstance(value.get("json_schema"), dict):
            raise ValueError(f"{where}.json_schema must be a JSON Schema object")
        return {"type": kind, "json_schema": value["json_schema"]}
    if kind == "regex":
        _only(value, where, ("type", "pattern"))
        return {"type": kind, "pattern": _string(value.get("pattern"), f"{where}.pattern")}
    if kind == "grammar":
        _only(value, where, ("type", "grammar"))
        return {"type": kind, "grammar": _string(value.get("grammar"), f"{where}.grammar")}
    if kind == "any_text":
        _only(value, where, ("type",))
        return {"type": kind}
    if kind in ("sequence", "or"):
        _only(value, where, ("type", "elements"))
        elements = _list(value.get("elements"), f"{where}.elements")
        return {"type": kind, "elements": [_format(e, f"{where}.elements[{i}]")
                                           for i, e in enumerate(elements)]}
    if kind == "tag":
        return _tag(value, where)
    flags = {name: _flag(value, name, where) for name in ("at_least_one", "stop_after_first")}
    tags = [_tag(t, f"{where}.tags[{i}]")
            for i, t in enumerate(_list(value.get("tags"), f"{where}.tags"))]
    if kind == "tags_with_separator":
        _only(value, where, ("type", "tags", "separator", "at_least_one", "stop_after_first"))
        separator = _string(value.get("separator", ""), f"{where}.separator", empty=True)
        return {"type": kind, "tags": tags, "separator": separator, **flags}
    _only(value, where, ("type", "triggers", "tags", "at_least_one", "stop_after_first"))
    triggers = [_string(t, f"{where}.triggers[{i}]")
                for i, t in enumerate(_list(value.get("triggers"), f"{where}.triggers"))]
    for i, tag in enumerate(tags):
        if not any(tag["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.tags[{i}].begin {tag['begin']!r} starts with none of "
                             f"the triggers")
    return {"type": kind, "triggers": triggers, "tags": tags, **flags}


def _tag(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    _only(value, where, ("type", "begin", "content", "end"))
    if value.get("type", "tag") != "tag":
        raise ValueError(f"{where}.type must be 'tag'")
    return {"type": "tag", "begin": _string(value.get("begin"), f"{where}.begin"),
            "content": _format(value.get("content"), f"{where}.content"),
            "end": _string(value.get("end", ""), f"{where}.end", empty=True)}


def _only(value: dict[str, Any], where: str, allowed: Sequence[str]) -> None:
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (allowed: "
                         f"{', '.join(allowed)})")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty array")
    return value


def _string(value: Any, where: str, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty):
        raise ValueError(f"{where} must be a {'' if empty else 'non-empty '}string")
    return value


def _flag(value: dict[str, Any], name: str, where: str) -> bool:
    flag = value.get(name, False)
    if not isinstance(flag, bool):
        raise ValueError(f"{where}.{name} must be a boolean")
    return flag


# -- the grammar, built in the grammar engine -------------------------------------------------

def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens (text -> id): what llguidance matches only as tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    out = {t.content: i for i, t in added.items() if getattr(t, "special", False)}
    for text in getattr(tokenizer, "all_special_tokens", []) or []:
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id >= 0:
            out.setdefault(text, token_id)
    return out


def to_lark(source: str, special_tokens: dict[str, int],
            json_options: dict[str, Any] | None = None) -> str:
    """llguidance's grammar for a checked structural tag (check()'s JSON text): Lark text, or
    a JSON grammar list when the tag holds `grammar` formats (each becomes a grammar of its
    own). `special_tokens`: text -> id of the tokenizer's special tokens. `json_options`:
    llguidance's JSON whitespace options for schemas that set none."""
    return _Builder(special_tokens, json_options or {}).build(
        json.loads(source))


class _Builder:
    def __init__(self, special_tokens: dict[str, int], json_options: dict[str, Any]) -> None:
        specials = sorted((t for t in special_tokens if t), key=len, reverse=True)
        self.specials = special_tokens
        self.split = (re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")
                      if specials else None)
        self.json_options = json_options
        self.rules: list[str] = []
        self.side: list[dict[str, str]] = []

    def build(self, fmt: dict[str, Any]) -> str:
        start = self.node(fmt)
        lark = "\n".join(["%llguidance {}", f"start: {start}", *self.rules,
                          f"TEXT: /{_TEXT}/"]) + "\n"
        if not self.side:
            return lark
        return json.dumps({"grammars": [{"lark_grammar": lark}, *self.side]})

    def rule(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def literal(self, text: str) -> str:
        """A string, with the tokenizer's special tokens in it as those tokens."""
        if not text:
            return '""'
        parts = self.split.split(text) if self.split else [text]
        return " ".join(f"<[{self.specials[p]}]>" if p in self.specials
                        else json.dumps(p, ensure_ascii=False) for p in parts if p)

    def plain(self, text: str) -> bool:
        """Holds no special token (can end a lazy run of text)?"""
        return not (self.split and self.split.search(text))

    def node(self, fmt: dict[str, Any]) -> str:
        kind = fmt["type"]
        if kind == "const_string":
            return self.literal(fmt["value"])
        if kind == "json_schema":
            schema, _ = prepare_schema(fmt["json_schema"])
            if "x-guidance" not in schema:
                schema["x-guidance"] = self.json_options
            return self.rule("%json " + json.dumps(schema, ensure_ascii=False))
        if kind == "regex":
            return self.rule("/" + fmt["pattern"].replace("/", "\\/") + "/")
        if kind == "grammar":
            from llguidance.gbnf_to_lark import any_to_lark  # (Lark passes through)

            name = f"g{len(self.side)}"
            self.side.append({"name": name, "lark_grammar": any_to_lark(fmt["grammar"])})
            return "@" + name
        if kind == "any_text":
            return "TEXT"
        if kind == "sequence":
            return self.rule(self.sequence(fmt["elements"]))
        if kind == "or":
            return self.rule(" | ".join(self.node(e) for e in fmt["elements"]))
        if kind == "tag":
            return self.rule(self.tag(fmt))
        if kind == "tags_with_separator":
            return self.rule(self.separated(fmt))
        return self.rule(self.triggered(fmt))

    def sequence(self, elements: list[dict[str, Any]]) -> str:
        parts, i = [], 0
        while i < len(elements):
            element = elements[i]
            following = elements[i + 1] if i + 1 < len(elements) else None
            stop = None
            if element["type"] == "any_text" and following is not None:
                stop = (following.get("value") if following["type"] == "const_string" else
                        following.get("begin") if following["type"] == "tag" else None)
            if stop and self.plain(stop):
                # Text up to the first occurrence of what follows, then the rest of it.
                head = self.rule(f"TEXT {json.dumps(stop, ensure_ascii=False)}", "[lazy]")
                parts.append(head if following["type"] == "const_string"
                             else self.rule(f"{head} {self.tag_rest(following, stop)}"))
                i += 2
                continue
            parts.append(self.node(element))
            i += 1
        return " ".join(parts)

    def tag(self, tag: dict[str, Any]) -> str:
        return f"{self.literal(tag['begin'])} {self.node(tag['content'])} " \
               f"{self.literal(tag['end'])}"

    def tag_rest(self, tag: dict[str, Any], opened: str) -> str:
        """A tag after `opened` (a prefix of its begin) was written."""
        return f"{self.literal(tag['begin'][len(opened):])} {self.node(tag['content'])} " \
               f"{self.literal(tag['end'])}"

    def separated(self, fmt: dict[str, Any]) -> str:
        one = self.rule(" | ".join(self.rule(self.tag(t)) for t in fmt["tags"]))
        if fmt["stop_after_first"]:
            body = one
        else:
            body = f"{one} ({self.literal(fmt['separator'])} {one})*"
        return body if fmt["at_least_one"] else f"({body})?"

    def triggered(self, fmt: dict[str, Any]) -> str:
        by_trigger: dict[str, list[dict[str, Any]]] = {}
        for tag in fmt["tags"]:  # each tag under the longest trigger it starts with
            trigger = max((t for t in fmt["triggers"] if tag["begin"].startswith(t)), key=len)
            by_trigger.setdefault(trigger, []).append(tag)
        alternatives = []
        for trigger, tags in by_trigger.items():
            rest = " | ".join(self.rule(self.tag_rest(t, trigger)) for t in tags)
            if self.plain(trigger):
                # Lazy: the run of text ends at the trigger's first occurrence, and the tag
                # must follow (no free text can swallow a trigger).
                head = self.rule(f"TEXT {json.dumps(trigger, ensure_ascii=False)}", "[lazy]")
            else:  # a special token cannot be part of text: it ends the text by itself
                head = self.rule(f"TEXT {self.literal(trigger)}")
            alternatives.append(self.rule(f"{head} ({rest})"))
        one = self.rule(" | ".join(alternatives))
        if fmt["stop_after_first"]:
            return one if fmt["at_least_one"] else f"{one} | TEXT"
        return f"{one}{'+' if fmt['at_least_one'] else '*'} TEXT"
