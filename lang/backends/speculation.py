"""Speculative API execution (`@rl.function(num_api_spec_tokens=N)`, SGLang's name): on an
OpenAI-compatible server, which can only continue a text, a segment's `gen`s share calls.

The first `gen` of a segment asks for N tokens with no stop (fewer when the gens that could
share the call need fewer; a gen that no later gen could share is a plain call), so the model
keeps writing past the gen's end. Each gen then takes its text from that output, cut at its own
stop string or after its `max_tokens` tokens; the literal text the program appends next must
be what the model wrote next, and the following gen continues from there. Where the model
wrote something else, or its output runs out, the next gen makes a new call from the
program's real text. So every gen is answered, in one call per segment when the model follows
the program's pattern and never more calls than one per gen.

What it costs: only the first gen of each call is the text a call of its own would give. The
later ones are what the model wrote in the same breath: the same model and sampling, but the
prompt it continued is its own tokens, not the program's text tokenized afresh, so at a seam
a token may differ (and with greedy decoding the output can then diverge). Counting a later
gen's tokens is approximate where its start falls inside a token. A `select`, a constrained
gen, a gen with other sampling fields than the call's, and logprob requests run as calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from radixlm.backends.backend import Backend, BackendError, Generation, Prompt
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.segment import (
    GenStep,
    Segment,
    SegmentEvent,
    SegmentOps,
    StepResult,
    select_step,
)


@dataclass
class Speculated:
    """One call's output: its text, where each of its tokens ends in the text (None when the
    server did not say), why it ended, and its usage."""

    text: str
    token_ends: list[int] | None
    finish_reason: str | None
    prompt_tokens: int | None
    params: SamplingParams


class SpeculationCalls(SegmentOps, Protocol):
    async def complete(self, text: str, params: SamplingParams,
                       max_tokens: int) -> Speculated:
        """Continue `text` for `max_tokens` tokens, ignoring the params' stops."""
        ...


def speculable(params: SamplingParams) -> bool:
    """Whether a gen can take its text from another gen's call."""
    return (not params.constrained and not params.wants_logprobs and not params.stop_regex
            and not params.stop_token_ids and params.min_new_tokens == 0
            and not params.ignore_eos and not params.no_stop_trim and params.n == 1)


def _same_call(a: SamplingParams, b: SamplingParams) -> bool:
    """Whether two gens sample alike (they may differ in their stops and lengths)."""
    return a.replace(max_new_tokens=0, stop=()) == b.replace(max_new_tokens=0, stop=())


async def speculate(segment: Segment, calls: SpeculationCalls,
                    spec_tokens: int) -> AsyncIterator[SegmentEvent]:
    """The segment's step results, gens answered from shared calls where they can be."""
    text = segment.text
    spec: Speculated | None = None
    used = 0  # characters of spec.text the steps so far took
    for index, step in enumerate(segment.steps):
        if spec is not None:
            if spec.text.startswith(step.before, used):
                used += len(step.before)
            else:  # the model wrote something else than the program's text
                spec = None
        text += step.before
        if not isinstance(step, GenStep):
            spec = None  # the choice scored may not be what the model wrote
            result = await select_step(text, step, calls)
        elif not speculable(step.params):
            spec = None
            result = await _one_call(calls, text, step)
        else:
            taken = None
            if spec is not None and _same_call(spec.params, step.params):
                taken = _take(spec, used, step.params, first=False)
            if taken is None:
                budget = _budget(segment, index, spec_tokens)
                if budget is None:  # no later gen could share the call: a plain one
                    spec = None
                    result = await _one_call(calls, text, step)
                    yield SegmentEvent(index, result=result)
                    text += step.appended(result.text)
                    continue
                spec = await calls.complete(text, step.params, budget)
                used = 0
                taken = _take(spec, used, step.params, first=True)
            if taken is None:  # the server gave no token boundaries: a call of its own
                spec = None
                result = await _one_call(calls, text, step)
            else:
                result, used = taken
                if used == len(spec.text) and spec.finish_reason != "length":
                    spec = None  # the model ended there: the next gen needs a call
        yield SegmentEvent(index, result=result)
        text += step.appended(result.text)


def _budget(segment: Segment, index: int, spec_tokens: int) -> int | None:
    """How many tokens a call made for gen `index` asks for: `spec_tokens`, but never more
    than the gens that could share it can use (their token limits, and the text between them
    at most a token per character), nor less than the gen's own limit. None when no later
    gen could share the call."""
    first = segment.steps[index]
    assert isinstance(first, GenStep)
    need, sharing = first.params.max_new_tokens, 0
    for step in segment.steps[index + 1:]:
        if not (isinstance(step, GenStep) and speculable(step.params)
                and _same_call(step.params, first.params)):
            break
        need += len(step.before) + step.params.max_new_tokens
        sharing += 1
    if not sharing:
        return None
    return max(first.params.max_new_tokens, min(spec_tokens, need))


