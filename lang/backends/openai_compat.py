"""`rl.OpenAI(model, base_url, api_key)`: programs on any OpenAI-compatible server.

Such servers take text (`/v1/completions`) or messages (`/v1/chat/completions`), not a
template-rendered mix, so:
- a program without roles generates through `/v1/completions`;
- a program with roles must put each `gen` at the start of an assistant message, which
  becomes a chat completion of the messages before it;
- `select` needs prompt-token logprobs (`/v1/completions` with `echo` and `logprobs`); a
  server that does not return them fails the select with a clear error;
- regex and ebnf constraints have no OpenAI field and fail clearly; `json_schema` and
  `json_object` become `response_format`; cache hints are ignored.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from typing import Any, AsyncIterator, Sequence

from radixlm.backends import speculation
from radixlm.backends.backend import (
    Backend,
    BackendError,
    Generation,
    OnDelta,
    Prompt,
    current_lora,
)
from radixlm.backends.http import HttpClient
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.choices import ChoiceScores
from radixlm.runtime.programs.segment import GenPiece, Segment, StepResult
from radixlm.runtime.programs.stream import SegmentStream

# SamplingParams fields with an OpenAI name; the rest go as extra fields (vLLM, SGLang and
# radixlm servers accept them) only when they differ from the defaults.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature",
                "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty"}
EXTRA_NAMES = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
               "min_new_tokens": "min_tokens", "ignore_eos": "ignore_eos",
               "stop_token_ids": "stop_token_ids"}


class OpenAI(Backend):
    supports_speculation = True

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 *, timeout: float = 600.0) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError("model: name the model the server should use")
        self.model = model
        self.http = HttpClient(base_url or "https://api.openai.com/v1",
                               api_key if api_key is not None else os.environ.get(
                                   "OPENAI_API_KEY"), timeout)

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        on_delta: OnDelta | None = None) -> Generation:
        body = self._body(params)
        if prompt.open_role is None and not prompt.messages:
            path, body["prompt"] = "/completions", prompt.text
        else:
            path, body["messages"] = "/chat/completions", _chat_messages(prompt)
        if on_delta is None:
            result = await self.http.post(path, body)
            choice = result["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"] or ""
            return Generation(text, _meta(result, choice))
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        pieces, meta = [], {}
        async for event in self.http.stream(path, body):
            for choice in event.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece:
                    pieces.append(piece)
                    on_delta(piece, {})  # usage comes only at the end
                if choice.get("finish_reason"):
                    meta["finish_reason"] = choice["finish_reason"]
            if event.get("usage"):
                meta.update(_usage(event["usage"]))
        return Generation("".join(pieces), meta)

    def speculate(self, segment: Segment, spec_tokens: int) -> SegmentStream:
        return SegmentStream(speculation.speculate(segment, _Calls(self), spec_tokens))

    async def complete(self, text: str, params: SamplingParams,
                       max_tokens: int) -> speculation.Speculated:
        """A speculative call: `max_tokens` tokens after `text`, no stop, and the tokens'
        texts (logprobs) to count a gen's tokens by."""
        body = {**self._body(params.replace(max_new_tokens=max_tokens, stop=())),
                "prompt": text, "logprobs": 0}
        result = await self.http.post("/completions", body)
        choice = result["choices"][0]
        tokens = (choice.get("logprobs") or {}).get("tokens")
        ends = None
        if tokens and "".join(tokens) == choice["text"]:  # else odd bytes: no boundaries
            ends = list(itertools.accumulate(len(t) for t in tokens))
        return speculation.Speculated(choice["text"], ends, choice.get("finish_reason"),
                                      _usage(result.get("usage") or {})["prompt_tokens"],
                                      params)

    async def acall_tools(self, prompt: Prompt, tools: Any, params: SamplingParams
                          ) -> Generation:
        return await chat_with_tools(self.http, "/chat/completions", self._body(params),
                                     prompt, tools)

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        if unconditional:
            raise BackendError("select: unconditional_likelihood_normalized needs scoring "
                               "without context, which OpenAI-compatible servers do not offer; "
                               "use another choices_method")
        return ChoiceScores(list(await asyncio.gather(
            *(self._choice_logprobs(prefix, c) for c in choices))))

    async def _choice_logprobs(self, prefix: str, choice: str) -> list[float]:
        body = {"model": self._model(), "prompt": prefix + choice, "max_tokens": 0,
                "echo": True, "logprobs": 0, "temperature": 0}
        try:
            result = await self.http.post("/completions", body)
            logprobs = result["choices"][0]["logprobs"]
            offsets, values = logprobs["text_offset"], logprobs["token_logprobs"]
        except (BackendError, KeyError, TypeError, IndexError) as exc:
            raise BackendError(
                "select needs prompt-token logprobs (/v1/completions with echo and logprobs), "
                f"which this server does not return ({exc}); use rl.gen(regex=...) or the "
                "rl.Engine / rl.RuntimeEndpoint backends") from None
        # The choice's tokens are those that start at or after the end of the prefix.
        picked = [v for off, v in zip(offsets, values) if off >= len(prefix) and v is not None]
        if not picked:
            raise BackendError(f"select: the server returned no logprobs for {choice!r}")
        return picked

    def _body(self, params: SamplingParams) -> dict[str, Any]:
        return request_body(self._model(), params)

    def _model(self) -> str:
        """The model to ask for: the call's LoRA adapter, which OpenAI-compatible servers
        (ours, vLLM) serve under its own name, else the backend's model."""
        return current_lora.get() or self.model


