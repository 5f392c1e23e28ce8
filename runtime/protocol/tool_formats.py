"""How models write tool calls, per chat format: parse a finished reply into text and calls
(streamed replies: tool_stream.py), and the structural tag that holds every call the model
starts to its tool's schema (all tool choices but `none`).

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


def parse(fmt: str, text: str, tool_names: Sequence[str],
          cut: bool = False) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished reply; (text, []) unless every call parses. `cut`: the
    token budget ended the reply, maybe inside a call: the calls completed before it are
    calls, and the unfinished one is dropped (call markup is never returned as text)."""
    names = set(tool_names)
    calls = _calls(fmt, text, names)
    if calls is None and cut:
        text = complete_part(fmt, text)
        calls = _calls(fmt, text, names)
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


def complete_part(fmt: str, text: str) -> str:
    """A reply cut inside a call, written again as its complete calls only."""
    trigger = TRIGGERS[fmt] or ""
    at = text.find(trigger) if trigger else 0
    if at < 0:
        return text  # no call was started
    if fmt == "hermes":
        last = text.rfind("<tool_call>")
        return text[:last] if last >= 0 and "</tool_call>" not in text[last:] else text
    head, body = text[:at], text[at + len(trigger):].lstrip()
    if fmt == "mistral":
        objects = _leading_objects(body.removeprefix("[").lstrip())
        return f"{head}{trigger}[{', '.join(objects)}]" if objects else head
    body = body.removeprefix("<|python_tag|>").lstrip()
    objects = _leading_objects(body)
    return "; ".join(objects) if objects else "" if body.startswith("{") else text


def _leading_objects(body: str, separators: str = " \n\t;,") -> list[str]:
    """The texts of the complete JSON values at the start of `body`, between separators."""
    return _objects(body, separators)[0]


def _unclosed(text: str) -> bool:
    return "<tool_call>" in text or "</tool_call>" in text


def _split_calls(body: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (a `;` inside a string does not split); the whole
    body when it is not a sequence of objects (the caller rejects it)."""
    parts, end = _objects(body, " \n\t;")
    return parts if end == len(body) else [body]


def _objects(body: str, separators: str) -> tuple[list[str], int]:
    """(the JSON values' texts from the start of `body`, where the run of them ends)."""
    decoder = json.JSONDecoder()
    parts, i = [], 0
    while i < len(body):
        try:
            _, end = decoder.raw_decode(body, i)
        except ValueError:
            break
        parts.append(body[i:end])
        i = end
        while i < len(body) and body[i] in separators:
            i += 1
    return parts, i


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


# -- the calls' grammar: a structural tag ----------------------------------------------------

# The compact JSON a call is written in (the spacing of the models' own examples).
_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
TRIGGERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": None}
# A llama3_json reply that is not a call: anything but a JSON object (after any spaces).
_NOT_AN_OBJECT = r"[ \t\n]*([^{ \t\n](.|\n)*)?"


def call_structural_tag(fmt: str, tools: Sequence[dict[str, Any]], parallel: bool,
                        required: bool) -> dict[str, Any]:
    """The structural tag (grammar/structural_tag.py) of replies that call `tools` in `fmt`.
    `required`: the reply is one call, or with `parallel` one or more, and nothing else.
    Otherwise (`auto`) the reply is free text until the model starts a call with the format's
    trigger; the call is then held to the tool's schema until its end, and with `parallel`
    text and calls may follow. Each tool's `parameters` is the arguments' own schema root, so
    its local references (`#/$defs/...`) resolve."""
    args_key = "parameters" if fmt == "llama3_json" else "arguments"

    def call(prefix: str, suffix: str) -> list[dict[str, Any]]:
        return [{"type": "tag", "begin": prefix + "{" + json.dumps("name") + ": "
                 + json.dumps(t["name"], ensure_ascii=False) + ", " + json.dumps(args_key)
                 + ": ", "content": {"type": "json_schema", "json_schema": {
                     "x-guidance": _COMPACT, **t["parameters"]}},
                 "end": "}" + suffix} for t in tools]

    def separated(tags: list[dict[str, Any]], separator: str) -> dict[str, Any]:
        return {"type": "tags_with_separator", "tags": tags, "separator": separator,
                "at_least_one": True, "stop_after_first": not parallel}

    if fmt == "hermes":
        tags = call("<tool_call>\n", "\n</tool_call>")
        fmt_tag = (separated(tags, "\n") if required else
                   {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                    "at_least_one": False, "stop_after_first": not parallel})
    elif fmt == "mistral":
        calls = {"type": "sequence", "elements": [separated(call("", ""), ", "),
                                                  {"type": "const_string", "value": "]"}]}
        block = {"type": "tag", "begin": "[TOOL_CALLS][", "content": calls, "end": ""}
        fmt_tag = (block if required else
                   {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": [block],
                    "at_least_one": False, "stop_after_first": True})
    else:  # llama3_json: the whole reply is the call(s), or it is not a call at all
        fmt_tag = separated(call("", ""), "; ")
        if not required:
            fmt_tag = {"type": "or", "elements": [
                {"type": "regex", "pattern": _NOT_AN_OBJECT}, fmt_tag]}
    return {"type": "structural_tag", "format": fmt_tag}


def system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """What a model whose template knows no tools is told about them (hermes format)."""
    listed = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False)
                       for t in tools)
    return ("You may call one or more functions to help with the user's request. The "
            "functions are listed here, one JSON object per line:\n" + listed + "\n\nTo call "
            "a function, reply with one block per call and nothing else:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <an object of its arguments>}\n'
            "</tool_call>")
