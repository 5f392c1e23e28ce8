"""The responses a server keeps for `previous_response_id` and `GET /v1/responses/{id}`: in
memory, bounded in count and in size (the oldest go first), lost on restart. A response sent
with `store: false` is never kept.

Each entry holds the response object and the conversation that led to it, as chat messages
with the response's own output appended: continuing it renders the same text again, so the
prefix cache serves the whole earlier conversation.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 4096
MAX_CHARS = 256 << 20  # characters of JSON text, responses and conversations together


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the response's output included
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(response)) + len(json.dumps(conversation))
        if chars > self.max_chars:
            return  # larger than the whole store: not kept
        self.delete(response["id"])
        self._entries[response["id"]] = Stored(response, conversation, chars)
        self._chars += chars
        while len(self._entries) > self.max_responses or self._chars > self.max_chars:
            _, oldest = self._entries.popitem(last=False)
            self._chars -= oldest.chars

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)  # continued conversations stay
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.chars
        return True

    def __len__(self) -> int:
        return len(self._entries)
