"""OpenAI's Responses API request (`POST /v1/responses`) read as the chat request it amounts
to: `instructions` and `input` items become chat messages (function calls and their outputs
as tool turns), function tools and `tool_choice` take the chat shapes, `text.format` becomes
`response_format`, `max_output_tokens` the token budget. The chat parser then checks
everything as it does for /v1/chat/completions; its errors are renamed back to the fields
this request used (`rename`).

Fields that would change the output and are not implemented (tools other than functions,
`background`, `truncation: auto`, `conversation`, stored prompts, image and file inputs) are
a 400 naming them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.protocol.fields import ApiError, Fields, bad

# Passed on to the chat request as they are.
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "store", "metadata",
         "user", "service_tier", "prompt_cache_key", "safety_identifier",
         # our extensions (and SGLang's and vLLM's), as on the chat route
         "top_k", "min_p", "repetition_penalty", "seed", "cache_salt", "program_id",
         "priority", "chat_template_kwargs")
FIELDS = (*_SAME, "input", "instructions", "tools", "tool_choice", "text", "reasoning",
          "max_output_tokens", "previous_response_id", "include", "top_logprobs",
          "truncation", "background", "max_tool_calls", "stream_options", "conversation",
          "prompt")
# `include` values: logprobs of the output text; encrypted reasoning (agents that keep no
# state ask for it; reasoning here is plain text, returned whole, so there is nothing to add).
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


@dataclass
class ResponsesRequest:
    chat: dict[str, Any]  # the equivalent /v1/chat/completions body, but for the messages
    previous_response_id: str | None
    store: bool
    instructions: str | None
    stream: bool
    echo: dict[str, Any]  # request fields the response object repeats
    input_messages: list[dict[str, Any]] = field(default_factory=list)  # `input` as chat
    input_origins: list[str] = field(default_factory=list)  # the item each came from
    origins: list[str] = field(default_factory=list)  # each chat message's (chat_body's)

    def chat_body(self, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request: `instructions` first (a system message), then the conversation
        so far (`earlier`: a previous response's, without its instructions, as OpenAI does),
        then `input`; `origins` now says where each of its messages came from."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        self.origins = (["instructions"] * len(head) + ["previous_response_id"] * len(earlier)
                        + self.input_origins)
        return {**self.chat, "messages": [*head, *earlier, *self.input_messages]}

    def rename(self, error: ApiError) -> ApiError:
        """A chat parser's error in this request's terms."""
        def name(text: str) -> str:
            def message(match: re.Match) -> str:
                k = int(match.group(1))
                return self.origins[k] if 0 <= k < len(self.origins) else "input"
            text = re.sub(r"messages\[(\d+)\]", message, text)
            text = re.sub(r"\btools\[(\d+)\]\.function\.", r"tools[\1].", text)
            text = re.sub(r"\bresponse_format(\.json_schema)?", "text.format", text)
            text = re.sub(r"\bmax_completion_tokens\b", "max_output_tokens", text)
            text = re.sub(r"\btool_choice\.function\.name\b", "tool_choice.name", text)
            return re.sub(r"\breasoning_effort\b", "reasoning.effort", text)
        return ApiError(error.status, name(error.message),
                        name(error.param) if error.param else None, error.code, error.headers)


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    f = Fields(body)
    f.only(FIELDS)
    for name, why in (("background", "background responses"),
                      ("conversation", "conversations (use previous_response_id)"),
                      ("prompt", "stored prompts"), ("max_tool_calls", "max_tool_calls")):
        if body.get(name) not in (None, False):
            raise bad(f"{name}: {why} are not supported", name, "not_supported")
    truncation = f.string("truncation")
    if truncation not in (None, "disabled"):
        raise bad("truncation: only 'disabled' is supported (a conversation too long for the "
                  "context is a 400)", "truncation", "not_supported")
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    include = f.get("include", (list,)) or []
    unknown = [i for i in include if i not in INCLUDES]
    if unknown:
        raise bad(f"include: {unknown[0]!r} is not supported (supported: "
                  f"{', '.join(INCLUDES)})", "include", "not_supported")
    top = f.integer("top_logprobs", lo=0)
    if "message.output_text.logprobs" in include or top:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top
    if f.has("max_output_tokens"):
        chat["max_completion_tokens"] = body["max_output_tokens"]
    instructions = f.string("instructions")
    messages, origins = [], []
    for message, origin in _input_messages(body.get("input")):
        messages.append(message)
        origins.append(origin)
    if f.has("tools"):
        chat["tools"] = _tools(f.get("tools", (list,)))
    if f.has("tool_choice"):
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = f.object("text")
    if text is not None:
        t = Fields(text, "text.")
        t.only(("format", "verbosity"))
        verbosity = t.string("verbosity")  # a hint to OpenAI's models; the prompt steers ours
        if verbosity not in (None, "low", "medium", "high"):
            raise bad("text.verbosity must be low, medium or high", "text.verbosity")
        fmt = t.object("format")
        if fmt is not None:
            chat["response_format"] = _text_format(fmt)
    reasoning = f.object("reasoning")
    if reasoning is not None:
        r = Fields(reasoning, "reasoning.")
        r.only(("effort", "summary", "generate_summary"))
        for name in ("summary", "generate_summary"):  # the thinking is returned whole
            if r.string(name) not in (None, "auto", "concise", "detailed"):
                raise bad(f"reasoning.{name} must be auto, concise or detailed",
                          f"reasoning.{name}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = r.string("effort")
    options = f.object("stream_options")
    if options is not None:
        Fields(options, "stream_options.").only(("include_obfuscation",))
        Fields(options, "stream_options.").boolean("include_obfuscation")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "text": text or {"format": {"type": "text"}}, "reasoning": reasoning or {},
            "truncation": "disabled", "user": body.get("user")}
    return ResponsesRequest(chat, f.string("previous_response_id"),
                            f.boolean("store", True), instructions, f.boolean("stream", False),
                            echo, messages, origins)


def _input_messages(value: Any) -> list[tuple[dict[str, Any], str]]:
    """`input` as chat messages, each with the field it came from."""
    if isinstance(value, str):
        return [({"role": "user", "content": value}, "input")]
    if not isinstance(value, list):
        raise bad("input must be a string or an array of items", "input",
                  "invalid_type" if value is not None else "missing_field")
    out: list[tuple[dict[str, Any], str]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{where}.role must be user, system, developer or assistant, got "
                          f"{role!r}", f"{where}.role")
            out.append(({"role": role, "content": _text(item.get("content"), where)}, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = out[-1][0] if out else None
            if last is not None and last["role"] == "assistant":  # one turn: text, then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append(({"role": "assistant", "content": None, "tool_calls": [call]},
                            where))
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where, "output")
            out.append(({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": content}, where))
        elif kind == "reasoning":
            continue  # earlier thinking: chat templates leave it out of the next turn
        else:
            raise bad(f"{where}.type {kind!r} is not supported (message, function_call, "
                      "function_call_output and reasoning are)", f"{where}.type",
                      "not_supported")
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{where}.{key} must be a string", f"{where}.{key}", "invalid_type")
    return value


def _text(content: Any, where: str, key: str = "content") -> str:
    """A message's content: a string or text parts (images and files are not supported)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.{key} must be a string or an array of text parts",
                  f"{where}.{key}", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{key}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad(f"{at}: only text parts are supported, got {kind!r}", at,
                      "not_supported")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: list[Any]) -> list[Any]:
    """Function tools in the chat shape ({"type": "function", "function": {...}})."""
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}] must be an object", f"tools[{i}]", "invalid_type")
        if tool.get("type") != "function":
            raise bad(f"tools[{i}].type: only function tools are supported, got "
                      f"{tool.get('type')!r}", f"tools[{i}].type", "not_supported")
        out.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                     if k != "type"}})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _text_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_schema":
        Fields(fmt, "text.format.").only(("type", "name", "schema", "strict", "description"))
        return {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}}
    return fmt
