"""Reasoning output: the thinking a model writes between `<think>` and `</think>` is split
from its answer, as `reasoning_content` beside `content` (OpenAI-compatible servers' field).

Parsers (`--reasoning-parser`):
- `qwen3`: thinking only when the reply opens with `<think>` (Qwen3 with thinking on; with it
  off, the template writes an empty block and the reply is all answer).
- `deepseek_r1`: the template opens `<think>` itself, so the reply starts inside the thinking,
  up to `</think>` (a `<think>` the model writes anyway is dropped). A reply cut off before
  `</think>` is all reasoning.
"""

from __future__ import annotations

from radixlm.runtime.protocol.tool_stream import partial_suffix

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning.strip() if stream.thought else None), content


class ReasoningStream:
    """Splits a streamed reply: feed() returns the (reasoning, content) deltas it can pass on;
    text that could be the start of a tag is held back until it can tell."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}")
        self.parser = parser
        # "start": may open with <think>; "thinking": inside; "answer": after (or never).
        self.phase = "start"
        self.thought = False  # the reply had a thinking part
        self.held = ""
        self.trim = False  # drop the newlines between </think> and the answer

    def feed(self, delta: str) -> tuple[str, str]:
        self.held += delta
        reasoning = content = ""
        if self.phase == "start":
            head = self.held.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return reasoning, content  # maybe the tag, maybe not: wait
            if head.startswith(OPEN):  # (a deepseek_r1 model repeating its template's tag)
                self.held = head[len(OPEN):]
                self.phase = "thinking"
            else:
                self.phase = "thinking" if self.parser == "deepseek_r1" else "answer"
            self.thought = self.phase == "thinking"
        if self.phase == "thinking":
            at = self.held.find(CLOSE)
            if at < 0:
                keep = partial_suffix(self.held, CLOSE)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[
                    len(self.held) - keep:]
                return reasoning, content
            reasoning = self.held[:at]
            self.held = self.held[at + len(CLOSE):]
            self.phase, self.trim = "answer", True
        content, self.held = self.held, ""
        if self.trim:
            content = content.lstrip("\n")
            self.trim = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply."""
        held, self.held = self.held, ""
        return (held, "") if self.phase == "thinking" else ("", held)

