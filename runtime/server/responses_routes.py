"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed as typed events),
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

A request runs as the chat request it amounts to (responses_requests.py): the same template,
tool calling, structural tags and reasoning parser as /v1/chat/completions. Its reply becomes
output items in the order the model wrote them: `reasoning` (a reasoning parser's thinking),
`message` (the text), `function_call` (one per call). Streamed, each item is opened, filled
(text, thinking and call arguments as they are generated) and closed with OpenAI's events,
each numbered (`sequence_number`).

`previous_response_id` continues a stored response (responses_store.py): its conversation,
output included, comes before this request's input (not its `instructions`, as OpenAI does).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from radixlm.runtime.protocol import reasoning
from radixlm.runtime.protocol.fields import ApiError, Fields
from radixlm.runtime.protocol.tool_stream import StreamingToolParser
from radixlm.runtime.server.generation import HttpGeneration, Sample, abort_error
from radixlm.runtime.server.native_requests import PROGRAM_HEADER, parse_tags
from radixlm.runtime.server.openai_requests import OpenAIRequest, parse_chat
from radixlm.runtime.server.openai_routes import (
    generation,
    lora_of,
    prepare_chat,
    token_logprobs,
    tool_error,
)
from radixlm.runtime.server.responses_requests import ResponsesRequest, parse_responses
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.web_util import json_response, read_json, state_of, stream_events


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)


