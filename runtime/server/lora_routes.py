"""Loading and unloading LoRA adapters while serving: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, also under SGLang's `/load_lora_adapter` and `/unload_lora_adapter`.

Both take `lora_name` (and, to load, `lora_path`: a PEFT adapter folder or a GGUF adapter
file on the server's machine). They are refused with 403 unless the server was started with
--allow-runtime-lora-loading, and like every route but /health they need the API key when the
server has one. A loaded adapter is served at once: `model` on the OpenAI routes, `lora_path`
on /generate.
"""

from __future__ import annotations

from aiohttp import web

from radixlm.runtime.engine_process.client import EngineCallError
from radixlm.runtime.protocol.fields import ApiError, Fields
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.web_util import json_response, read_json, state_of


def add_routes(app: web.Application) -> None:
    for prefix in ("/v1", ""):
        app.router.add_post(f"{prefix}/load_lora_adapter", load_lora_adapter)
        app.router.add_post(f"{prefix}/unload_lora_adapter", unload_lora_adapter)


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = _allowed(state_of(request))
    f = Fields(await read_json(request))
    f.only(("lora_name", "lora_path", "load_inplace", "pinned"))
    name = f.string("lora_name", required=True)
    path = f.string("lora_path", required=True)
    await _call(state, "load_lora", name=name, path=path)
    state.adapters[name] = {"name": name, "path": path}
    return json_response({"success": True, "message": f"LoRA adapter {name!r} loaded",
                          "loaded_adapters": sorted(state.adapters)})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = _allowed(state_of(request))
    f = Fields(await read_json(request))
    f.only(("lora_name", "lora_int_id"))
    name = f.string("lora_name", required=True)
    await _call(state, "unload_lora", name=name)
    state.adapters.pop(name, None)
    return json_response({"success": True, "message": f"LoRA adapter {name!r} unloaded",
                          "loaded_adapters": sorted(state.adapters)})


def _allowed(state: ServerState) -> ServerState:
    info = state.require_engine()
    if not info.config.get("allow_runtime_lora_loading"):
        raise ApiError(403, "loading and unloading LoRA adapters while serving is off; start "
                            "the server with --allow-runtime-lora-loading", code="forbidden")
    return state


async def _call(state: ServerState, method: str, **kwargs: str) -> None:
    try:
        await state.engine.call(method, **kwargs)
    except EngineCallError as exc:
        if exc.status != 400:
            raise ApiError(exc.status, exc.message, code="engine_error") from None
        # The engine's messages start with the field at fault; an adapter that cannot be read
        # or served is its path's fault.
        name_at_fault = method == "unload_lora" or exc.message.startswith("lora_name")
        raise ApiError(400, exc.message, "lora_name" if name_at_fault else "lora_path",
                       "invalid_lora") from None
