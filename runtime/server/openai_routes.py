"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from aiohttp import web

from radixlm.runtime.engine_process.messages import LogprobEntry
from radixlm.runtime.protocol import reasoning, tool_formats, tool_requests
from radixlm.runtime.protocol.fields import ApiError, Fields, bad
from radixlm.runtime.protocol.sampling_fields import fit_context
from radixlm.runtime.protocol.tool_stream import StreamingToolParser
from radixlm.runtime.server.generation import HttpGeneration, Sample, abort_error
from radixlm.runtime.server.native_requests import PROGRAM_HEADER, parse_tags
from radixlm.runtime.server.openai_requests import OpenAIRequest, parse_chat, parse_completion
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.web_util import json_response, read_json, state_of, stream_events


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)


def _cards(state: ServerState) -> list[dict[str, Any]]:
    """The base model's card, then each LoRA adapter's (its `parent` the base model)."""
    info = state.require_engine()  # 503 while the model loads: it cannot be used yet
    base = {"id": state.model_name, "object": "model", "created": int(state.started_at),
            "owned_by": "radixlm", "root": state.model_path or state.model_name,
            "parent": None, "max_model_len": info.max_model_len}
    return [base] + [{**base, "id": name, "root": adapter["path"], "parent": state.model_name}
                     for name, adapter in state.adapters.items()]


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": _cards(state_of(request))})


async def model(request: web.Request) -> web.Response:
    state = state_of(request)
    wanted = request.match_info["model_id"]
    for card in _cards(state):
        if card["id"] == wanted:
            return json_response(card)
    raise ApiError(404, f"the model {wanted!r} does not exist; this server serves "
                        f"{state.model_name!r}", "model", "model_not_found")


def lora_of(state: ServerState, body: dict[str, Any]) -> list[str] | None:
    """A request whose `model` names a served LoRA adapter runs it; any other name (the base
    model's, or one a client sends out of habit) runs the base model."""
    name = body.get("model")
    return [name] if isinstance(name, str) and name in state.adapters else None


async def completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    info = state.require_engine()
    body = await read_json(request)
    req = parse_completion(body, info.vocab_size)
    req.tags = parse_tags(Fields(body), request.headers.get(PROGRAM_HEADER))
    req.lora = lora_of(state, body)
    assert req.prompts is not None
    prompts = [p if isinstance(p, list) else await state.codec.encode_prompt(p, "prompt")
               for p in req.prompts]
    echoes = None
    if req.echo:  # a text prompt as sent; token ids as text
        echoes = [p if isinstance(p, str)
                  else await state.codec.decode(p, req.params.skip_special_tokens)
                  for p in req.prompts]
    return await _respond(request, state, req, prompts, "cmpl", "text_completion",
                          echoes=echoes)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    state.require_engine()
    body = await read_json(request)
    req = parse_chat(body, state.config.trust_request_chat_template)
    req.tags = parse_tags(Fields(body), request.headers.get(PROGRAM_HEADER))
    req.lora = lora_of(state, body)
    prompt, tool_format = await prepare_chat(state, req)
    return await _respond(request, state, req, [prompt], "chatcmpl", "chat.completion",
                          tool_format)


async def prepare_chat(state: ServerState, req: OpenAIRequest, add_generation_prompt: bool = True
                       ) -> tuple[list[int], str | None]:
    """A parsed chat request made ready to run: its tools' schemas checked, the conversation
    rendered and encoded, the tool calls' structural tag set on its params. Returns the prompt
    and the format replies' tool calls are parsed in (None: no tools)."""
    assert req.messages is not None
    await state.codec.check_tool_schemas(req.tools.schemas)
    plan = tool_requests.plan(req.chat_template or state.codec.chat_template, req.messages,
                              req.tools, state.config.tool_call_parser)
    text = await state.codec.render_chat(plan.messages, add_generation_prompt,
                                         tools=plan.template_tools,
                                         template_kwargs=req.template_kwargs,
                                         template=req.chat_template)
    if plan.structural_tag is not None:
        if req.params.constrained and req.tools.constrained:
            raise bad("tool_choice 'required' or a named function constrains the reply to tool "
                      "calls; it cannot be combined with response_format, regex or ebnf",
                      "tool_choice")
        if not req.params.constrained:  # (auto with the client's own grammar: that wins)
            req.params = req.params.replace(structural_tag=plan.structural_tag)
            req.grammar_from_tools = True
    trigger = tool_formats.TRIGGERS.get(plan.format or "")
    if trigger is not None and state.codec.is_special(trigger):
        # (Mistral's [TOOL_CALLS], Hermes 2 Pro's <tool_call>): kept in the text, to be parsed
        req.params = req.params.replace(skip_special_tokens=False)
    return await state.codec.encode_prompt(text, "messages"), plan.format


def generation(state: ServerState, req: OpenAIRequest, prompts: list[list[int]], rid: str,
               prompt_param: str) -> HttpGeneration:
    """The request's generation, each prompt's budget fitted to the context."""
    info = state.require_engine()
    params = [fit_context(req.params, len(ids), info.max_model_len, req.explicit_max,
                          prompt_param, req.max_param, "min_tokens") for ids in prompts]
    keys = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    return HttpGeneration(state, prompts, params, keys, req.cache_salt, group=rid,
                          tags=req.tags, loras=None if req.lora is None
                          else req.lora * len(prompts))


