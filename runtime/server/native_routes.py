"""Native routes: /generate (SGLang's shape), the program-language routes (pin/release a prefix,
score continuations, render a chat template) and the admin routes (abort, flush, info)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from radixlm.runtime.engine_process.client import EngineCallError
from radixlm.runtime.protocol.fields import ApiError, Fields, bad
from radixlm.runtime.protocol.sampling_fields import check_prompt_len, fit_context
from radixlm.runtime.protocol.tool_requests import for_template
from radixlm.runtime.server import native_requests as native
from radixlm.runtime.server.generation import HttpGeneration, abort_error, check_samples
from radixlm.runtime.server.metrics import cache_hit_rate
from radixlm.runtime.server.openai_requests import parse_messages
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.web_util import json_response, read_json, state_of, stream_events

STATS_TIMEOUT = 10.0  # seconds /get_server_info waits for the engine's statistics


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/pin_prefix", pin_prefix)
    app.router.add_post("/release_prefix", release_prefix)
    app.router.add_post("/release_program", release_program)
    app.router.add_post("/score", score)
    app.router.add_post("/apply_chat_template", apply_chat_template)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    # SGLang's newer names for the same routes, and its fork-join route.
    app.router.add_get("/model_info", get_model_info)
    app.router.add_get("/server_info", get_server_info)
    app.router.add_post("/concate_and_append_request", concate_and_append_request)


async def call_engine(state: ServerState, method: str, *, counted: tuple[str, int] | None = None,
                      **kwargs: Any) -> Any:
    """An Engine method run in the engine process; `counted`: (key, n) for a call that runs n
    engine requests (see EngineClient.call_counted)."""
    try:
        if counted is not None:
            return await state.engine.call_counted(*counted, method, **kwargs)
        return await state.engine.call(method, **kwargs)
    except EngineCallError as exc:
        raise ApiError(exc.status, exc.message,
                       code="invalid_value" if exc.status == 400 else "engine_error") from None


# -- generation --------------------------------------------------------------------------------

async def generate(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    gen, req = await prepare_generation(state, await read_json(request),
                                        request.headers.get(native.PROGRAM_HEADER))
    if req.stream:
        return await stream_events(request, generation_events(state, gen, req))
    results = await generation_results(state, gen, req)
    return json_response(results if req.batch or len(results) > 1 else results[0])


async def generation_results(state: ServerState, gen: HttpGeneration,
                             req: native.GenerateRequest) -> list[dict[str, Any]]:
    """/generate's answer without a stream: every sample, finished."""
    async with gen:
        await gen.run()
    failure = gen.failure()
    if failure is not None:
        raise failure
    texts = await _logprob_texts(state, gen, req)
    latency = time.monotonic() - gen.arrival
    return [native.result(s, req, texts, latency) for s in gen.samples]


async def prepare_generation(state: ServerState, body: Any, program_header: str | None = None
                             ) -> tuple[HttpGeneration, native.GenerateRequest]:
    """A /generate body parsed, tokenized and fit to the context, ready to start."""
    info = state.require_engine()
    req = native.parse_generate(body, info.vocab_size, program_header, state.adapters)
    if req.texts is not None:
        req.input_ids = [await state.codec.encode_prompt(t, "text") for t in req.texts]
    assert req.input_ids is not None
    prompt_param = "text" if req.texts is not None else "input_ids"
    req.params = [fit_context(p, len(ids), info.max_model_len, explicit, prompt_param,
                              "sampling_params.max_new_tokens",
                              "sampling_params.min_new_tokens")
                  for p, ids, explicit in zip(req.params, req.input_ids, req.explicit_max)]
    return HttpGeneration(state, req.input_ids, req.params, req.keys, req.cache_salt,
                          tags=req.tags, loras=req.loras), req


