"""Segments: the expressions a program queues between two reads run in the engine as one
request, and give the same output as one call per gen (radixlm/segments.py,
runtime/programs/segment.py). The default model (SmolLM2-135M-Instruct), greedy."""

from __future__ import annotations

import pytest

import radixlm as rl
from radixlm import segments
from radixlm.runtime import Engine
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.programs.segment import GenStep, Segment, SelectStep


@pytest.fixture(scope="module")
def engine(default_model_folder):
    with Engine(str(default_model_folder)) as eng:
        yield eng


@pytest.fixture()
def replayed(monkeypatch) -> list[bool]:
    """Per call a replay answered: True when it came from the segment."""
    taken: list[bool] = []
    take = segments.Replay._take

    def spy(self, *args, **kwargs):
        step = take(self, *args, **kwargs)
        taken.append(step is not None)
        return step

    monkeypatch.setattr(segments.Replay, "_take", spy)
    return taken


def uncached(meta: dict) -> dict:
    """Meta info but the cache hits (the second run of a program hits more)."""
    return {k: v for k, v in meta.items() if k != "cached_tokens"}


def no_leak(engine: Engine) -> None:
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == s["leases"] == 0
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


@rl.function
def chat(s):
    s += rl.system("You answer briefly.")
    s += rl.user("Name a planet.")
    s += rl.assistant(rl.gen("planet", max_tokens=8))
    s += rl.user("And its color?")
    s += rl.assistant(rl.gen("color", max_tokens=6, stop="."))


@rl.function
def seams(s):
    # Text glued to generated text, so the tokens across each seam merge differently from
    # the pieces' own tokens.
    s += "Fruits: apple, ban" + rl.gen("a", max_tokens=3, stop=",") + "anas,che"
    s += rl.gen("b", max_tokens=4) + "rry" + rl.gen("c", max_tokens=3, stop="\n") + "!"


@rl.function
def typed(s):
    s += "Q: How many legs has a spider?\nA: " + rl.gen("legs", dtype=int)
    s += "\nIs that more than a cat? " + rl.select("more", ["yes", "no"])
    s += "\nPick a vowel: " + rl.gen("vowel", regex="[aeiou]", return_logprob=True,
                                     top_logprobs_num=2)
    s += "\nA color: " + rl.select("c1", ["red", "green"], choices_method=rl.greedy_token_selection)
    s += " or " + rl.select("c2", ["blue", "dark blue"],
                            choices_method=rl.unconditional_likelihood_normalized)
    with s.var_scope("tail"):
        s += " because " + rl.gen("why", max_tokens=5)


@pytest.mark.parametrize("program", [chat, seams, typed], ids=["chat", "seams", "typed"])
def test_a_segment_gives_what_calls_give(engine, replayed, program):
    per_call = rl.Engine(engine=engine)
    per_call.supports_segments = False
    expected = program.run(backend=per_call, temperature=0)
    assert expected.error() is None
    assert not replayed
    state = program.run(backend=rl.Engine(engine=engine), temperature=0)
    assert state.error() is None
    assert state.text() == expected.text()
    for name in expected._interp.vars:
        assert state[name] == expected[name], name
    for name in expected._interp.meta:
        assert uncached(state.get_meta_info(name)) == uncached(expected.get_meta_info(name))
    assert replayed and all(replayed)  # every call was answered by the segment
    no_leak(engine)


def test_streaming_and_forks_read_one_by_one(engine):
    @rl.function
    def fork_reads(s):
        s += "Three colors:"
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f" color {i} is" + rl.gen("x", max_tokens=3) + ", then" + rl.gen(
                "y", max_tokens=3)
        s["first"] = [branch["x"] for branch in forks]
        forks.join()

    per_call = rl.Engine(engine=engine)
    per_call.supports_segments = False
    expected = fork_reads.run(backend=per_call, temperature=0)
    state = fork_reads.run(backend=rl.Engine(engine=engine), temperature=0, stream=True)
    assert "".join(state.text_iter()) == expected.text()
    assert state["first"] == expected["first"] and state["y"] == expected["y"]
    no_leak(engine)


def test_a_wrong_plan_falls_back_to_calls(engine, replayed, monkeypatch):
    """A segment whose text does not match what the program appends (a template the planner
    guessed wrong) is cancelled at that step; the program continues call by call."""
    plan = segments.plan

    async def wrong(interp, exprs):
        planned = await plan(interp, exprs)
        if planned is None:
            return None
        count, segment, renders = planned
        steps = list(segment.steps)
        steps[1] = GenStep("something else" + steps[1].before, steps[1].params)
        return count, Segment(segment.text, tuple(steps)), renders

    per_call = rl.Engine(engine=engine)
    per_call.supports_segments = False
    expected = chat.run(backend=per_call, temperature=0)
    monkeypatch.setattr(segments, "plan", wrong)
    state = chat.run(backend=rl.Engine(engine=engine), temperature=0)
    assert state.text() == expected.text()
    assert replayed[:2] == [True, False]
    no_leak(engine)


def test_a_failing_step_fails_the_program_as_a_call_would(engine):
    @rl.function
    def bad(s):
        s += "A: " + rl.gen("a", max_tokens=3) + "\nB: " + rl.gen("b", regex="(")
        s += "\nC: " + rl.gen("c", max_tokens=3)

    per_call = rl.Engine(engine=engine)
    per_call.supports_segments = False
    expected = bad.run(backend=per_call, temperature=0)
    state = bad.run(backend=rl.Engine(engine=engine), temperature=0)
    assert type(state.error()) is type(expected.error())
    assert str(state.error()) == str(expected.error())
    assert state["a"] == expected["a"]
    with pytest.raises(rl.ProgramError):
        state["c"]
    no_leak(engine)


def test_segment_bounds():
    gen = GenStep("", SamplingParams())
    with pytest.raises(ValueError, match="steps"):
        Segment("", ())
    with pytest.raises(ValueError, match="steps"):
        Segment("", (gen,) * 65)
    with pytest.raises(ValueError, match="method"):
        Segment("", (SelectStep("", ("a",), "my_method"),))