async def _one_call(calls: SegmentOps, text: str, step: GenStep) -> StepResult:
    result = None
    async for piece in calls.generate(text, step.params, False):
        result = piece.result if piece.result is not None else result
    assert result is not None
    return result


def _take(spec: Speculated, start: int, params: SamplingParams,
          first: bool) -> tuple[StepResult, int] | None:
    """The gen's text from spec.text[start:] and where the next step starts, or None when the
    output does not decide it (it ran out first, or its tokens are unknown)."""
    if spec.token_ends is None:
        return None
    rest = spec.text[start:]
    # The tokens written from `start` on, as ends relative to it (a token that straddles
    # `start` counts as the gen's own).
    ends = [end - start for end in spec.token_ends if end > start]
    limit = params.max_new_tokens
    hits = [(rest.find(stop), stop) for stop in params.stop if stop and stop in rest]
    if hits:
        at, stop = min(hits)
        # The call that generated this gen alone would have stopped at the token that
        # completed the stop string.
        written = next((i + 1 for i, end in enumerate(ends) if end >= at + len(stop)),
                       len(ends))
        if written <= limit:
            return _result(rest[:at], written, "stop", stop, spec, first), start + at
    if len(ends) >= limit:
        cut = ends[limit - 1] if limit else 0
        return _result(rest[:cut], limit, "length", None, spec, first), start + cut
    if spec.finish_reason != "length":  # the model ended its output inside this gen
        return _result(rest, len(ends), spec.finish_reason, None, spec, first), len(spec.text)
    return None


def _result(text: str, tokens: int, finish_reason: str | None, stop: str | None,
            spec: Speculated, first: bool) -> StepResult:
    meta: dict[str, Any] = {"finish_reason": finish_reason, "matched_stop": stop,
                            "completion_tokens": tokens,
                            "prompt_tokens": spec.prompt_tokens if first else None,
                            "speculated": not first}
    return StepResult(text, meta)


# -- chat programs -------------------------------------------------------------------------
# A chat API cannot continue half a message, so without speculation a gen must start an
# assistant message. With it, a message that mixes text and gens ("Name:" + gen + "\nAge:" +
# gen) is one chat call; the reply is matched against the program's text (SGLang's meaning).

MESSAGE_TRIES = 3  # sampled replies that do not follow the program's text are asked again


def match_message(reply: str, parts: list[str | SamplingParams]) -> list[str] | None:
    """Each gen's text in `reply`, for `parts` (the message's literal texts and its gens'
    params, in order), or None when the reply does not follow the literal texts. A gen ends
    at its first stop string, else where the next literal text starts; the last gen ends at
    the reply's end (or before a closing literal text)."""
    texts: list[str] = []
    at = 0
    for i, part in enumerate(parts):
        if isinstance(part, str):
            if not reply.startswith(part, at):
                return None
            at += len(part)
            continue
        following = parts[i + 1] if i + 1 < len(parts) else None
        ends = [reply.find(stop, at) for stop in part.stop if stop and stop in reply[at:]]
        if isinstance(following, str) and following:
            found = reply.find(following, at)
            if found >= 0:
                ends.append(found)
        if ends:
            end = min(ends)
        elif following is None:
            end = len(reply)
        else:
            return None
        texts.append(reply[at:end])
        at = end
    return texts


async def speculate_message(backend: Backend, messages: list[dict[str, Any]],
                            parts: list[str | SamplingParams],
                            spec_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """The gens of an assistant message written in one chat call: (text, meta) per gen."""
    gens = [p for p in parts if isinstance(p, SamplingParams)]
    params = gens[0].replace(max_new_tokens=max(spec_tokens, *(g.max_new_tokens for g in gens)),
                             stop=())
    prompt = Prompt("", [*messages, {"role": "assistant", "content": ""}], "assistant")
    tries = MESSAGE_TRIES if params.temperature > 0 else 1
    for _ in range(tries):
        reply = await backend.agenerate(prompt, params)
        texts = match_message(reply.text, parts)
        if texts is not None:
            meta = {"finish_reason": reply.meta.get("finish_reason"), "speculated": True}
            return [(text, dict(meta)) for text in texts]
    expected = next((p for p in parts if isinstance(p, str)), "")
    raise BackendError(f"num_api_spec_tokens: the model's reply {reply.text[:200]!r} does not "
                       f"follow the program's text (expected {expected!r} around its gens) "
                       f"after {tries} call(s)")


class Answers(Backend):
    """Answers an assistant message's gens from `speculate_message`'s results, in order."""

    def __init__(self, real: Backend, answers: list[tuple[str, dict[str, Any]]]) -> None:
        self.real = real
        self.answers = list(answers)

    async def agenerate(self, prompt: Prompt, params: Any, on_delta: Any = None) -> Generation:
        text, meta = self.answers.pop(0)
        return Generation(text, meta)

    async def arender_chat(self, messages: list[dict[str, Any]],
                           add_generation_prompt: bool = False) -> str | None:
        return await self.real.arender_chat(messages, add_generation_prompt)
