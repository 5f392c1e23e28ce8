"""/tokenize and /detokenize (vLLM's routes, which clients use to count and inspect tokens):
a prompt, or a chat rendered by the model's template, to the token ids a generation of it
would run, and token ids back to text.

    POST /tokenize    {"prompt": "...", "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "tools": [...], "add_generation_prompt": true,
                       "chat_template_kwargs": {...}}
                   -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": [...]}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}
"""

from __future__ import annotations

from aiohttp import web

from radixlm.runtime.protocol.fields import Fields, bad, token_ids
from radixlm.runtime.server.openai_requests import parse_chat
from radixlm.runtime.server.openai_routes import prepare_chat
from radixlm.runtime.server.web_util import json_response, read_json, state_of

# The fields a chat brings to its prompt (the rest of a chat request changes only the reply).
CHAT_PROMPT_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs")
TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs", *CHAT_PROMPT_FIELDS)


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
        for name in ("add_generation_prompt", *CHAT_PROMPT_FIELDS[1:]):
            if f.has(name):
                raise bad(f"{name} applies to messages", name)
        ids = await state.codec.tokenize(f.string("prompt", required=True),
                                         f.boolean("add_special_tokens", True), "prompt")
    else:
        if f.has("add_special_tokens"):
            raise bad("add_special_tokens applies to prompt (a chat is tokenized as "
                      "/v1/chat/completions runs it)", "add_special_tokens")
        # The chat route's own path: the same template, tools and checks, so the same ids.
        req = parse_chat({k: body[k] for k in CHAT_PROMPT_FIELDS if k in body},
                         state.config.trust_request_chat_template)
        ids, _ = await prepare_chat(state, req, f.boolean("add_generation_prompt", True))
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
