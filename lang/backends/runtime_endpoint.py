"""`rl.RuntimeEndpoint(url)`: programs on a radixlm server (`radixlm serve`).

It uses the server's native routes, which carry everything a program needs: `/generate`
with any sampling field, `/score` for select, `/apply_chat_template` for roles,
`/pin_prefix` / `/release_prefix` for the cache hints, and `/generate_program` for a
program's segments (several steps in one request).
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Sequence

from radixlm.backends import background
from radixlm.backends.backend import (
    Backend,
    BackendError,
    Generation,
    OnDelta,
    Prompt,
    current_lora,
)
from radixlm.backends.http import HttpClient
from radixlm.backends.openai_compat import chat_with_tools, request_body
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.choices import ChoiceScores, document_start
from radixlm.runtime.programs.segment import GenStep, Segment, SegmentEvent, StepResult
from radixlm.runtime.programs.stream import SegmentStream

# Meta info lists a streamed /generate event holds only the new entries of.
INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs")
# A fork's prefix stays pinned at most this long if the program never joins.
LEASE_TTL_S = 600.0


class RuntimeEndpoint(Backend):
    supports_cache_hints = True

    def __init__(self, base_url: str, api_key: str | None = None, *,
                 cache_hints: bool = True, segments: bool = True,
                 timeout: float = 600.0) -> None:
        self.http = HttpClient(base_url, api_key, timeout)
        self.info = background.run(self.http.get("/get_model_info"))
        self.supports_cache_hints = cache_hints
        # Servers that predate /generate_program get one call per gen.
        self.supports_segments = segments and bool(self.info.get("supports_segments"))

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        on_delta: OnDelta | None = None) -> Generation:
        if params.n != 1:
            raise ValueError("n: a gen produces one completion; use s.fork(n) for several")
        body = {"text": prompt.text, **_generate_fields(params), **_adapter(),
                "stream": on_delta is not None}
        if on_delta is None:
            return _generation(await self.http.post("/generate", body))
        stream = _GenerateStream()
        async for event in self.http.stream("/generate", body):
            piece = stream.feed(event)
            if piece is not None:
                on_delta(*piece)
        return stream.result()

    def start_segment(self, segment: Segment) -> SegmentStream:
        steps = [{"before": step.before, "gen": _generate_fields(step.params),
                  "number": step.number} if isinstance(step, GenStep) else
                 {"before": step.before, "select": {"choices": list(step.choices),
                                                    "choices_method": step.method}}
                 for step in segment.steps]
        # Cancelling the stream hangs up, which makes the server stop the step in flight.
        return SegmentStream(_segment_events(self.http.stream("/generate_program", {
            "text": segment.text, "steps": steps, "stream": segment.stream, **_adapter()})))

    async def acall_tools(self, prompt: Prompt, tools: Any, params: SamplingParams
                          ) -> Generation:
        # The server's OpenAI route does it all: the template's tools, the calls' structural tag.
        # The OpenAI routes pick an adapter by model name.
        return await chat_with_tools(self.http, "/v1/chat/completions",
                                     request_body(current_lora.get() or "m", params), prompt,
                                     tools)

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        conditional = await self._score({"prefix": prefix} if prefix else
                                        {"prefix_ids": self._no_context()}, choices)
        prior = (await self._score({"prefix_ids": self._no_context()}, choices)
                 if unconditional else None)
        return ChoiceScores(conditional, prior)

    async def _score(self, prefix: dict[str, Any], choices: Sequence[str]) -> list[list[float]]:
        result = await self.http.post("/score", {**prefix, "continuations": list(choices),
                                                 **_adapter()})
        return result["logprobs"]

    def _no_context(self) -> list[int]:
        return [document_start(self.info.get("bos_token_id"),
                               self.info.get("eos_token_ids") or [])]

    async def arender_chat(self, messages: list[dict[str, str]],
                           add_generation_prompt: bool = False) -> str | None:
        if not self.info.get("has_chat_template"):
            return None
        result = await self.http.post("/apply_chat_template", {
            "messages": messages, "add_generation_prompt": add_generation_prompt})
        return result["text"]

    async def apin_prefix(self, text: str) -> Any:
        if not self.supports_cache_hints or not text:
            return None
        result = await self.http.post("/pin_prefix", {"text": text, "ttl": LEASE_TTL_S,
                                                      **_adapter()})
        return result["lease_id"]

    async def arelease_prefix(self, handle: Any) -> None:
        if handle is not None:
            await self.http.post("/release_prefix", {"lease_id": handle})

    async def arelease_program(self, program_id: str) -> None:
        if self.info.get("supports_segments"):  # a server as new as program pins
            await self.http.post("/release_program", {"program_id": program_id})

    def stats(self) -> dict[str, Any]:
        return self.server_info()["stats"]

    def flush_cache(self) -> bool:
        background.run(self.http.post("/flush_cache", {}))
        return True

    def server_info(self) -> dict[str, Any]:
        return background.run(self.http.get("/get_server_info"))

    def get_model_name(self) -> str:
        """The model's path or name, as the server reports it (SGLang's method)."""
        return self.info["model_path"]


def _adapter() -> dict[str, Any]:
    """The running call's LoRA adapter as the native routes take it (nothing for none)."""
    name = current_lora.get()
    return {} if name is None else {"lora_path": name}


