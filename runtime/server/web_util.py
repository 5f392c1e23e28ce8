"""aiohttp plumbing shared by the routes: the state key, JSON bodies in and out, SSE streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from radixlm.runtime.protocol.fields import ApiError, parse_json
from radixlm.runtime.server.state import ServerState

log = logging.getLogger("radixlm.server")

STATE = web.AppKey("radixlm_state", ServerState)

# Bodies larger than this are parsed on a worker thread, so the loop keeps serving meanwhile.
_PARSE_INLINE_BYTES = 256 << 10


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]


async def read_json(request: web.Request) -> dict[str, Any]:
    limit = state_of(request).config.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    timeout = state_of(request).config.body_timeout or None
    try:
        # aiohttp stops reading at client_max_size (= limit).
        raw = await asyncio.wait_for(request.read(), timeout)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    if len(raw) <= _PARSE_INLINE_BYTES:
        return parse_json(raw)
    return await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {limit} "
                         f"bytes", code="request_too_large")


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(text=dumps(payload), status=status, content_type="application/json")


def error_response(error: ApiError) -> web.Response:
    response = json_response(error.body(), error.status)
    response.headers.update(error.headers)
    return response


async def stream_events(request: web.Request, events: AsyncIterator[dict[str, Any]],
                        named: bool = False,
                        error_event: Callable[[ApiError], dict[str, Any]] | None = None
                        ) -> web.StreamResponse:
    """Send each event as an SSE `data:` line (`named`: after an `event:` line naming its
    `type`, as the Responses API does), then `data: [DONE]`.

    Errors after the response has started cannot change its status: they are sent as an
    OpenAI-shaped error event (or `error_event`'s) before [DONE]. A client that goes away ends
    the stream quietly; closing `events` then aborts its requests in the engine (the
    generator's cleanup)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    async with contextlib.aclosing(events) as events:
        try:
            # Pull the first event before sending headers: input errors found when the
            # request starts (e.g. the engine refusing it) are then still a plain 4xx.
            first = await anext(events, None)
        except ApiError as exc:
            return error_response(exc)
        try:
            await response.prepare(request)
            if first is not None:
                await _send(response, first, named)
                async for event in events:
                    await _send(response, event, named)
        except ConnectionResetError:
            log.debug("client went away mid-stream")
            return response
        except Exception as exc:
            error = exc if isinstance(exc, ApiError) else ApiError(500, f"internal error: {exc}")
            if not isinstance(exc, ApiError):
                log.exception("stream failed")
            with contextlib.suppress(ConnectionResetError):
                await _send(response, error_event(error) if error_event else error.body(),
                            named)
    with contextlib.suppress(ConnectionResetError):
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    return response


async def _send(response: web.StreamResponse, event: dict[str, Any], named: bool) -> None:
    head = f"event: {event['type']}\n".encode() if named and "type" in event else b""
    await response.write(head + b"data: " + dumps(event).encode() + b"\n\n")