class _Calls:
    """A speculated segment's calls: `complete`, and the per-call path for the rest."""

    def __init__(self, backend: OpenAI) -> None:
        self.backend = backend

    async def generate(self, text: str, params: SamplingParams,
                       stream: bool) -> AsyncIterator[GenPiece]:
        generation = await self.backend.agenerate(Prompt(text), params)
        yield GenPiece("", {}, StepResult(generation.text, generation.meta))

    async def score(self, prefix: str, choices: list[str], unconditional: bool) -> ChoiceScores:
        return await self.backend.ascore(prefix, choices, unconditional)

    async def complete(self, text: str, params: SamplingParams,
                       max_tokens: int) -> speculation.Speculated:
        return await self.backend.complete(text, params, max_tokens)


def request_body(model: str, params: SamplingParams) -> dict[str, Any]:
    """An OpenAI request's sampling fields for `params` (plus SGLang/vLLM's extras)."""
    if params.n != 1:
        raise ValueError("n: a gen produces one completion; use s.fork(n) for several")
    if params.stop_regex:
        raise BackendError("stop_regex: OpenAI-compatible APIs have no stop_regex; use stop "
                           "strings, or rl.Engine / rl.RuntimeEndpoint")
    for name in ("regex", "ebnf"):
        if getattr(params, name) is not None:
            raise BackendError(f"{name}: OpenAI-compatible APIs have no {name} constraint; "
                               "use rl.Engine or rl.RuntimeEndpoint for regex, ebnf and "
                               "dtype=")
    body: dict[str, Any] = {"model": model}
    for name, key in OPENAI_NAMES.items():
        value = getattr(params, name)
        if value is not None:
            body[key] = value
    if params.stop:
        body["stop"] = list(params.stop)
    defaults = SamplingParams()
    for name, key in EXTRA_NAMES.items():
        value = getattr(params, name)
        if value != getattr(defaults, name):
            body[key] = list(value) if isinstance(value, tuple) else value
    if params.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": json.loads(params.json_schema)}}
    elif params.json_object:
        body["response_format"] = {"type": "json_object"}
    return body


async def chat_with_tools(http: HttpClient, path: str, body: dict[str, Any], prompt: Prompt,
                    tools: Any) -> Generation:
    """A chat completion with `tools` (a ToolRequest) at `path`: the reply's text, and its
    calls in meta["tool_calls"] with the arguments as objects."""
    choice: Any = tools.choice
    if choice == "function":
        choice = {"type": "function", "function": {"name": tools.forced}}
    body = {**body, "messages": _wire_messages(_chat_messages(prompt)),
            "tools": tools.template_tools(), "tool_choice": choice}
    if choice != "none":
        body["parallel_tool_calls"] = tools.parallel
    result = await http.post(path, body)
    choice_out = result["choices"][0]
    message = choice_out["message"]
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) \
                else fn["arguments"]
        except ValueError:
            raise BackendError(f"the server returned a tool call with arguments that are not "
                               f"JSON: {fn['arguments']!r}") from None
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": arguments}})
    return Generation(message.get("content") or "", {**_meta(result, choice_out),
                                                     "tool_calls": calls})


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the OpenAI API takes them: a call's arguments as JSON text."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"])}} for c in m["tool_calls"]]}
        out.append(m)
    return out


def _chat_messages(prompt: Prompt) -> list[dict[str, str]]:
    messages = list(prompt.messages)
    if prompt.open_role != "assistant" or messages[-1]["content"]:
        raise BackendError("gen: on an OpenAI-compatible backend a gen inside roles must start "
                           "an assistant message (e.g. s += rl.assistant(rl.gen('answer')))")
    return messages[:-1]


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    return {"prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens", 0)}


def _meta(result: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    return {"finish_reason": choice.get("finish_reason"), **_usage(result.get("usage") or {})}
