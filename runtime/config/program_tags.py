"""What a request may say about where it comes from: the program it belongs to (an agent, a
script of calls: the per-program statistics key) and its priority (admission order, lower
first, as vLLM's `priority`). Checked the same way by the engine and the server."""

from __future__ import annotations

from typing import Any

MAX_PROGRAM_ID_CHARS = 128
MAX_PRIORITY = 2**31 - 1


def check_program_id(program_id: Any) -> str | None:
    if program_id is not None and (not isinstance(program_id, str) or not program_id
                                   or len(program_id) > MAX_PROGRAM_ID_CHARS):
        raise ValueError(f"program_id must be a string of 1 to {MAX_PROGRAM_ID_CHARS} "
                         f"characters, got {program_id!r:.60}")
    return program_id


def check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be an int in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got "
                         f"{priority!r:.60}")
    return priority
