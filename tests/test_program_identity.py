"""Program identity: every request a program run makes carries its id, the engine keeps
per-program statistics, and `priority` orders admission (lower first)."""

from __future__ import annotations

import asyncio

import pytest

import radixlm as rl
from radixlm.runtime import Engine


@pytest.fixture(scope="module")
def engine(default_model_folder):
    with Engine(str(default_model_folder), max_running_requests=1) as eng:
        yield eng


@rl.function
def two_calls(s):
    s += "Colors: red," + rl.gen("a", max_tokens=3) + "\nFruits: apple," + rl.gen("b", max_tokens=3)
    s += "\nSky or sea? " + rl.select("c", ["sky", "sea"])


def test_a_programs_requests_carry_its_id(engine):
    for segments in (True, False):
        backend = rl.Engine(engine=engine)
        backend.supports_segments = segments
        state = two_calls.run(backend=backend, temperature=0)
        assert state.error() is None
        record = engine.stats()["programs"][state.program_id]
        assert record["calls"] == 4  # two gens, and the select's two choices scored
        assert record["service_tokens"] > 6 and record["queue_s"] >= 0
    assert engine.stats()["program_calls"] == 8  # summed over programs (Prometheus's)
    # Forks are the same program; another run is another.
    other = two_calls.run(backend=rl.Engine(engine=engine), temperature=0)
    assert other.program_id != state.program_id
    with pytest.raises(ValueError, match="program_id"):
        engine.generate("x", {"max_new_tokens": 1}, program_id="")
    with pytest.raises(ValueError, match="priority"):
        engine.generate("x", {"max_new_tokens": 1}, priority=1.5)


def test_priority_orders_admission(engine):
    finished: list[str] = []

    async def one(name: str, priority: int) -> None:
        async for out in engine.generate_stream(f"{name}:", {"max_new_tokens": 8,
                                                             "ignore_eos": True},
                                                priority=priority):
            if out.finished:
                finished.append(name)

    async def main() -> None:
        # One request runs at a time: "late" (priority -1) goes before "b", queued earlier.
        await asyncio.gather(one("a", 0), one("b", 0), one("late", -1))

    asyncio.run(main())
    assert finished.index("late") < finished.index("b")


def test_a_programs_context_stays_warm_between_calls(engine):
    prompt = "A long system prompt about many things. " * 8
    first = engine.generate(prompt + "Q1:", {"max_new_tokens": 4}, program_id="warm")
    assert engine.stats()["leases"] == 1  # its prompt and output, pinned for its next call
    second = engine.generate(prompt + "Q1:" + first.text + " Q2:", {"max_new_tokens": 4},
                             program_id="warm")
    assert second.cached_tokens > 0
    assert engine.stats()["leases"] == 1  # moved to the longer context, not two
    assert engine.release_program("warm") and not engine.release_program("warm")
    # A program run releases its pin when it ends.
    two_calls.run(backend=rl.Engine(engine=engine), temperature=0)
    s = engine.stats()
    assert s["leases"] == 0 and s["num_running"] == s["num_waiting"] == 0
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


def test_plas_preempts_a_much_served_program_with_its_output_unchanged(default_model_folder):
    """One running slot, held by a call of a program that has had ~600 tokens of service: a
    new program's request takes the slot at once, and the preempted call, resumed from the
    cache, gives the tokens and logprobs it gives alone."""
    params = {"max_new_tokens": 24, "ignore_eos": True, "logprobs": True, "temperature": 0}
    history = "Notes on rivers and mountains. " * 90  # ~600 prompt tokens of service
    prompt = history + "Next:"
    with Engine(str(default_model_folder), max_running_requests=1,
                program_policy="plas") as engine:
        engine.generate(history, {"max_new_tokens": 1}, program_id="big")
        alone = engine.generate(prompt, params)
        finished: list[str] = []
        outputs = {}

        async def one(name: str, text: str, program: str) -> None:
            async for out in engine.generate_stream(text, params, program_id=program):
                if out.finished:
                    finished.append(name)
                    outputs[name] = out

        async def main() -> None:
            big = asyncio.create_task(one("big", prompt, "big"))
            while engine.stats()["generated_tokens"] < 1 + 24 + 2:  # big is decoding
                await asyncio.sleep(0.005)
            await one("small", "Colors:", "small")
            await big

        asyncio.run(main())
        assert finished == ["small", "big"]
        assert engine.stats()["program_preemptions"] >= 1
        assert outputs["big"].token_ids == alone.token_ids
        assert outputs["big"].logprobs == alone.logprobs
        s = engine.stats()
        assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]
