"""Segments on the program's side: which queued expressions go to the runtime as one request,
and how their results come back into the state.

`plan` runs the queued expressions on a copy of the state against a recording backend: each
`gen` and `select` becomes a step, and the text the state gains between two steps (literal
text, role openings and closings) becomes the next step's `before`. Model output is unknown
while planning, so a placeholder stands in for it; the text after it is what the template
writes whatever the content is, for every template we know. Planning stops before anything a
segment cannot hold: a tool call, a reasoning split, a select with a method of the program's
own, an expression that fails.

The interpreter then executes the same expressions for real, against `Replay`: a backend that
answers each `gen` and `select` with the segment's result for that step, after checking that
the prompt is, character for character, the text the runtime continued. Where it is not (the
placeholder was wrong about a template), the rest of the segment is cancelled and the
remaining calls go to the real backend one by one. Either way every call's answer is the one
the per-call path would have got. The chat template's renderings made while planning are
reused by the replay rather than asked for twice.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Sequence

from radixlm.backends.backend import Backend, Generation, OnDelta, Prompt
from radixlm.expr import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.choices import METHODS, ChoiceScores
from radixlm.runtime.programs.segment import (
    MAX_STEPS,
    GenStep,
    Segment,
    SegmentEvent,
    SelectStep,
    Step,
)
from radixlm.runtime.programs.stream import SegmentStream

__all__ = ["Renders", "Replay", "Segment", "SegmentStream", "plan"]

# What a segment can hold besides gen and select.
_PLAIN = (Text, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd)
# Stands in for a gen's text while planning, by the gen's dtype.
_PLACEHOLDER = {int: "0", float: "0", bool: "True", str: '""'}
_PLACEHOLDER_TEXT = "RadixlmSegmentText"


class Renders:
    """The chat template's renderings made while planning, reused by the replay, which renders
    the same messages again (over HTTP each rendering is a request)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.done: dict[str, str | None] = {}

    async def __call__(self, messages: list[dict[str, Any]],
                       add_generation_prompt: bool) -> str | None:
        key = json.dumps([messages, add_generation_prompt], sort_keys=True, default=str)
        if key not in self.done:
            self.done[key] = await self.backend.arender_chat(messages, add_generation_prompt)
        return self.done[key]


async def plan(interp: Any, exprs: Sequence[Expr]) -> tuple[int, Segment, Renders] | None:
    """(how many of `exprs` the segment covers, the segment, the renderings planning made),
    or None when fewer than two model steps would be in it (one step gains nothing over a
    call). `interp` is the Interpreter whose state the segment continues."""
    recorder = _Recorder(Renders(interp.backend))
    shadow = type(interp)(recorder, interp.defaults, interp.loop, parent=interp)  # a copy
    recorder.shadow = shadow
    start_text = shadow.text
    covered = 0
    adapter = adapter_of(interp, exprs)
    for expr in exprs:
        if not _plannable(expr) or (_is_step(expr) and len(recorder.steps) == MAX_STEPS):
            break
        if _is_step(expr) and expr.adapter(interp.defaults) != adapter:
            break  # a segment is one sequence's KV, computed under one adapter
        recorder.expr = expr
        try:
            await shadow._execute(expr)
        except Exception:  # noqa: BLE001 - the real run meets the same failure, per call
            break
        covered += 1
        if _is_step(expr):
            recorder.mark = len(shadow.text)
    # Steps recorded by an expression that was not covered (it failed after its call) go.
    steps = recorder.steps[:sum(1 for e in exprs[:covered] if _is_step(e))]
    if len(steps) < 2:
        return None
    return covered, Segment(start_text, tuple(steps), stream=interp.stream), recorder.render


def adapter_of(interp: Any, exprs: Sequence[Expr]) -> str | None:
    """The LoRA adapter of the first step among `exprs` (a segment's, see `plan`)."""
    first = next((e for e in exprs if _is_step(e)), None)
    return None if first is None else first.adapter(interp.defaults)


def _is_step(expr: Expr) -> bool:
    return isinstance(expr, (Gen, Select))


