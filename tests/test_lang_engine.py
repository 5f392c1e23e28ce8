"""Programs end to end on the default model (SmolLM2-135M-Instruct) with the local engine."""

from __future__ import annotations

import asyncio

import pytest

import radixlm as rl
from radixlm.runtime import Engine

PAGE = 16


@pytest.fixture(scope="module")
def engine(default_model_folder):
    with Engine(str(default_model_folder)) as eng:
        yield eng


@pytest.fixture(scope="module")
def backend(engine):
    return rl.Engine(engine=engine)


def no_leak(engine: Engine) -> None:
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == s["leases"] == 0
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


FEW_SHOT = ("The capital of Germany is Berlin.\nThe capital of Spain is Madrid.\n"
            "The capital of Canada is Ottawa.\n")


@rl.function
def capital(s, country):
    s += FEW_SHOT + "The capital of " + country + " is"
    s += rl.gen("city", max_tokens=4, stop=[".", "\n"])


def test_few_shot_batch_answers_in_order(engine, backend):
    expected = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Egypt": "Cairo",
                "Russia": "Moscow", "Greece": "Athens"}
    states = capital.run_batch([{"country": c} for c in expected], backend=backend,
                               temperature=0, progress_bar=False)
    assert [s["city"].strip() for s in states] == list(expected.values())
    no_leak(engine)


def test_gen_int_select_and_roles(engine, backend):
    @rl.function
    def quiz(s):
        s += rl.user("How many legs does a spider have? Answer with a number.")
        s += rl.assistant("A spider has " + rl.gen_int("legs", max_tokens=4) + " legs.")
        s += rl.user("Is the sky usually blue or green on a clear day?")
        s += rl.assistant("It is " + rl.select("colour", choices=["blue", "green"]))

    state = quiz.run(backend=backend, temperature=0)
    assert isinstance(state["legs"], int)
    assert state["colour"] == "blue"
    messages = state.messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1]["content"] == "It is blue"
    assert state.text().startswith("<|im_start|>system\n")  # the template's default system
    no_leak(engine)


def test_fork_join_three_branches(engine, backend):
    @rl.function
    def tips(s, topic):
        s += rl.user(f"Give one short tip about {topic}.")
        s += rl.assistant(rl.gen("tip", max_tokens=16))
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += rl.user(f"Rephrase the tip, version {i + 1}.")
            f += rl.assistant(rl.gen("rephrased", max_tokens=12))
        out = s.join(forks)
        s += rl.user("Summarise.") + rl.assistant(rl.gen("summary", max_tokens=12))
        return out

    state = tips.run(topic="sleep", backend=backend, temperature=0)
    assert state.error() is None
    assert len(state["rephrased"]) == 3 and all(isinstance(t, str) for t in state["rephrased"])
    assert state["summary"]
    no_leak(engine)


def test_streaming_matches_non_streaming(engine, backend):
    @rl.function
    def story(s):
        s += rl.user("Tell me a two-sentence story about a cat.")
        s += rl.assistant(rl.gen("story", max_tokens=24))

    plain = story.run(backend=backend, temperature=0)
    streamed = story.run(backend=backend, temperature=0, stream=True)
    pieces = list(streamed.text_iter("story"))
    assert len(pieces) > 3
    assert "".join(pieces) == streamed["story"] == plain["story"]
    assert streamed.text() == plain.text()


def test_min_tokens_is_respected(engine, backend):
    @rl.function
    def short(s):
        s += rl.user("Say OK.") + rl.assistant(rl.gen("a", max_tokens=20, min_tokens=12))

    state = short.run(backend=backend, temperature=0)
    assert state.get_meta_info("a")["completion_tokens"] >= 12


def test_fork_prefix_is_computed_once_under_cache_pressure(tiny_chat_model):
    """A fork of 4 branches over a ~300-token prefix. Between branches, unrelated traffic
    fills the small pool; without the fork's lease the prefix is evicted and recomputed (the
    same program with cache hints off shows that the pool is small enough). A tiny model with
    the real tokenizer: the pages matter here, not the text."""
    paragraph = ("Radix trees store strings by their shared prefixes, so that common "
                 "beginnings are kept once. ") * 16

    def run(cache_hints: bool) -> tuple[int, list[int]]:
        # The baseline pins nothing: no fork pins, and no program context kept warm.
        with Engine(str(tiny_chat_model), max_total_tokens=64 * PAGE, page_size=PAGE,
                    lease_memory_fraction=0.5, program_ttl=10.0 if cache_hints else 0) as eng:
            backend = rl.Engine(engine=eng, cache_hints=cache_hints)
            # Two unrelated 600-token prompts between branches: the second one needs pages
            # that only evicting the least recently used prefix can give.
            fillers = [[1000 + 37 * i + j for j in range(600)] for i in range(8)]

            @rl.function
            def branches(s):
                s += paragraph
                forks = s.fork(4)
                for i, f in enumerate(forks):
                    f += f" Question {i}:" + rl.gen("x", max_tokens=2, ignore_eos=True)
                    f["x"]  # one branch at a time, with other traffic in between
                    for filler in fillers[2 * i: 2 * i + 2]:
                        eng.generate(input_ids=filler, sampling_params={"max_new_tokens": 1})
                s.join(forks)

            before = eng.stats()["prefill_tokens_computed"]
            state = branches.run(backend=backend, temperature=0)
            assert state.error() is None
            computed = eng.stats()["prefill_tokens_computed"] - before - 8 * 600
            cached = [m["cached_tokens"] for m in state.get_meta_info("x")]
            no_leak(eng)
            return computed, cached

    with Engine(str(tiny_chat_model), max_total_tokens=4 * PAGE) as eng:
        prefix = len(eng.tokenizer.encode(paragraph))
    assert 280 <= prefix <= 340
    computed, cached = run(cache_hints=True)
    # The prefix once, then per branch its suffix and the prefix's last partial page.
    assert computed <= prefix + 4 * (8 + 2 * PAGE)
    # The fork's pin does not block the branches, so the first branch may compute the prefix
    # itself (the pin then hits); every later branch must hit it despite the fillers.
    assert sorted(cached)[1] >= (prefix // PAGE - 1) * PAGE
    unpinned, cached_unpinned = run(cache_hints=False)
    assert unpinned >= computed + prefix  # evicted and recomputed at least once
    assert sorted(cached_unpinned)[1] < PAGE  # a later branch missed too, not only the first


def test_logprobs_in_sglangs_shape_whole_and_streamed(engine, backend):
    @rl.function
    def answer(s):
        s += "The capital of France is" + rl.gen("city", max_tokens=6, return_logprob=True,
                                                 top_logprobs_num=2)

    whole = answer.run(backend=backend, temperature=0).get_meta_info("city")
    entries = whole["output_token_logprobs"]
    assert whole["output_token_logprobs_length"] == len(entries) == whole["completion_tokens"]
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in entries)
    assert [len(t) for t in whole["output_top_logprobs"]] == [2] * len(entries)

    async def pieces(state):
        return [p async for p in state.text_async_iter("city", return_meta_data=True)]

    streamed = asyncio.run(pieces(answer.run(backend=backend, temperature=0, stream=True)))
    got = [e for _, meta in streamed for e in meta["output_token_logprobs"]]
    assert [e[1] for e in got] == [e[1] for e in entries]  # each token's entry exactly once
    assert streamed[-1][1]["output_token_logprobs_length"] == len(entries)
    no_leak(engine)
