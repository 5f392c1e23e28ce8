"""A segment: a run of a program's steps that the runtime executes as one request.

A program's Python code reads values only at some points. Between two reads its expressions
(text, `gen`, `select`, roles) are known in advance, so the interpreter sends them as one
segment: the state's text so far, then steps, each the text to append before it and a `gen`
or a `select`. `run_segment` executes them in order without a round trip to the program:
generate the first variable until its stop, append the next text, continue with the next
`gen`, score a `select` in place and append the choice. Each step sees exactly the prompt the
program's own per-call path would send (the whole text so far, tokenized as a request's text
always is), so the results are the same; the interpreter checks that on replay
(radixlm/segments.py).

Events stream per step: a gen's pieces as they are generated, then each step's result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from radixlm.runtime.programs.choices import METHODS, ChoiceScores

MAX_STEPS = 64  # steps in one segment: its cost is bounded before it starts


@dataclass(frozen=True)
class GenStep:
    before: str  # text appended to the state before this step
    params: Any  # what the ops generate with: SamplingParams, or on the server a body
    # int and float gens: what the state keeps of the text ends before a trailing space or
    # newline (the regex lets the model end the number with one; see expr.NUMBER_END).
    number: bool = False

    def appended(self, text: str) -> str:
        return text.rstrip(" \n") if self.number else text


@dataclass(frozen=True)
class SelectStep:
    before: str
    choices: tuple[str, ...]
    method: str  # a name in choices.METHODS


Step = GenStep | SelectStep


@dataclass(frozen=True)
class Segment:
    text: str  # the state's text before the first step
    steps: tuple[Step, ...]
    # Stream each gen's text as it is generated; without it only step results come, which
    # costs less (the program streams nothing).
    stream: bool = True

    def __post_init__(self) -> None:
        if not 1 <= len(self.steps) <= MAX_STEPS:
            raise ValueError(f"steps: a segment has 1 to {MAX_STEPS} steps, got "
                             f"{len(self.steps)}")
        for i, step in enumerate(self.steps):
            if isinstance(step, SelectStep):
                if step.method not in METHODS:
                    raise ValueError(f"steps[{i}].method: unknown choices method "
                                     f"{step.method!r} (one of {', '.join(METHODS)})")
                if not step.choices:
                    raise ValueError(f"steps[{i}].choices must not be empty")
            elif not isinstance(step, GenStep):
                raise TypeError(f"steps[{i}]: a GenStep or a SelectStep, got "
                                f"{type(step).__name__}")


@dataclass
class StepResult:
    text: str  # a gen's whole text as generated (before `number` trimming), a select's choice
    meta: dict[str, Any]
    scores: ChoiceScores | None = None  # a select's token logprobs


@dataclass
class SegmentEvent:
    index: int  # the step
    delta: str = ""  # a new piece of a gen's text
    meta: dict[str, Any] = field(default_factory=dict)  # the piece's meta
    result: StepResult | None = None  # the step's result: its last event


@dataclass
class GenPiece:
    """What SegmentOps.generate yields: new text with its meta, and last the whole result."""

    delta: str
    meta: dict[str, Any]
    result: StepResult | None = None


class SegmentOps(Protocol):
    """How a segment reaches the model: the same calls the per-call path makes."""

    def generate(self, text: str, params: Any, stream: bool) -> AsyncIterator[GenPiece]:
        """The gen's pieces as they come (only with `stream`), then its result."""
        ...

    async def score(self, prefix: str, choices: list[str],
                    unconditional: bool) -> ChoiceScores: ...


async def run_segment(segment: Segment, ops: SegmentOps) -> AsyncIterator[SegmentEvent]:
    """Execute the steps in order. A failing step raises out of the iteration: the rest of
    the segment does not run."""
    text = segment.text
    for index, step in enumerate(segment.steps):
        text += step.before
        if isinstance(step, GenStep):
            result = None
            async for piece in ops.generate(text, step.params, segment.stream):
                if piece.result is not None:
                    result = piece.result
                elif piece.delta or piece.meta:  # meta alone: tokens that added no text
                    yield SegmentEvent(index, piece.delta, piece.meta)
            if result is None:
                raise RuntimeError(f"step {index}: the generation ended without a result")
            text += step.appended(result.text)
        else:
            result = await select_step(text, step, ops)
            text += result.text
        yield SegmentEvent(index, result=result)


async def select_step(text: str, step: SelectStep, ops: SegmentOps) -> StepResult:
    """As the interpreter's select: the choices scored after the text without its trailing
    spaces, each choice with them in front (BPE words carry their leading space)."""
    method = METHODS[step.method]
    stem = text.rstrip(" ")
    space = text[len(stem):]
    scores = await ops.score(stem, [space + c for c in step.choices],
                             method.needs_unconditional)
    choice = step.choices[method(scores).index]
    return StepResult(choice, {}, scores)
