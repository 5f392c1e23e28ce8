"""What the server logs as it serves: one access line per HTTP request, and a periodic line
of engine statistics while there is work (the lines vLLM and SGLang users read).

    radixlm.access: POST /generate 200 0.412s prompt=12 completion=16 rid=3f2a... program=7c1e...
    radixlm.access: POST /v1/chat/completions 400 0.002s error="messages[0].content is ..."
    radixlm.server: engine: 3 running, 0 waiting, KV 12% used, 41.5 generated tok/s, ...

The routes do not pass token counts around for this: each `HttpGeneration` registers itself with
the request being handled (a context variable the middleware sets), and the access line sums
what they produced once the response, streamed or not, has been sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

log = logging.getLogger("radixlm.access")
stats_log = logging.getLogger("radixlm.server")

_REQUEST: contextvars.ContextVar["RequestLog | None"] = contextvars.ContextVar(
    "radixlm_request_log", default=None)


class RequestLog:
    """The generations and the error of the HTTP request being handled."""

    def __init__(self) -> None:
        self.generations: list[Any] = []
        self.error: str | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> "RequestLog":
        self._token = _REQUEST.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _REQUEST.reset(self._token)

    def line(self, method: str, path: str, status: int, seconds: float) -> str:
        parts = [f"{method} {path} {status} {seconds:.3f}s"]
        if self.generations:
            firsts = [s for g in self.generations for s in g.samples if s.index == 0]
            prompt = sum(s.prompt_tokens for s in firsts)
            completion = sum(s.completion_tokens or len(s.token_ids)  # (an unfinished one)
                             for g in self.generations for s in g.samples)
            keys = [k for g in self.generations for k in g.keys]
            rid = keys[0] + (f" (+{len(keys) - 1})" if len(keys) > 1 else "")
            parts.append(f"prompt={prompt} completion={completion} rid={rid}")
            program = self.generations[0].tags.get("program_id")
            if program is not None:
                parts.append(f"program={program}")
        if self.error is not None:
            parts.append(f"error={self.error[:300]!r}")
        return " ".join(parts)


def current() -> RequestLog | None:
    """The log of the HTTP request being handled here, if any."""
    return _REQUEST.get()


async def log_engine_stats(state: Any, interval: float) -> None:
    """Every `interval` seconds while the engine has or had work: queue, KV use, token rates."""
    last: dict[str, Any] | None = None
    last_time = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        if not state.engine.alive:
            return
        try:
            stats = await asyncio.wait_for(state.engine.call("stats"), interval)
        except Exception:  # a busy or dying engine: the next round will tell
            continue
        now = time.monotonic()
        if last is not None and (stats.get("num_running") or stats.get("num_waiting")
                                 or stats.get("steps") != last.get("steps")):
            span = max(now - last_time, 1e-9)
            total = stats.get("kv_pages_total", 0) or 1
            used = total - stats.get("kv_pages_free", 0) - stats.get("kv_pages_evictable", 0)
            stats_log.info(
                "engine: %d running, %d waiting, %d in flight, KV %.0f%% used, "
                "%.1f generated tok/s, %.1f prompt tok/s computed", stats.get("num_running", 0),
                stats.get("num_waiting", 0), state.engine.in_flight, 100 * used / total,
                (stats.get("generated_tokens", 0) - last.get("generated_tokens", 0)) / span,
                (stats.get("prefill_tokens_computed", 0)
                 - last.get("prefill_tokens_computed", 0)) / span)
        last, last_time = stats, now
