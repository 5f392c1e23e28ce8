"""OpenAI tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls`, the tool turns of a conversation, and how both reach the chat template.

A template that takes `tools` (Qwen, Llama 3.1+, Mistral, Hermes, ...) gets them as the
model was trained to see them. One that knows no tools gets a system message describing them
in the `hermes` format (tool_formats.system_prompt), with earlier calls and results written
in that format too, so tool calling works, if less reliably, with any chat model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.protocol import tool_formats
from radixlm.runtime.protocol.fields import Fields, bad

# Checked before any tool is looked at: how many, and how much JSON they are in all.
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 1 << 20  # characters of JSON text (about bytes), all tools together
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # fullmatch: `$` would let "name\n" through
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    tools: list[dict[str, Any]] = field(default_factory=list)  # name, description, parameters
    choice: str = "none"  # "none" | "auto" | "required" | "function" (the one named)
    forced: str | None = None  # the function tool_choice names
    parallel: bool = True
    # (field, schema) of each `parameters` given: checked against its JSON Schema draft's
    # meta-schema in the server's sandbox, off the event loop, with a time bound.
    schemas: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def constrained(self) -> bool:
        """The reply must be a call (required or named): decoding enforces it."""
        return self.choice in ("required", "function")

    def allowed(self) -> list[dict[str, Any]]:
        return [t for t in self.tools if self.forced in (None, t["name"])]

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": t} for t in self.tools]


def parse_tools(f: Fields) -> ToolRequest:
    """The request's tools, their shapes checked: counts and sizes first, then each tool.
    What is inside `parameters` is left to the caller (`ToolRequest.schemas`): its depth is the
    grammar layer's rule, and its JSON Schema validity a check that can take long."""
    raw = f.get("tools", (list,)) or []
    if len(raw) > MAX_TOOLS:
        raise bad(f"tools: at most {MAX_TOOLS} tools, got {len(raw)}", "tools")
    if _json_chars_over(raw, MAX_TOOLS_CHARS):
        raise bad(f"tools: at most {MAX_TOOLS_CHARS} characters of JSON in all", "tools")
    tools = [_tool(t, i) for i, t in enumerate(raw)]
    names = [t["name"] for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad(f"tools: the name {duplicate!r} is used twice", "tools")
    choice, forced = _choice(f.body.get("tool_choice"), names)
    parallel = f.boolean("parallel_tool_calls", True)
    if forced is not None:
        parallel = False  # a named choice is one call of that function
    schemas = [(f"tools[{i}].function.parameters", t["function"]["parameters"])
               for i, t in enumerate(raw) if t["function"].get("parameters") is not None]
    return ToolRequest(tools, choice, forced, parallel, schemas)


def _json_chars_over(value: Any, limit: int) -> bool:
    """Is `value` more than `limit` characters as JSON text (counted roughly: strings and
    keys by length, other scalars as 8)? Iterative, and stops at the limit: its cost is
    bounded by the limit, not by the input."""
    stack = [value]
    chars = 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            chars += 2 + sum(len(k) + 4 for k in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            chars += 2 + len(item)
            stack.extend(item)
        else:
            chars += len(item) + 2 if isinstance(item, str) else 8
        if chars > limit:
            return True
    return False


def _tool(value: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(value, dict):
        raise bad(f"{where} must be an object", where, "invalid_type")
    Fields(value, f"{where}.").only(("type", "function"))
    if value.get("type") != "function":
        raise bad(f"{where}.type must be 'function'", f"{where}.type", "invalid_value")
    fn = value.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function must be an object", f"{where}.function", "missing_field")
    f = Fields(fn, f"{where}.function.")
    f.only(("name", "description", "parameters", "strict"))
    name = f.string("name", required=True)
    if not _NAME.fullmatch(name):
        raise bad(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                  f"{where}.function.name", "invalid_value")
    description = f.string("description")
    f.boolean("strict")  # calls always match the schema when they are enforced
    parameters = f.object("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    tool = {"name": name, "parameters": parameters}
    if description is not None:
        tool["description"] = description
    return tool


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise bad(f"tool_choice {value!r} needs tools", "tool_choice")
        return value, None
    if isinstance(value, dict):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise bad("tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                      "\"function\", \"function\": {\"name\": ...}}", "tool_choice",
                      "invalid_value")
        if name not in names:
            raise bad(f"tool_choice names {name!r}, which is not among the tools",
                      "tool_choice.function.name", "invalid_value")
        return "function", name
    raise bad("tool_choice must be 'none', 'auto', 'required' or an object naming a function",
              "tool_choice", "invalid_type")


# -- the conversation's tool turns ------------------------------------------------------------

def assistant_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with arguments as objects (what templates
    expect)."""
    if not isinstance(value, list):
        raise bad(f"{where}.tool_calls must be an array", f"{where}.tool_calls", "invalid_type")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{at}.function.name is required", f"{at}.function.name",
                      "missing_field")
        arguments = fn.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise bad(f"{at}.function.arguments must be JSON text of an object",
                      f"{at}.function.arguments", "invalid_value") from None
        if not isinstance(arguments, dict):
            raise bad(f"{at}.function.arguments must be an object", f"{at}.function.arguments",
                      "invalid_value")
        out = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


@dataclass
class ToolPlan:
    """How one chat request with tools is run: the messages and tools the template renders,
    the format replies are parsed in, and the structural tag that holds calls to their
    schemas (JSON text; None when tools are off)."""

    messages: list[dict[str, Any]]
    template_tools: list[dict[str, Any]] | None
    format: str | None  # None: tools are off for this request
    structural_tag: str | None


def plan(template: Any, messages: list[dict[str, Any]], tools: ToolRequest,
         parser: str | None = None) -> ToolPlan:
    """`parser` overrides the format the template implies."""
    native = supports_tools(template)
    fmt = parser or tool_formats.format_for_template(template if native else None)
    if not native and tools.active:
        messages = for_plain_template(messages, tools.tools)
    else:
        messages = for_template(template, messages)
    tag = (json.dumps(tool_formats.call_structural_tag(fmt, tools.allowed(), tools.parallel,
                                                       tools.constrained), ensure_ascii=False)
           if tools.active else None)
    return ToolPlan(messages, tools.template_tools() if native and tools.active else None,
                    fmt if tools.active else None, tag)


def for_template(template: Any, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation (tool turns included) as `template` can render it."""
    if supports_tools(template) or not any(m["role"] == "tool" or m.get("tool_calls")
                                           for m in messages):
        return messages
    return for_plain_template(messages, [])


def supports_tools(template: Any) -> bool:
    """Does the chat template render `tools` (and tool turns) itself?"""
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in t and "tool_calls" in t for t in texts if isinstance(t, str))


def for_plain_template(messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: the tools described in the system
    message, calls and results written as text in the hermes format."""
    out: list[dict[str, Any]] = []
    prompt = tool_formats.system_prompt(tools) if tools else None
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f'<tool_call>\n{json.dumps(c["function"], ensure_ascii=False)}\n'
                      f"</tool_call>" for c in m["tool_calls"]]
            content = "\n".join(([m["content"]] if m["content"] else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if prompt is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
