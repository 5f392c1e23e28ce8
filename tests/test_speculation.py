"""Speculative API execution (num_api_spec_tokens): a segment's gens answered from shared
calls (radixlm/backends/speculation.py), against a scripted model whose every call is
counted, and end to end through rl.OpenAI on our server's /v1/completions."""

from __future__ import annotations

import asyncio

from radixlm.backends.speculation import Speculated, speculate
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.segment import GenPiece, GenStep, Segment, StepResult

# The scripted model continues a text that is a prefix of WORLD with the rest of WORLD (and
# anything else with "?!"), two characters per token, then ends (EOS).
WORLD = "Animals:\nNote 1: cats purr\nNote 2: dogs bark\nNote 3: owls hoot at night\n"


class ScriptedModel:
    def __init__(self) -> None:
        self.completions: list[tuple[str, int]] = []
        self.calls: list[str] = []

    def continuation(self, text: str, max_tokens: int) -> tuple[str, list[int], str]:
        rest = WORLD[len(text):] if WORLD.startswith(text) else "?!"
        tokens = [rest[i:i + 2] for i in range(0, len(rest), 2)]
        cut = tokens[:max_tokens]
        ends, at = [], 0
        for token in cut:
            at += len(token)
            ends.append(at)
        return "".join(cut), ends, "length" if len(tokens) > max_tokens else "stop"

    async def complete(self, text, params, max_tokens):
        self.completions.append((text, max_tokens))
        out, ends, finish = self.continuation(text, max_tokens)
        return Speculated(out, ends, finish, len(text), params)

    async def generate(self, text, params, stream):  # one call per gen, with its stops
        self.calls.append(text)
        out, _, _ = self.continuation(text, params.max_new_tokens)
        hits = [out.find(s) for s in params.stop if s in out]
        yield GenPiece("", {}, StepResult(out[:min(hits)] if hits else out, {}))

    async def score(self, prefix, choices, unconditional):
        raise AssertionError("no select here")


def run(steps, spec_tokens=64) -> tuple[list[str], list[dict], ScriptedModel]:
    model = ScriptedModel()

    async def main():
        return [e.result async for e in speculate(Segment("Animals:\n", tuple(steps)), model,
                                                  spec_tokens)]

    results = asyncio.run(main())
    return [r.text for r in results], [r.meta for r in results], model


def gen(before: str, max_tokens: int = 8, stop=("\n",), **fields) -> GenStep:
    return GenStep(before, SamplingParams(**{"max_new_tokens": max_tokens, "stop": stop,
                                             "temperature": 0, **fields}))


def test_a_program_that_follows_the_model_makes_one_call():
    texts, metas, model = run([gen("Note 1:"), gen("\nNote 2:"), gen("\nNote 3:")])
    # Gen 3 stops at its 8 tokens, before its stop string.
    assert texts == [" cats purr", " dogs bark", " owls hoot at ni"]
    # The call asks for what the three gens can use (8 tokens each, the text between them
    # at most a token per character), less than the 64 allowed.
    assert model.completions == [("Animals:\nNote 1:", 40)] and not model.calls
    assert [m["speculated"] for m in metas] == [False, True, True]
    assert metas[2]["finish_reason"] == "length" and metas[2]["completion_tokens"] == 8
    assert metas[0]["finish_reason"] == "stop" and metas[0]["matched_stop"] == "\n"


def test_where_the_program_writes_something_else_the_next_gen_calls_again():
    texts, _, model = run([gen("Note 1:"), gen("\nNote 9:"), gen("\nNote 3:")])
    # "Note 9:" is not what the model wrote: the next gen continues the program's real text,
    # and the last one, which no gen could share, is a plain call.
    assert [t for t, _ in model.completions] == [
        "Animals:\nNote 1:", "Animals:\nNote 1: cats purr\nNote 9:"]
    assert model.calls == ["Animals:\nNote 1: cats purr\nNote 9:?!\nNote 3:"]
    assert texts == [" cats purr", "?!", "?!"]


def test_output_that_runs_out_calls_again():
    # 14 tokens end inside gen 2 and again inside gen 3: each calls from its own text.
    steps = [gen("Note 1:"), gen("\nNote 2:"), gen("\nNote 3:", 40)]
    texts, metas, model = run(steps, spec_tokens=14)
    assert texts == [" cats purr", " dogs bark", " owls hoot at night"]
    assert [m.get("speculated") for m in metas] == [False, False, None]
    assert len(model.completions) == 2 and len(model.calls) == 1
    # A gen that asks for more tokens than the speculation gets them in its call.
    steps = [gen("Note 1:"), gen("\nNote 2:", 40), gen("\nNote 3:", 40)]
    texts, metas, model = run(steps, spec_tokens=8)
    assert texts == [" cats purr", " dogs bark", " owls hoot at night"]
    assert [m["speculated"] for m in metas] == [False, False, True]


def test_a_model_that_ends_its_output_ends_the_gen():
    texts, metas, model = run([gen("Note 1:", 100, stop=()), gen("x")])
    assert texts == [WORLD[len("Animals:\nNote 1:"):], "?!"]
    assert metas[0]["finish_reason"] == "stop" and len(model.completions) == 1


def test_what_cannot_share_a_call_is_a_call_of_its_own():
    _, _, model = run([gen("Note 1:"), gen("\nNote 2:", regex="[a-z ]+"), gen("\nNote 3:"),
                       gen("\nNote 4:")])
    # Gens 1 and 2 are plain calls; 3 calls for 3 and 4, where the model writes no "Note 4".
    assert len(model.calls) == 3 and len(model.completions) == 1
    # A gen that samples differently from the call starts a new one.
    _, _, model = run([gen("Note 1:"), gen("\nNote 2:"), gen("\nNote 3:", temperature=0.5),
                       gen("\nNote 4:", temperature=0.5)])
    assert [text[-7:] for text, _ in model.completions] == ["Note 1:", "Note 3:"]


def test_a_chat_message_is_matched_against_the_programs_text():
    from radixlm.backends.speculation import match_message

    name, age = SamplingParams(stop=("\n",)), SamplingParams()
    parts = ["Name:", name, "\nAge:", age]
    assert match_message("Name: Ada\nAge: 36", parts) == [" Ada", " 36"]
    assert match_message("Name: Ada Lovelace\nAge: 36\n", parts) == [" Ada Lovelace", " 36\n"]
    assert match_message("Who: Ada\nAge: 36", parts) is None  # the reply wrote other text
    # A gen without a stop ends where the next text starts; a closing text ends the last.
    parts = ["Name:", age, "\nAge:", age, "."]
    assert match_message("Name: Ada\nAge: 36.", parts) == [" Ada", " 36"]
    assert match_message("Name: Ada", parts) is None
