"""A streamed chat reply split into content deltas and tool-call deltas, as OpenAI streams them:
each call opens with its index, id and name, then its `arguments` text follows in fragments as
the model writes it (the SDK's stream helpers join them).

Content is passed on until a call may be starting (text that could begin the format's trigger
is held back). From the trigger on, each call is read as it comes: `{"name": ..., "arguments":`
opens it, and the arguments object is passed on up to where it is written so far. Anything else
there (text between calls, a call in another shape) stops the streaming of calls: the rest is
held until the reply ends and parsed whole (tool_formats.parse), which is authoritative.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from radixlm.runtime.protocol.tool_formats import TRIGGERS, new_call_id, parse

# What may stand between calls, in any format: their wrappers and separators.
_BETWEEN = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "[", "]", ",",
            ";")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_WAIT = "wait"  # not known yet: more text is needed


@dataclass
class _Call:
    index: int
    name: str
    arguments: str = ""
    complete: bool = False


class StreamingToolParser:
    def __init__(self, fmt: str, tool_names: Sequence[str]) -> None:
        self.fmt = fmt
        self.names = list(tool_names)
        self.trigger = TRIGGERS[fmt]
        self.sent = ""  # content passed on so far
        self.held = ""  # content not passed on yet
        self.in_calls = False
        self.calls_text = ""  # the reply from the first call on
        self.pos = 0  # how far calls_text has been read
        self.state = "between"  # "between" | "arguments" | "close" | "hold"
        self.calls: list[_Call] = []  # the calls streamed so far
        self._depth = 0  # the arguments object's nesting, in state "arguments"
        self._in_string = False
        self._escaped = False

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool-call deltas that can be passed on now."""
        if self.in_calls:
            self.calls_text += delta
            return "", self._read()
        self.held += delta
        content = self._content()
        if self.in_calls:
            self.calls_text, self.held = self.held, ""
            return content, self._read()
        return content, []

    def finish(self, cut: bool = False) -> tuple[str, list[dict[str, Any]], int]:
        """At the end of the reply: the rest of the content, the last call deltas, and how many
        calls the reply made. `cut`: the token budget ended it (a call it cut short is not
        completed here; the finish reason says why)."""
        if not self.in_calls:
            rest, self.held = self.held, ""
            self.sent += rest
            return rest, [], 0
        deltas = self._read()
        content, calls = parse(self.fmt, self.calls_text, self.names, cut)
        if not calls and not self.calls:
            return content, deltas, 0  # no call after all: the text is content
        for call in calls[len(self.calls):]:  # those not streamed: whole
            index = len(self.calls)
            self.calls.append(_Call(index, call.name, call.arguments, True))
            deltas.append(call.openai(index))
        return (content if calls else ""), deltas, len(self.calls)

    # -- content ----------------------------------------------------------------------------

    def _content(self) -> str:
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

    def _release(self, n: int) -> str:
        out, self.held = self.held[:n], self.held[n:]
        self.sent += out
        return out

    # -- calls ------------------------------------------------------------------------------

    def _read(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self.state != "hold":
            text, i = self.calls_text, self.pos
            if self.state == "between":
                i = _skip_space(text, i)
                word = next((w for w in _BETWEEN if text.startswith(w, i)), None)
                if word is not None:
                    self.pos = i + len(word)
                    continue
                if i == len(text) or any(w.startswith(text[i:]) for w in _BETWEEN):
                    self.pos = i
                    return deltas
                head = _call_head(text, i)
                if head == _WAIT:
                    return deltas
                if head is None or head[0] not in self.names:
                    self.state = "hold"
                    return deltas
                name, self.pos = head
                call = _Call(len(self.calls), name)
                self.calls.append(call)
                deltas.append({"index": call.index, "id": new_call_id(self.fmt),
                               "type": "function", "function": {"name": name, "arguments": ""}})
                self.state, self._depth, self._in_string = "arguments", 0, False
            elif self.state == "arguments":
                end, done = self._scan_arguments()
                call = self.calls[-1]
                fragment = text[self.pos:end]
                if fragment:
                    call.arguments += fragment
                    deltas.append({"index": call.index, "function": {"arguments": fragment}})
                self.pos = end
                if not done:
                    return deltas
                self.state = "close"
            else:  # "close": the call object's own closing brace
                i = _skip_space(text, i)
                if i == len(text):
                    return deltas
                if text[i] != "}":
                    self.state = "hold"
                    return deltas
                self.calls[-1].complete = True
                self.pos, self.state = i + 1, "between"
        return deltas

    def _scan_arguments(self) -> tuple[int, bool]:
        """Read the arguments object on from `pos`: (where it is written up to, whether it
        is complete)."""
        text = self.calls_text
        i = self.pos
        for j in range(i, len(text)):  # (the call's head saw the object begin)
            ch = text[j]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return j + 1, True
        return len(text), False


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _call_head(text: str, i: int) -> tuple[str, int] | str | None:
    """`{"name": "...", "arguments": {` (or "parameters") at `i`: (the name, where the
    arguments object begins); _WAIT if the text so far may still become one; None if it
    cannot."""
    name = None
    for expect in ("{", '"name"', ":", None, ",", ('"arguments"', '"parameters"'), ":"):
        i = _skip_space(text, i)
        if i == len(text):
            return _WAIT
        if expect is None:  # the name, a JSON string
            match = _STRING.match(text, i)
            if match is None:
                return _WAIT if re.fullmatch(r'"(?:[^"\\]|\\.)*\\?', text[i:]) else None
            name = json.loads(match.group(0))
            i = match.end()
            continue
        options = expect if isinstance(expect, tuple) else (expect,)
        word = next((w for w in options if text.startswith(w, i)), None)
        if word is None:
            return _WAIT if any(w.startswith(text[i:]) for w in options) else None
        i += len(word)
    i = _skip_space(text, i)
    if i == len(text):
        return _WAIT
    if text[i] != "{":  # arguments that are not an object: not a call to stream
        return None
    assert name is not None
    return name, i


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text a stream
    holds back, since the next piece may complete the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
