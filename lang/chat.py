"""Chat roles rendered through the model's own chat template.

A role's content is only known when the role closes (it may hold `gen`s), but its opening text
must be appended when it opens. Both come from rendering the template with a placeholder as
the content, after the messages that came before it:

    render(history + [{"role": "user", "content": MARK}])
      = render(history) + "<|im_start|>user\n" + MARK + "<|im_end|>\n"
                          └── opening text ──┘        └─ closing text ┘

Rendering with the real history keeps whatever the template does around the first message
(a default system prompt, BOS) and between roles.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

ROLES = ("system", "user", "assistant", "tool")
# Letters and digits only, so a template that JSON-encodes the content (tool results, in some)
# writes it unchanged.
_MARK = "RadixlmContent7f3a9c"

Render = Callable[[list[dict[str, Any]]], Awaitable["str | None"]]


class RoleRenderer:
    def __init__(self, render: Render) -> None:
        self.render = render

    async def body(self, history: list[dict[str, Any]], message: dict[str, Any], opening: str,
             closing: str) -> str | None:
        """The text the template writes for `message` (e.g. an assistant turn that called
        tools) between its opening and its closing; None without a template, or when the
        template opens such a message differently from a plain one."""
        full = await self.render([*history, message])
        if full is None:
            return None
        before = await self.render(history) if history else ""
        text = full[len(before or ""):]
        if not text.startswith(opening):
            return None
        text = text[len(opening):]
        return text[:-len(closing)] if closing and text.endswith(closing) else text

    async def delimiters(self, history: list[dict[str, Any]], role: str,
                   fields: dict[str, Any] | None = None) -> tuple[str, str]:
        """(opening, closing) text of a `role` message (with these other fields, e.g. a tool
        result's tool_call_id) that follows `history`."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        full = await self.render([*history, {"role": role, "content": _MARK, **(fields or {})}])
        if full is None:
            # No template (e.g. an OpenAI-compatible server, which takes messages): a plain
            # readable form for s.text(); the messages are what such a backend sends.
            return f"{role}: ", "\n"
        before = await self.render(history) if history else ""
        if before is None or not full.startswith(before) or _MARK not in full:
            raise ValueError(f"role {role!r}: the chat template does not render messages "
                             f"incrementally; it cannot be used with roles")
        opening, _, closing = full[len(before):].partition(_MARK)
        return opening, closing