def _generate_fields(params: SamplingParams) -> dict[str, Any]:
    """A /generate body's fields but the prompt and `stream`, for these params."""
    sampling = _changed_fields(params)
    body: dict[str, Any] = {"sampling_params": sampling}
    if params.wants_logprobs:  # the route takes logprob requests beside sampling_params
        for name in ("logprobs", "top_logprobs_num", "logprob_start_len"):
            sampling.pop(name, None)
        body.update(return_logprob=True, top_logprobs_num=params.top_logprobs_num,
                    return_text_in_logprobs=True)
        if params.logprob_start_len is not None:
            body["logprob_start_len"] = params.logprob_start_len
    return body


class _GenerateStream:
    """/generate stream events as a gen's pieces of text with their meta, then its result."""

    def __init__(self) -> None:
        self.text = ""
        self.last: dict[str, Any] | None = None
        # Meta info lists each event holds only the new entries of: all of them so far, and
        # those not passed on with a piece yet.
        self.whole: dict[str, list[Any]] = {key: [] for key in INCREMENTAL_META_KEYS}
        self.pending: dict[str, list[Any]] = {key: [] for key in INCREMENTAL_META_KEYS}

    def feed(self, event: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """The new piece of text and its meta, if the event adds text."""
        meta = event.get("meta_info", {})
        for key in INCREMENTAL_META_KEYS:
            self.whole[key].extend(meta.get(key) or ())
            self.pending[key].extend(meta.get(key) or ())
        new = event["text"]  # the whole text so far
        piece = None
        if len(new) > len(self.text):
            piece_meta = dict(meta)
            if "output_token_logprobs" in meta:  # a token that added no text passes its
                # logprobs on to the next piece
                piece_meta.update(self.pending)
                self.pending = {key: [] for key in INCREMENTAL_META_KEYS}
            piece = (new[len(self.text):], piece_meta)
        self.text, self.last = new, event
        return piece

    def result(self) -> Generation:
        if self.last is None:
            raise BackendError("/generate: the stream ended without a result")
        for key, values in self.whole.items():
            if key in self.last.get("meta_info", {}):
                self.last["meta_info"][key] = values
        return _generation(self.last)


async def _segment_events(events: AsyncIterator[dict[str, Any]]
                          ) -> AsyncIterator[SegmentEvent]:
    """/generate_program's events as the replay takes them."""
    streams: dict[int, _GenerateStream] = {}
    async for event in events:
        index = event["index"]
        result = event.get("result")
        if result is not None and "scores" in result:
            scores = result["scores"]
            yield SegmentEvent(index, result=StepResult(result["text"], {}, ChoiceScores(
                scores["conditional"], scores.get("unconditional"))))
            continue
        if result is not None and "response" in result:  # no stream: /generate's answer
            generation = _generation(result["response"])
            yield SegmentEvent(index, result=StepResult(generation.text, generation.meta))
            continue
        stream = streams.setdefault(index, _GenerateStream())
        piece = stream.feed(result["event"] if result is not None else event["event"])
        if piece is not None:
            yield SegmentEvent(index, *piece)
        if result is not None:
            generation = stream.result()
            yield SegmentEvent(index, result=StepResult(generation.text, generation.meta))


def _changed_fields(params: SamplingParams) -> dict[str, Any]:
    """Only what differs from the defaults: short requests, and the server's defaults (the
    same SamplingParams) fill in the rest."""
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value != f.default:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _generation(result: dict[str, Any]) -> Generation:
    meta = dict(result.get("meta_info", {}))
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason == "abort":
        raise BackendError(f"the server aborted the request: {finish}")
    meta["finish_reason"] = reason
    meta["matched_stop"] = finish.get("matched") if isinstance(finish, dict) else None
    return Generation(result["text"], meta)