async def generation_events(state: ServerState, gen: HttpGeneration,
                            req: native.GenerateRequest) -> AsyncIterator[dict[str, Any]]:
    """/generate's stream events: each holds the sample's whole text so far and the logprobs
    new since the last."""
    flat = {id(s): i for i, s in enumerate(gen.samples)}
    sent = dict.fromkeys(flat, 0)  # output logprobs already streamed, per sample
    prompt_sent: set[int] = set()  # samples whose prompt logprobs went out
    async with gen:
        async for sample, chunk in gen.chunks():
            if chunk.finish_reason == "abort" and chunk.error:
                raise abort_error(chunk.error, chunk.error_invalid)
            if not (chunk.token_ids or chunk.finished):
                continue
            texts = await _logprob_texts(state, gen, req)
            # SGLang's shape: each event holds the sample's whole text and ids so far, and
            # the logprobs of the tokens new since the last event.
            event = native.result(sample, req, texts, logprobs_from=sent[id(sample)],
                                  prompt_logprobs=id(sample) not in prompt_sent)
            sent[id(sample)] = len(sample.logprobs)
            if sample.prompt_logprobs is not None:
                prompt_sent.add(id(sample))
            event["index"] = flat[id(sample)]
            yield event


async def _logprob_texts(state: ServerState, gen: HttpGeneration,
                         req: native.GenerateRequest) -> dict[int, str]:
    if not (req.return_logprob and req.text_in_logprobs):
        return {}
    ids = sorted(native.logprob_token_ids(gen.samples))
    return dict(zip(ids, await state.codec.token_texts(ids)))


async def abort_request(request: web.Request) -> web.Response:
    state = state_of(request)
    f = Fields(await read_json(request))
    f.only(("rid",))
    rid = f.string("rid", required=True)
    count = state.engine.abort_matching(rid)
    return json_response({"rid": rid, "aborted": count > 0})


async def concate_and_append_request(request: web.Request) -> web.Response:
    """SGLang's join(mode="concate_and_append"): splice the forked branches' KV after the
    destination's. We recompute instead, exactly: the destination's next request carries the
    joined text, and the radix cache serves its prefix up to the fork point."""
    state = state_of(request)
    state.require_engine()
    f = Fields(await read_json(request))
    f.only(("src_rids", "dst_rid"))
    sources = f.get("src_rids", (list,), required=True, what="an array of request ids")
    if not all(isinstance(rid, str) and rid for rid in sources):
        raise bad("src_rids must hold non-empty strings", "src_rids", "invalid_type")
    destination = f.string("dst_rid", required=True)
    return json_response({"success": True, "dst_rid": destination, "spliced": False})


async def flush_cache(request: web.Request) -> web.Response:
    state = state_of(request)
    state.require_engine()
    try:
        await state.engine.call("flush_cache")
    except EngineCallError as exc:
        if exc.status == 400:  # requests are running: the cache cannot be dropped now
            raise ApiError(409, exc.message, code="engine_busy") from None
        raise ApiError(exc.status, exc.message, code="engine_error") from None
    return json_response({"flushed": True})


# -- program-language routes ------------------------------------------------------------------

