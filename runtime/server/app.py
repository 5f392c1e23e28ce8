"""The aiohttp application: middlewares (metrics, errors, auth), health and metrics routes,
and the native and OpenAI route tables.

Middlewares, outermost first:
  metrics  counts every response by route and status, errors included;
  errors   ApiError -> its status and OpenAI-shaped body; aiohttp's own HTTP errors (404, 405)
           -> the same shape; any other exception -> 500 with its message. The failure stays
           inside the one request: the loop, the engine and other requests carry on;
  browser  a POST a web page could have sent (cross-origin by its Origin or Sec-Fetch-Site
           header) is 403, and a POST body that is not JSON is 415: a page open in a local
           browser cannot drive a keyless server (forms and `text/plain` need no CORS
           preflight; JSON does, and the server grants none);
  auth     when an API key is set, every route but /health needs `Authorization: Bearer KEY`,
           compared in constant time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.protocol.fields import ApiError
from radixlm.runtime.server import (
    access_log,
    lora_routes,
    native_routes,
    openai_routes,
    program_routes,
    responses_routes,
    tokenize_routes,
)
from radixlm.runtime.server.generation import HttpGeneration
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.web_util import STATE, error_response, json_response, state_of

log = logging.getLogger("radixlm.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/health"})
QUIET_PATHS = frozenset({"/health", "/metrics"})  # polled: their access lines are debug
TRIM_AFTER_BYTES = 256 << 10  # bodies this large are parsed off the loop, into an arena
HEALTH_GENERATE_TIMEOUT = 60.0


def build_app(state: ServerState) -> web.Application:
    app = web.Application(client_max_size=state.config.max_request_bytes,
                          middlewares=[_metrics, _errors, _browser, _auth])
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/metrics", metrics)
    native_routes.add_routes(app)
    openai_routes.add_routes(app)
    responses_routes.add_routes(app)
    program_routes.add_routes(app)
    lora_routes.add_routes(app)
    tokenize_routes.add_routes(app)
    return app


@web.middleware
async def _metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = state_of(request)
    state.active_requests += 1
    status = 500
    start = time.monotonic()
    with access_log.RequestLog() as record:
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            state.active_requests -= 1
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            state.metrics.request(route, status)
            level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
            access_log.log.log(level, "%s", record.line(request.method, request.path, status,
                                                        time.monotonic() - start))
            if request.content_length and request.content_length > TRIM_AFTER_BYTES:
                state.heap.trim_soon()  # its parsed body is garbage now


# OpenAI routes asked for without their /v1 prefix: an SDK whose base_url lacks "/v1".
_OPENAI_PATHS = ("/chat/completions", "/completions", "/models", "/embeddings", "/responses")


def _route_hint(request: web.Request, status: int) -> str:
    if status == 404 and request.path.rstrip("/").startswith(_OPENAI_PATHS):
        return (f"; the OpenAI routes are under /v1 (did you mean /v1{request.path}? an "
                f"OpenAI client's base_url ends in /v1)")
    return ""


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        _note(exc.message)
        return error_response(exc)
    except web.HTTPException as exc:  # the router's 404 and 405, aiohttp's own 413
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status)
        _note(exc.reason)
        return error_response(ApiError(exc.status, f"{request.method} {request.path}: "
                                       f"{exc.reason}{_route_hint(request, exc.status)}",
                                       code=code))
    except ConnectionResetError:  # the client went away while we answered
        raise
    except Exception as exc:
        # Our bug: the traceback goes to the log, the client gets an id to find it by.
        incident = uuid.uuid4().hex[:12]
        log.exception("%s %s failed (incident %s)", request.method, request.path, incident)
        _note(f"{type(exc).__name__}: {exc} (incident {incident})")
        return error_response(ApiError(500, f"internal error (incident {incident}; the "
                                            f"server log has the details)",
                                       code="internal_error"))


def _note(reason: str) -> None:
    record = access_log.current()
    if record is not None:
        record.error = reason


@web.middleware
async def _browser(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method == "POST":
        origin = request.headers.get("Origin")
        fetch_site = request.headers.get("Sec-Fetch-Site")
        if fetch_site in ("cross-site", "same-site") or (
                origin is not None and urlsplit(origin).netloc != request.host):
            raise ApiError(403, f"cross-origin POSTs are refused (Origin {origin!r}, "
                                f"Sec-Fetch-Site {fetch_site!r})", code="cross_origin")
        media = request.content_type  # application/octet-stream when the header is absent
        if request.body_exists and not (media == "application/json" or media.endswith("+json")):
            raise ApiError(415, f"a POST body must be JSON, sent as Content-Type: "
                                f"application/json (got {media}; with curl, add -H "
                                f"'Content-Type: application/json')",
                           code="unsupported_media_type")
    return await handler(request)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = state_of(request).config.api_key
    if key is not None and request.path not in OPEN_PATHS:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        # Digests of equal length compared with compare_digest: the time taken reveals
        # neither the key's content nor its length.
        ok = hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(),
                                 hashlib.sha256(key.encode()).digest())
        if not (ok and scheme.lower() == "bearer"):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    """Liveness without touching the engine: answers at once however busy the engine is."""
    state = state_of(request)
    if state.draining:
        status = "shutting_down"
    elif state.info is None:
        status = "starting"
    elif not state.engine.alive:
        status = "engine_stalled" if getattr(state.engine, "stalled", False) else "engine_down"
    else:
        return json_response({"status": "ok"})
    return json_response({"status": status}, 503)


async def health_generate(request: web.Request) -> web.Response:
    """Readiness through the whole path: one token generated by the engine."""
    state = state_of(request)
    state.require_engine()
    bos = getattr(state.codec.tokenizer, "bos_token_id", None)
    prompt = [bos if isinstance(bos, int) else 0]
    gen = HttpGeneration(state, [prompt], [SamplingParams(max_new_tokens=1, temperature=0)],
                         [f"health-{uuid.uuid4().hex}"])
    try:
        async with gen:
            await asyncio.wait_for(gen.run(), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        raise ApiError(503, f"no token generated in {HEALTH_GENERATE_TIMEOUT:.0f} s",
                       code="engine_unresponsive") from None
    if gen.failure() is not None or gen.samples[0].completion_tokens != 1:
        raise ApiError(503, "the engine did not generate a token", code="engine_unhealthy")
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    if state.info is not None and state.engine.alive:
        try:
            stats = await asyncio.wait_for(state.engine.call("stats"), 5.0)
            state.metrics.observe_stats(stats, state.engine.in_flight)
        except Exception:  # stale gauges beat a failed scrape
            log.warning("could not refresh engine gauges", exc_info=True)
    response = web.Response(body=state.metrics.render())
    response.headers["Content-Type"] = state.metrics.content_type
    return response