def tool_error(req: OpenAIRequest, error: ApiError) -> ApiError:
    """A failed request's error, named after the field the client sent: the structural tag
    of the calls is the server's, so its errors are the tools' (their schemas)."""
    if error.param == "structural_tag" and req.grammar_from_tools:
        return ApiError(error.status, "tools" + error.message.removeprefix("structural_tag"),
                        "tools", error.code)
    return error


async def _respond(request: web.Request, state: ServerState, req: OpenAIRequest,
                   prompts: list[list[int]], prefix: str, kind: str,
                   tool_format: str | None = None,
                   echoes: list[str] | None = None) -> web.StreamResponse:
    """`echoes`: completions' `echo`, each prompt's text to start its choices with."""
    rid = f"{prefix}-{uuid.uuid4().hex}"
    gen = generation(state, req, prompts, rid,
                     "prompt" if kind == "text_completion" else "messages")
    head = {"id": rid, "object": kind, "created": int(time.time()),
            "model": state.model_name if req.lora is None else req.lora[0]}
    render = _Renderer(state, req, kind == "chat.completion", tool_format,
                       None if echoes is None else _Echo(echoes, prompts))
    if req.stream:
        return await stream_events(request, _events(gen, head, render, req))
    async with gen:
        await gen.run()
    failure = gen.failure()
    if failure is not None:
        raise tool_error(req, failure)
    choices = [await render.choice(i, s) for i, s in enumerate(gen.samples)]
    return json_response({**head, "choices": choices, "usage": gen.usage()})


async def _events(gen: HttpGeneration, head: dict[str, Any], render: "_Renderer",
                  req: OpenAIRequest) -> AsyncIterator[dict[str, Any]]:
    head = {**head, "object": head["object"] + (".chunk" if render.chat else "")}
    flat = {id(s): i for i, s in enumerate(gen.samples)}
    opened = not render.chat
    echoed: set[int] = set()
    async with gen:
        async for sample, chunk in gen.chunks():
            index = flat[id(sample)]
            if chunk.finish_reason == "abort" and chunk.error:
                raise tool_error(req, abort_error(chunk.error, chunk.error_invalid))
            if render.echo is not None and index not in echoed:
                # Each choice's prompt first (echo with logprobs is refused when streaming).
                echoed.add(index)
                yield {**head, "choices": [{"index": index,
                                            "text": render.echo.texts[sample.prompt_index],
                                            "logprobs": None, "finish_reason": None}]}
            if not opened:
                # OpenAI opens each choice with the assistant role. Sent with the engine's
                # first chunk, not before: a request the engine refuses is still a plain 400.
                opened = True
                for i in range(len(gen.samples)):
                    yield {**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                       "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            logprobs = chunk.logprobs if render.wants_logprobs else None
            if not (chunk.delta or chunk.finished or logprobs):
                continue  # text held back (a possible stop string, half a character)
            choice = await render.delta(index, sample, chunk.delta, logprobs or [],
                                        chunk.finish_reason)
            if choice is not None:
                yield {**head, "choices": [choice]}
    if req.include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}