async def pin_prefix(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.require_engine()
    text, ids, cache_salt, ttl, lora = native.parse_pin(await read_json(request),
                                                        info.vocab_size, state.adapters)
    if text is not None:
        ids = await state.codec.encode_prompt(text, "text")
    assert ids is not None
    check_prompt_len(len(ids), info.max_model_len, "text" if text is not None else "input_ids")
    pin = asyncio.ensure_future(call_engine(state, "pin_prefix", input_ids=ids,
                                            cache_salt=cache_salt, ttl=ttl, lora=lora))
    try:
        lease_id = await asyncio.shield(pin)
    except asyncio.CancelledError:
        # The client left while the prefix was computed: nobody will ever release the lease
        # it gets, so release it as soon as it exists instead of holding pages until the TTL.
        pin.add_done_callback(lambda done: _release_orphan(state, done))
        raise
    return json_response({"lease_id": lease_id})


def _release_orphan(state: ServerState, pin: asyncio.Future) -> None:
    if not pin.cancelled() and pin.exception() is None and pin.result() is not None:
        asyncio.ensure_future(_release_quietly(state, pin.result()))


async def _release_quietly(state: ServerState, lease_id: str) -> None:
    try:
        await state.engine.call("release_prefix", lease_id=lease_id)
    except Exception:  # the engine is gone or the lease expired: nothing left to free
        pass


async def release_prefix(request: web.Request) -> web.Response:
    state = state_of(request)
    state.require_engine()
    f = Fields(await read_json(request))
    f.only(("lease_id",))
    lease_id = f.string("lease_id", required=True)
    return json_response({"released": bool(await call_engine(state, "release_prefix",
                                                             lease_id=lease_id))})


async def release_program(request: web.Request) -> web.Response:
    """A program ended: drop the pin that kept its context warm between its calls."""
    state = state_of(request)
    state.require_engine()
    f = Fields(await read_json(request))
    f.only(("program_id",))
    program_id = native.parse_tags(f)["program_id"]
    if program_id is None:
        raise bad("program_id is required", "program_id")
    return json_response({"released": bool(await call_engine(state, "release_program",
                                                             program_id=program_id))})


async def score(request: web.Request) -> web.Response:
    return json_response({"logprobs": await score_logprobs(
        state_of(request), await read_json(request),
        request.headers.get(native.PROGRAM_HEADER))})


async def score_logprobs(state: ServerState, body: Any, program_header: str | None = None
                         ) -> list[list[float]]:
    """A /score body's answer: the logprobs of each continuation's tokens."""
    info = state.require_engine()
    spec = native.parse_score(body, info.vocab_size, program_header, state.adapters)
    param = "continuations" if spec["continuations"] is not None else "continuation_ids"
    count = len(spec["continuations"] or spec["continuation_ids"])
    # One engine request per continuation: bounded and queued like generation's samples.
    check_samples(state, count, f"{count} continuations", param)
    state.check_room(count)
    prefix_ids = spec["prefix_ids"]
    if prefix_ids is None:
        prefix_ids = await state.codec.encode_prompt(spec["prefix"], "prefix")
    continuation_ids = spec["continuation_ids"]
    if continuation_ids is None:
        continuation_ids = []
        for i, text in enumerate(spec["continuations"]):
            ids = await state.codec.encode_plain(text, f"continuations[{i}]")
            if not ids:
                raise bad(f"continuations[{i}] is empty after tokenization",
                          f"continuations[{i}]")
            continuation_ids.append(ids)
    longest = len(prefix_ids) + max(len(c) for c in continuation_ids)
    check_prompt_len(longest, info.max_model_len, "continuations")
    # Counted in flight, and aborted in the engine if the client leaves.
    return await call_engine(state, "score", counted=(f"score-{uuid.uuid4().hex}", count),
                             prefix_ids=prefix_ids, continuation_ids=continuation_ids,
                             cache_salt=spec["cache_salt"], program_id=spec["program_id"],
                             priority=spec["priority"], lora=spec["lora"])


async def apply_chat_template(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request)
    f = Fields(body)
    f.only(("messages", "add_generation_prompt"))
    messages = for_template(state.codec.chat_template, parse_messages(body.get("messages")))
    add = f.boolean("add_generation_prompt", True)
    return json_response({"text": await state.codec.render_chat(messages, add)})


# -- info --------------------------------------------------------------------------------------

async def get_model_info(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.require_engine()
    tok = state.codec.tokenizer
    return json_response({
        "model_path": state.model_path or state.model_name,
        "tokenizer_path": state.model_path or state.model_name,  # the model's own
        "served_model_name": state.model_name,
        "architecture": info.architecture,
        "vocab_size": info.vocab_size,
        "max_model_len": info.max_model_len,
        "has_chat_template": state.codec.has_chat_template,
        "bos_token": getattr(tok, "bos_token", None),
        "bos_token_id": getattr(tok, "bos_token_id", None),
        "eos_token": getattr(tok, "eos_token", None),
        "eos_token_ids": info.eos_token_ids,
        "is_generation": True,
        "supports_segments": True,  # /generate_program
    })


async def get_server_info(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.require_engine()
    try:  # a busy engine answers between two steps; a stalled one never does
        stats = await asyncio.wait_for(call_engine(state, "stats"), STATS_TIMEOUT)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the engine did not answer within {STATS_TIMEOUT:g} s",
                       code="engine_unresponsive") from None
    total = stats.get("kv_pages_total", 0)
    server = {k: v for k, v in vars(state.config).items() if k != "api_key"}
    server["api_key_set"] = state.config.api_key is not None
    return json_response({
        # The engine loads the folder the model resolved to; report what the user asked for
        # (never where it lives on this machine).
        "engine_config": {**info.config, "model": state.model_path},
        "server_config": server,
        "stats": stats,
        "kv_usage": (total - stats.get("kv_pages_free", 0)) / total if total else 0.0,
        "cache_hit_rate": cache_hit_rate(stats),
        "queue": {"num_running": stats.get("num_running", 0),
                  "num_waiting": stats.get("num_waiting", 0),
                  "in_flight": state.engine.in_flight,
                  "max_in_flight": state.max_in_flight},
        "uptime_s": time.time() - state.started_at,
    })
