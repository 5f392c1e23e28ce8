"""/generate_program: a program's segment executed in one request (runtime/programs/segment.py).

The language sends the expressions a program queued between two reads as one segment
instead of one /generate per `gen` (radixlm/segments.py); each step runs through the same code
as the per-call routes, so it gets the same answer without a round trip.

    POST /generate_program
    {"text": "<the state's text>",
     "lora_path": "<adapter name, for every step; optional>",
     "steps": [{"before": "<text>", "gen": {<a /generate body without text and stream>},
                "number": false},
               {"before": "<text>", "select": {"choices": ["yes", "no"],
                                               "choices_method": "token_length_normalized"}}]}

The answer is a stream of server-sent events, in step order: `{"index": i, "event": ...}` for
each /generate stream event of a running gen but its last, `{"index": i, "result": {"event":
...}}` with its last, `{"index": i, "result": {"text": choice, "scores": {"conditional": ...,
"unconditional": ...}}}` for a select; then `[DONE]`. With `"stream": false` a gen sends only
`{"index": i, "result": {"response": ...}}`, /generate's answer without a stream. A failing
step ends the stream with an error event, as a failing /generate stream does; the steps after
it do not run.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from aiohttp import web

from radixlm.runtime.programs.choices import METHODS, ChoiceScores, document_start
from radixlm.runtime.programs.segment import (
    MAX_STEPS,
    GenPiece,
    GenStep,
    Segment,
    SelectStep,
    Step,
    StepResult,
    run_segment,
)
from radixlm.runtime.protocol.fields import ApiError, Fields, bad
from radixlm.runtime.server.native_requests import PROGRAM_HEADER, one_lora, parse_tags
from radixlm.runtime.server.native_routes import (
    generation_events,
    generation_results,
    prepare_generation,
    score_logprobs,
)
from radixlm.runtime.server.state import ServerState
from radixlm.runtime.server.web_util import read_json, state_of, stream_events

# What a step's gen body may not hold: the segment sets them.
SEGMENT_SET = ("text", "input_ids", "stream", "lora_path")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate_program", generate_program)


async def generate_program(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    state.require_engine()
    body = await read_json(request)
    segment = parse_segment(body)
    tags = parse_tags(Fields(body), request.headers.get(PROGRAM_HEADER))
    tags["lora_path"] = one_lora(body, state.adapters)
    return await stream_events(request, _events(state, segment, tags))


def parse_segment(body: Any) -> Segment:
    f = Fields(body)
    f.only(("text", "steps", "stream", "program_id", "priority", "lora_path"))
    text = f.string("text", "")
    stream = f.boolean("stream", True)
    steps = f.get("steps", (list,), required=True, what="an array of steps")
    if not 1 <= len(steps) <= MAX_STEPS:
        raise bad(f"steps: a segment has 1 to {MAX_STEPS} steps, got {len(steps)}", "steps")
    return Segment(text, tuple(_step(raw, f"steps[{i}]") for i, raw in enumerate(steps)),
                   stream)


def _step(raw: Any, where: str) -> Step:
    if not isinstance(raw, dict):
        raise bad(f"{where} must be an object", where, "invalid_type")
    f = Fields(raw, prefix=f"{where}.")
    f.only(("before", "gen", "select", "number"))
    before = f.string("before", "")
    if ("gen" in raw) == ("select" in raw):
        raise bad(f"{where} needs exactly one of gen and select", where)
    if "gen" in raw:
        gen = f.object("gen", required=True)
        for name in SEGMENT_SET:
            if name in gen:
                raise bad(f"{where}.gen.{name}: the segment sets it", f"{where}.gen.{name}")
        return GenStep(before, gen, number=f.boolean("number", False))
    select = Fields(f.object("select", required=True), prefix=f"{where}.select.")
    select.only(("choices", "choices_method"))
    choices = select.get("choices", (list,), required=True, what="an array of strings")
    if not choices or not all(isinstance(c, str) for c in choices):
        raise bad(f"{where}.select.choices must be a non-empty array of strings",
                  f"{where}.select.choices", "invalid_type")
    method = select.string("choices_method", "token_length_normalized")
    if method not in METHODS:
        raise bad(f"{where}.select.choices_method must be one of {', '.join(METHODS)}",
                  f"{where}.select.choices_method")
    return SelectStep(before, tuple(choices), method)


async def _events(state: ServerState, segment: Segment,
                  tags: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    async for event in run_segment(segment, _ServerOps(state, tags)):
        result = event.result
        if result is None:
            yield {"index": event.index, "event": event.meta["event"]}
        elif result.scores is not None:
            yield {"index": event.index, "result": {"text": result.text, "scores": {
                "conditional": result.scores.conditional,
                "unconditional": result.scores.unconditional}}}
        else:  # the gen's last stream event, or without a stream its /generate answer
            yield {"index": event.index, "result": result.meta}


class _ServerOps:
    """A segment's calls, made as the per-call routes make them."""

    def __init__(self, state: ServerState, tags: dict[str, Any]) -> None:
        self.state = state
        # The segment's program, priority and adapter, sent with every step's call.
        self.tags = {k: v for k, v in tags.items() if v}

    async def generate(self, text: str, params: dict[str, Any],
                       stream: bool) -> AsyncIterator[GenPiece]:
        gen, req = await prepare_generation(self.state, {**self.tags, **params, "text": text,
                                                         "stream": stream})
        if not stream:
            result = (await generation_results(self.state, gen, req))[0]
            yield GenPiece("", {}, StepResult(result["text"], {"response": result}))
            return
        # Each event is held back until the next comes, so that the last one is the result.
        held: dict[str, Any] | None = None
        seen = ""
        async for event in generation_events(self.state, gen, req):
            if held is not None:
                yield GenPiece(held["text"][len(seen):], {"event": held})
                seen = held["text"]
            held = event
        if held is None:
            raise ApiError(500, "the generation ended without a result")
        yield GenPiece("", {}, StepResult(held["text"], {"event": held}))

    async def score(self, prefix: str, choices: list[str],
                    unconditional: bool) -> ChoiceScores:
        start = {"prefix_ids": [self._document_start()]}
        conditional = await score_logprobs(self.state, {
            **self.tags, **({"prefix": prefix} if prefix else start), "continuations": choices})
        prior = (await score_logprobs(self.state, {**self.tags, **start,
                                                   "continuations": choices})
                 if unconditional else None)
        return ChoiceScores(conditional, prior)

    def _document_start(self) -> int:
        """As rl.RuntimeEndpoint finds it, from what /get_model_info reports."""
        try:
            return document_start(getattr(self.state.codec.tokenizer, "bos_token_id", None),
                                  self.state.require_engine().eos_token_ids)
        except ValueError as exc:
            raise ApiError(400, str(exc), "choices_method") from None