async def create(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    state.require_engine()
    body = await read_json(request)
    rr = parse_responses(body)
    earlier: list[dict[str, Any]] = []
    if rr.previous_response_id is not None:
        stored = state.responses.get(rr.previous_response_id)
        if stored is None:
            raise ApiError(400, f"previous_response_id: no stored response "
                                f"{rr.previous_response_id!r} (it was sent with store: false, "
                                "was deleted, or is too old to be kept)",
                           "previous_response_id", "previous_response_not_found")
        earlier = stored.conversation
    chat_body = rr.chat_body(earlier)
    rid = "resp_" + uuid.uuid4().hex
    try:
        req = parse_chat(chat_body, state.config.trust_request_chat_template)
        req.tags = parse_tags(Fields(body), request.headers.get(PROGRAM_HEADER))
        req.lora = lora_of(state, body)
        prompt, tool_format = await prepare_chat(state, req)
        gen = generation(state, req, [prompt], rid, "input")
    except ApiError as exc:
        raise rr.rename(exc) from None
    run = _Run(state, rr, req, rid, tool_format, [*earlier, *rr.input_messages])
    if rr.stream:
        return await stream_events(request, run.events(gen), named=True,
                                   error_event=run.error_event)
    async with gen:
        await gen.run()
    failure = gen.failure()
    if failure is not None:
        raise rr.rename(tool_error(req, failure))
    sample = gen.samples[0]
    run.output.feed(sample.text, sample.finish_reason)
    return json_response(await run.finished(gen, sample))


async def retrieve(request: web.Request) -> web.Response:
    stored = state_of(request).responses.get(request.match_info["response_id"])
    if stored is None:
        raise _not_found(request.match_info["response_id"])
    return json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not state_of(request).responses.delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response {response_id!r}", "response_id", "not_found")


class _Run:
    """One response: its object, its output as it is generated, and its storing."""

    def __init__(self, state: ServerState, rr: ResponsesRequest, req: OpenAIRequest, rid: str,
                 tool_format: str | None, messages: list[dict[str, Any]]) -> None:
        self.state = state
        self.rr = rr
        self.req = req
        self.rid = rid
        self.messages = messages  # the conversation so far, without instructions
        self.created = int(time.time())
        parser = state.config.reasoning_parser if req.separate_reasoning else None
        self.output = _Output(parser, tool_format, [t["name"] for t in req.tools.tools])
        self.sequence = 0

    def response(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "status": status, "model": self.state.model_name, "output": self.output.items,
                "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "previous_response_id": self.rr.previous_response_id, "store": self.rr.store,
                "usage": usage, **self.rr.echo}

    async def finished(self, gen: HttpGeneration, sample: Sample) -> dict[str, Any]:
        """The complete response object, stored unless `store: false`."""
        cut = sample.finish_reason == "length"
        usage = gen.usage()
        prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        response = self.response(
            "incomplete" if cut else "completed",
            {"input_tokens": prompt, "output_tokens": usage["completion_tokens"],
             "total_tokens": usage["total_tokens"],
             "input_tokens_details": {"cached_tokens": cached,
                                      "cache_write_tokens": prompt - cached},
             "output_tokens_details": {"reasoning_tokens": self.output.reasoning_tokens(
                 sample)}},
            "max_output_tokens" if cut else None)
        message = self.output.only_message()
        if self.req.params.logprobs and message is not None:
            # (on a reply that is one message: thinking and calls are not text the client sees)
            message["content"][0]["logprobs"] = await token_logprobs(self.state.codec,
                                                                     sample.logprobs)
        if self.rr.store:
            self.state.responses.put(response, [*self.messages, *self.output.as_messages()])
        return response

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def error_event(self, error: ApiError) -> dict[str, Any]:
        return self.event("error", code=error.code, message=error.message, param=error.param)

    async def events(self, gen: HttpGeneration) -> AsyncIterator[dict[str, Any]]:
        # (closed with the outer one: a client gone mid-stream aborts the engine's work)
        async with contextlib.aclosing(self._events(gen)) as events:
            try:
                async for event in events:
                    yield event
            except ApiError as exc:  # (before the first event, a plain 4xx; after, an event)
                raise self.rr.rename(tool_error(self.req, exc)) from None

    async def _events(self, gen: HttpGeneration) -> AsyncIterator[dict[str, Any]]:
        async with gen:
            async for sample, chunk in gen.chunks():
                if chunk.finish_reason == "abort" and chunk.error:
                    raise abort_error(chunk.error, chunk.error_invalid)
                if self.sequence == 0:  # opened with the engine's first chunk (see chat)
                    yield self.event("response.created", response=self.response("in_progress"))
                    yield self.event("response.in_progress",
                                     response=self.response("in_progress"))
                for kind, fields in self.output.feed(chunk.delta, chunk.finish_reason):
                    yield self.event(kind, **fields)
        response = await self.finished(gen, gen.samples[0])
        kind = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        yield self.event(kind, response=response)


class _Output:
    """The output items of a reply, built as it streams: each piece of text goes to the
    reasoning item, the message or a function call, and says which events it makes."""

    def __init__(self, reasoning_parser: str | None, tool_format: str | None,
                 tool_names: list[str]) -> None:
        self.thinking = (reasoning.ReasoningStream(reasoning_parser) if reasoning_parser
                         else None)
        self.tools = (StreamingToolParser(tool_format, tool_names) if tool_format else None)
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> item

    def feed(self, delta: str, finish: str | None) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        thought, text = self.thinking.feed(delta) if self.thinking else ("", delta)
        if finish is not None and self.thinking:
            more_thought, more_text = self.thinking.finish()
            thought, text = thought + more_thought, text + more_text
        if thought:
            item = self._item("reasoning", events)
            item["content"][0]["text"] += thought
            events.append(self._at(item, "response.reasoning_text.delta", content_index=0,
                                   delta=thought))
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if finish is not None:
                rest, more, _ = self.tools.finish(cut=finish == "length")
                text, calls = text + rest, calls + more
        if text and (self.open is None or self.open["type"] != "function_call"
                     or text.strip()):
            item = self._item("message", events)
            item["content"][0]["text"] += text
            events.append(self._at(item, "response.output_text.delta", content_index=0,
                                   delta=text, logprobs=[]))
        for delta_call in calls:
            function = delta_call["function"]
            if "id" in delta_call:
                item = self._item("function_call", events, call_id=delta_call["id"],
                                  name=function["name"])
                self.calls[delta_call["index"]] = item
            item = self.calls[delta_call["index"]]
            if function["arguments"]:
                item["arguments"] += function["arguments"]
                events.append(self._at(item, "response.function_call_arguments.delta",
                                       delta=function["arguments"]))
        if finish is not None:
            self._close(events, "incomplete" if finish == "length" else "completed")
        return events

    def _item(self, kind: str, events: list[tuple[str, dict[str, Any]]],
              **fields: Any) -> dict[str, Any]:
        """The open item of this kind, or a new one (closing the one before)."""
        if self.open is not None and self.open["type"] == kind and kind != "function_call":
            return self.open
        self._close(events, "completed")
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        elif kind == "message":
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant",
                    "content": [{"type": "output_text", "text": "", "annotations": [],
                                 "logprobs": []}]}
        else:
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex,
                    "arguments": "", **fields}
        item["status"] = "in_progress"
        self.items.append(item)
        self.open = item
        events.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                      "item": _copy(item)}))
        if kind == "message":
            events.append(self._at(item, "response.content_part.added", content_index=0,
                                   part=_copy(item["content"][0])))
        return item

    def _close(self, events: list[tuple[str, dict[str, Any]]], status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "reasoning":
            events.append(self._at(item, "response.reasoning_text.done", content_index=0,
                                   text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self._at(item, "response.output_text.done", content_index=0,
                                   text=part["text"], logprobs=[]))
            events.append(self._at(item, "response.content_part.done", content_index=0,
                                   part=_copy(part)))
        else:
            events.append(self._at(item, "response.function_call_arguments.done",
                                   name=item["name"], arguments=item["arguments"]))
        events.append(("response.output_item.done", {"output_index": self.items.index(item),
                                                     "item": _copy(item)}))

    def _at(self, item: dict[str, Any], kind: str, **fields: Any
            ) -> tuple[str, dict[str, Any]]:
        return kind, {"item_id": item["id"], "output_index": self.items.index(item), **fields}

    def reasoning_tokens(self, sample: Sample) -> int:
        """The reply's tokens that were thinking: its share of the text, in tokens."""
        thought = sum(len(i["content"][0]["text"]) for i in self.items
                      if i["type"] == "reasoning")
        return round(sample.completion_tokens * thought / max(1, len(sample.text)))

    def only_message(self) -> dict[str, Any] | None:
        """The message, if the output is that alone."""
        if len(self.items) == 1 and self.items[0]["type"] == "message":
            return self.items[0]
        return None

    def as_messages(self) -> list[dict[str, Any]]:
        """The output as the chat messages that continue the conversation."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items
                 if i["type"] == "function_call" and i["status"] == "completed"]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message] if text or calls else []


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is now (events carry snapshots; the item grows on)."""
    return {k: ([dict(p) for p in v] if isinstance(v, list) else v) for k, v in item.items()}
