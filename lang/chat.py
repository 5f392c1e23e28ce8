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

from typing import Callable

ROLES = ("system", "user", "assistant")
_MARK = "\x00radixlm-content\x00"

Render = Callable[[list[dict[str, str]]], "str | None"]


class RoleRenderer:
    def __init__(self, render: Render) -> None:
        self.render = render

    def delimiters(self, history: list[dict[str, str]], role: str) -> tuple[str, str]:
        """(opening, closing) text of a `role` message that follows `history`."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        full = self.render([*history, {"role": role, "content": _MARK}])
        if full is None:
            # No template (e.g. an OpenAI-compatible server, which takes messages): a plain
            # readable form for s.text(); the messages are what such a backend sends.
            return f"{role}: ", "\n"
        before = self.render(history) if history else ""
        if before is None or not full.startswith(before) or _MARK not in full:
            raise ValueError(f"role {role!r}: the chat template does not render messages "
                             f"incrementally; it cannot be used with roles")
        opening, _, closing = full[len(before):].partition(_MARK)
        return opening, closing