class _Renderer:
    """Choices and logprobs in the completions or the chat shape; with tools, the replies'
    tool calls parsed out (`tool_format`)."""

    def __init__(self, state: ServerState, req: OpenAIRequest, chat: bool,
                 tool_format: str | None = None, echo: "_Echo | None" = None) -> None:
        self.codec = state.codec
        self.chat = chat
        self.echo = echo
        self.wants_logprobs = req.params.logprobs
        self.skip_special = req.params.skip_special_tokens
        self.offsets: dict[int, int] = {}  # completions text_offset, per streamed choice
        self.tool_format = tool_format
        self.tool_names = [t["name"] for t in req.tools.tools]
        self.parsers: dict[int, StreamingToolParser] = {}  # per streamed choice
        self.reasoning = (state.config.reasoning_parser
                          if chat and req.separate_reasoning else None)
        self.thinking: dict[int, reasoning.ReasoningStream] = {}  # per streamed choice

    async def choice(self, index: int, sample: Sample) -> dict[str, Any]:
        if not self.chat:
            text, entries = sample.text, sample.logprobs
            if self.echo is not None:
                text = self.echo.texts[sample.prompt_index] + text
                if self.wants_logprobs:
                    entries = self.echo.entries(sample) + entries
            logprobs = await self._logprobs(index, entries) if self.wants_logprobs else None
            out = {"index": index, "text": text, "logprobs": logprobs,
                   "finish_reason": sample.finish_reason}
            return _with_warnings(out, sample)
        logprobs = await self._logprobs(index, sample.logprobs) if self.wants_logprobs else None
        thought, content, calls = None, sample.text, []
        if self.reasoning is not None:
            thought, content = reasoning.split(self.reasoning, content)
        if self.tool_format is not None:
            content, calls = tool_formats.parse(self.tool_format, content, self.tool_names,
                                                cut=sample.finish_reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thought is not None:
            message["reasoning_content"] = thought
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [c.openai() for c in calls]
        out = {"index": index, "message": message, "logprobs": logprobs,
               "finish_reason": _finish(sample.finish_reason, len(calls))}
        return _with_warnings(out, sample)

    async def delta(self, index: int, sample: Sample, text: str,
                    entries: list[LogprobEntry], finish: str | None) -> dict[str, Any] | None:
        logprobs = await self._logprobs(index, entries) if self.wants_logprobs else None
        if not self.chat:
            out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return _with_warnings(out, sample) if finish is not None else out
        delta: dict[str, Any] = {}
        call_deltas: list[dict[str, Any]] = []
        made_calls = 0
        if self.reasoning is not None:
            stream = self.thinking.setdefault(index, reasoning.ReasoningStream(self.reasoning))
            thought, text = stream.feed(text)
            if finish is not None:
                more_thought, more_text = stream.finish()
                thought, text = thought + more_thought, text + more_text
            if thought:
                delta["reasoning_content"] = thought
        if self.tool_format is not None:
            parser = self.parsers.setdefault(index, StreamingToolParser(self.tool_format,
                                                                        self.tool_names))
            text, call_deltas = parser.feed(text)
            if finish is not None:
                rest, more, made_calls = parser.finish(cut=finish == "length")
                text += rest
                call_deltas += more
        if text:
            delta["content"] = text
        if call_deltas:
            delta["tool_calls"] = _merged(call_deltas)
        if not delta and finish is None and logprobs is None:
            return None  # text held back while a tool call may be starting
        out = {"index": index, "delta": delta, "logprobs": logprobs,
               "finish_reason": _finish(finish, made_calls) if finish is not None else None}
        return _with_warnings(out, sample) if finish is not None else out

    async def _logprobs(self, index: int, entries: list[EchoEntry]) -> dict[str, Any]:
        """The entries in the route's shape (in completions, an echoed prompt's first token
        has no logprob: None)."""
        if self.chat:
            return {"content": await token_logprobs(self.codec, entries), "refusal": None}
        ids = [t for t, _, _ in entries] + [t for _, _, top in entries for t, _ in top or ()]
        texts = dict(zip(ids, await self.codec.token_texts(ids)))
        offsets = []
        offset = self.offsets.get(index, 0)
        for t, _, _ in entries:
            offsets.append(offset)
            # Offsets into the choice's text, which leaves out skipped special tokens (a BOS
            # the tokenizer put before an echoed prompt, an EOS at the end).
            if not (self.skip_special and self.codec.is_special(texts[t])):
                offset += len(texts[t])
        self.offsets[index] = offset
        return {"tokens": [texts[t] for t, _, _ in entries],
                "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if lp is None else {texts[a]: alp for a, alp in top or ()}
                                 for _, lp, top in entries],
                "text_offset": offsets}


# A logprob entry of an echoed prompt token: (token, logprob, top), None for the first one's.
EchoEntry = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass
class _Echo:
    """Completions' `echo`: each prompt's text, and its ids for the prompt's logprobs."""

    texts: list[str]
    prompts: list[list[int]]

    def entries(self, sample: Sample) -> list[EchoEntry]:
        """The sample's prompt logprobs, one per prompt token (asked from position 0 when
        the request wants logprobs: parse_completion)."""
        ids = self.prompts[sample.prompt_index]
        logprobs = sample.prompt_logprobs or [None] * len(ids)
        return [(t, None, None) if e is None else (t, e[1], e[2])
                for t, e in zip(ids, logprobs)]


async def token_logprobs(codec: Any, entries: list[LogprobEntry]) -> list[dict[str, Any]]:
    """Logprob entries in the chat (and Responses) shape: each token's text, bytes, logprob
    and top alternatives."""
    ids = [t for t, _, _ in entries] + [t for _, _, top in entries for t, _ in top or ()]
    texts = dict(zip(ids, await codec.token_texts(ids)))

    def item(tid: int, lp: float) -> dict[str, Any]:
        return {"token": texts[tid], "logprob": lp, "bytes": list(texts[tid].encode("utf-8"))}
    return [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top or ()]}
            for t, lp, top in entries]


def _finish(reason: str | None, calls: int) -> str | None:
    """A reply that made calls finishes with "tool_calls", unless the budget cut it
    ("length": its last call may be unfinished)."""
    return "tool_calls" if calls and reason == "stop" else reason


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One chunk's call deltas, one per call: its opening and argument fragments joined."""
    out: dict[int, dict[str, Any]] = {}
    for d in deltas:
        index = d["index"]
        if index not in out:
            out[index] = {**d, "function": dict(d["function"])}
        else:
            out[index]["function"]["arguments"] += d["function"]["arguments"]
    return list(out.values())


def _with_warnings(choice: dict[str, Any], sample: Sample) -> dict[str, Any]:
    """A choice, with what its grammar left unenforced (json_schema strict: false only)."""
    if sample.grammar_warnings:
        choice["grammar_warnings"] = list(sample.grammar_warnings)
    return choice