def _plannable(expr: Expr) -> bool:
    """Whether a segment can hold the expression (the queue holds roles as begin and end)."""
    if isinstance(expr, Gen):
        return True
    if isinstance(expr, Select):
        return METHODS.get(expr.method.name) is expr.method
    return isinstance(expr, _PLAIN)


class _Recorder(Backend):
    """The planning backend: records steps, answers with placeholders."""

    def __init__(self, render: Renders) -> None:
        self.render = render
        self.steps: list[Step] = []
        self.shadow: Any = None  # the Interpreter planning runs on
        self.expr: Expr | None = None
        self.mark = 0  # where the text after the last step starts

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        on_delta: OnDelta | None = None) -> Generation:
        assert isinstance(self.expr, Gen)
        if params.n != 1:
            raise ValueError("n: a gen produces one completion")
        dtype = self.expr.dtype
        self.steps.append(GenStep(prompt.text[self.mark:], params,
                                  number=dtype in (int, float)))
        return Generation(_PLACEHOLDER.get(dtype, _PLACEHOLDER_TEXT))

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        assert isinstance(self.expr, Select) and self.shadow is not None
        self.steps.append(SelectStep(self.shadow.text[self.mark:], self.expr.choices,
                                     self.expr.method.name))
        return ChoiceScores([[0.0] for _ in choices],
                            [[0.0] for _ in choices] if unconditional else None)

    async def arender_chat(self, messages: list[dict[str, Any]],
                           add_generation_prompt: bool = False) -> str | None:
        return await self.render(messages, add_generation_prompt)


class Replay(Backend):
    """Answers a segment's calls from its results, in order, while the prompts match."""

    def __init__(self, real: Backend, segment: Segment, stream: SegmentStream,
                 render: Renders) -> None:
        self.real = real
        self.render = render
        self.segment = segment
        self.stream: SegmentStream | None = stream
        self.next_step = 0
        self.text = segment.text  # what the runtime continued, up to the last step's result

    def close(self) -> None:
        """Stop whatever of the segment is still running (the state failed, or is done)."""
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None

    def _take(self, kind: type, prompt_text: str, check: Callable[[Step], bool]) -> Step | None:
        """The next step if it is this call; else the segment is abandoned (None)."""
        if self.stream is None or self.next_step >= len(self.segment.steps):
            self.close()
            return None
        step = self.segment.steps[self.next_step]
        if (not isinstance(step, kind) or prompt_text != self.text + step.before
                or not check(step)):
            self.close()
            return None
        self.next_step += 1
        return step

    async def _events(self, index: int) -> AsyncIterator[SegmentEvent]:
        assert self.stream is not None
        while True:
            event = await self.stream.next()
            if event is None:
                raise RuntimeError(f"the segment ended before its step {index} did")
            assert event.index == index, (event.index, index)
            yield event
            if event.result is not None:
                return

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        on_delta: OnDelta | None = None) -> Generation:
        step = self._take(GenStep, prompt.text, lambda s: s.params == params)
        if step is None:
            return await self.real.agenerate(prompt, params, on_delta)
        assert isinstance(step, GenStep)
        async for event in self._events(self.next_step - 1):
            if event.result is not None:
                self.text = prompt.text + step.appended(event.result.text)
                return Generation(event.result.text, event.result.meta)
            if on_delta is not None and event.delta:
                on_delta(event.delta, event.meta)
        raise AssertionError("unreachable")

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        # The interpreter's select scores after its text without the trailing spaces.
        text = self.text + self._pending_before()
        step = self._take(SelectStep, text, lambda s: (
            text.rstrip(" ") == prefix
            and [text[len(prefix):] + c for c in s.choices] == list(choices)))
        if step is None:
            return await self.real.ascore(prefix, choices, unconditional)
        async for event in self._events(self.next_step - 1):
            if event.result is not None:
                assert event.result.scores is not None
                self.text = text + event.result.text
                return event.result.scores
        raise AssertionError("unreachable")

    def _pending_before(self) -> str:
        if self.next_step < len(self.segment.steps):
            return self.segment.steps[self.next_step].before
        return ""

    async def arender_chat(self, messages: list[dict[str, Any]],
                           add_generation_prompt: bool = False) -> str | None:
        return await self.render(messages, add_generation_prompt)
