"""How models write tool calls, per chat format: parse a reply into text and calls (whole or
streamed), and the grammar that makes a reply a valid call (`tool_choice` required or named).

Formats:
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per
  call (Qwen2.5, Qwen3, Hermes; and our prompt for templates that know no tools).
- `llama3_json`: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
  several separated by `;` (Llama 3.1+).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

A reply that does not parse as calls of the request's tools is text: a broken or unknown call
is never returned as a tool call.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Sequence

FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def format_for_template(template: str | None) -> str:
    """The format a chat template's model writes calls in; `hermes` when it shows none (the
    server then describes the tools in a system message, in that format)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template
                                        and "tools" in template):
        return "llama3_json"
    return "hermes"


def new_call_id(fmt: str) -> str:
    if fmt == "mistral":  # its templates require 9 alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# -- parsing a whole reply --------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse(fmt: str, text: str, tool_names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished reply; (text, []) unless every call parses."""
    calls = _calls(fmt, text, set(tool_names))
    if calls is None:
        return text, []
    content, objects = calls
    return content, [ToolCall(o["name"], json.dumps(o["arguments"], ensure_ascii=False),
                              new_call_id(fmt)) for o in objects]


def _calls(fmt: str, text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]] | None:
    if fmt == "hermes":
        blocks = list(_HERMES.finditer(text))
        if not blocks:
            return None
        objects = [_call_object(b.group(1), "arguments", names) for b in blocks]
        rest = _HERMES.sub("", text)
        return (rest.strip(), objects) if all(objects) and not _unclosed(rest) else None
    if fmt == "mistral":
        start = text.find("[TOOL_CALLS]")
        head, body = (text[:start], text[start + len("[TOOL_CALLS]"):]) if start >= 0 \
            else ("", text)
        try:
            items = json.loads(body)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        objects = [_checked(item, "arguments", names) for item in items]
        return (head.strip(), objects) if all(objects) else None
    # llama3_json: the whole reply is the call(s).
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    objects = [_call_object(part, "parameters", names) for part in _split_calls(body)]
    return ("", objects) if objects and all(objects) else None


def _unclosed(text: str) -> bool:
    return "<tool_call>" in text or "</tool_call>" in text


def _split_calls(body: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (a `;` inside a string does not split)."""
    decoder = json.JSONDecoder()
    parts, i = [], 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except ValueError:
            return [body]  # not a sequence of objects: let the caller reject it
        parts.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return parts


def _call_object(text: str, args_key: str, names: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _checked(value, args_key, names)


def _checked(value: Any, args_key: str, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": arguments}


# -- streaming --------------------------------------------------------------------------------

_TRIGGERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": None}


class StreamingToolParser:
    """Splits a streamed reply into content deltas and calls. Content is passed on until a
    call may be starting (text that could begin the format's trigger is held back); from the
    trigger on, text is held until the reply ends, then parsed whole: calls if it parses,
    else the held text as content."""

    def __init__(self, fmt: str, tool_names: Sequence[str]) -> None:
        self.fmt = fmt
        self.names = list(tool_names)
        self.trigger = _TRIGGERS[fmt]
        self.sent = ""  # content passed on so far
        self.held = ""  # text not passed on yet
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """The content that can be passed on now."""
        self.held += delta
        if self.in_calls:
            return ""
        if self.trigger is None:  # llama3_json: a reply that starts with "{" is a call
            head = self.held.lstrip()
            if self.sent or not head:
                return self._release(len(self.held)) if self.sent else ""
            if head.startswith(("{", "<|python_tag|>")):
                self.in_calls = True
                return ""
            if "<|python_tag|>".startswith(head):
                return ""  # not known yet
            return self._release(len(self.held))
        at = self.held.find(self.trigger)
        if at >= 0:
            self.in_calls = True
            return self._release(at)
        return self._release(len(self.held) - partial_suffix(self.held, self.trigger))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the rest of the content, the calls) at the end of the reply."""
        if not self.in_calls:
            rest, self.held = self.held, ""
            self.sent += rest
            return rest, []
        content, calls = parse(self.fmt, self.held, self.names)
        if not calls:
            rest, self.held = self.held, ""
            self.sent += rest
            return rest, []
        self.held = ""
        return content, calls

    def _release(self, n: int) -> str:
        out, self.held = self.held[:n], self.held[n:]
        self.sent += out
        return out


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text a stream
    holds back, since the next piece may complete the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# -- the grammar of a valid call --------------------------------------------------------------

def call_grammar(fmt: str, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
    """A Lark grammar (llguidance, with inline JSON schemas) whose sentences are calls of
    `tools` in `fmt`: one call, or with `parallel` one or more."""
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    variants = [{"type": "object", "properties": {
        "name": {"const": t["name"]}, args_key: closed(t["parameters"])},
        "required": ["name", args_key], "additionalProperties": False} for t in tools]
    call = variants[0] if len(variants) == 1 else {"anyOf": variants}
    compact = {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                              "item_separator": ", "}}
    if fmt == "mistral":
        schema = {**compact, "type": "array", "items": call, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return f'start: "[TOOL_CALLS]" %json {json.dumps(schema)}\n'
    obj = f"%json {json.dumps({**compact, **call})}"
    if fmt == "hermes":
        one = f'"<tool_call>\\n" {obj} "\\n</tool_call>"'
        sep = '"\\n"'
    else:
        one, sep = obj, '"; "'
    more = f" ({sep} call)*" if parallel else ""
    return f"start: call{more}\ncall: {one}\n"


def closed(schema: Any) -> Any:
    """The schema with objects that list their properties and say nothing of others taking
    only those: a function cannot take keyword arguments it does not declare, and a model left
    free to add keys tends to invent them without end. What it accepts is a subset of what the
    original does, so every call still validates against the tool's own schema."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out


def system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """What a model whose template knows no tools is told about them (hermes format)."""
    listed = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                       for t in tools)
    return ("You may call one or more functions to help with the user's request. The "
            "functions are listed here, one JSON object per line:\n" + listed + "\n\nTo call "
            "a function, reply with one block per call and nothing else:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <an object of its arguments>}\n'
            "</tool_call>")
