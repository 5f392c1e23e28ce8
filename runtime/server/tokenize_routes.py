"""/tokenize and /detokenize (vLLM's routes, which clients use to count and inspect tokens):
a prompt, or a chat rendered by the model's template, to the token ids a generation of it
would run, and token ids back to text.

    POST /tokenize    {"prompt": "...", "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true,
                       "chat_template_kwargs": {...}}
                   -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": [...]}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}
"""

from __future__ import annotations

from aiohttp import web

from radixlm.runtime.protocol.fields import Fields, bad, token_ids
from radixlm.runtime.protocol.tool_requests import for_template
from radixlm.runtime.server.openai_requests import parse_messages, reserved_template_kwargs
from radixlm.runtime.server.web_util import json_response, read_json, state_of

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "chat_template_kwargs", "return_token_strs")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.require_engine()
    body = await read_json(request)
    f = Fields(body)
    f.only(TOKENIZE_FIELDS)
    f.string("model")
    if f.has("prompt") == f.has("messages"):
        raise bad("give either prompt or messages", "prompt" if f.has("prompt") else "messages")
    if f.has("prompt"):
        for name in ("add_generation_prompt", "chat_template_kwargs"):
            if f.has(name):
                raise bad(f"{name} applies to messages", name)
        text = f.string("prompt", required=True)
        special = f.boolean("add_special_tokens", True)
        param = "prompt"
    else:
        if f.has("add_special_tokens"):
            # The rendered chat is tokenized as /v1/chat/completions tokenizes it.
            raise bad("add_special_tokens applies to prompt (a chat is tokenized as "
                      "/v1/chat/completions runs it)", "add_special_tokens")
        kwargs = f.object("chat_template_kwargs") or {}
        reserved = sorted(reserved_template_kwargs() & set(kwargs))
        if reserved:
            raise bad(f"chat_template_kwargs may not set {', '.join(reserved)}",
                      "chat_template_kwargs")
        messages = for_template(state.codec.chat_template, parse_messages(body.get("messages")))
        text = await state.codec.render_chat(messages, f.boolean("add_generation_prompt", True),
                                             template_kwargs=kwargs)
        special, param = True, "messages"
    ids = await state.codec.tokenize(text, special, param)
    strs = await state.codec.token_texts(ids) if f.boolean("return_token_strs", False) else None
    return json_response({"count": len(ids), "max_model_len": info.max_model_len,
                          "tokens": ids, "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.require_engine()
    body = await read_json(request)
    f = Fields(body)
    f.only(("model", "tokens"))
    f.string("model")
    ids = token_ids(body.get("tokens"), "tokens", info.vocab_size)
    return json_response({"prompt": await state.codec.decode(ids, skip_special_tokens=False)})
