"""The asyncio frontend: `arun`, `arun_batch`, `text_async_iter` and async programs, with no
thread per program; the same output as the synchronous API."""

from __future__ import annotations

import asyncio
import threading

import pytest

import radixlm as rl
from radixlm.backends.backend import Backend, Generation
from radixlm.runtime import Engine
from radixlm.runtime.programs.choices import ChoiceScores


class SleepyBackend(Backend):
    """Async methods only: each generation sleeps (on the loop) and answers "<n>"; it
    remembers how many generations were in flight at once."""

    supports_cache_hints = True

    def __init__(self, delay: float = 0.05) -> None:
        self.delay = delay
        self.count = 0
        self.in_flight = self.most_in_flight = 0
        self.pins: list[str] = []
        self.released: list[int] = []

    async def agenerate(self, prompt, params, on_delta=None):
        self.count += 1
        text = f"<{self.count}>"
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        if on_delta is not None:
            for ch in text:
                on_delta(ch, {})
        return Generation(text, {"finish_reason": "stop"})

    async def ascore(self, prefix, choices, unconditional):
        return ChoiceScores([[-float(len(c))] for c in choices])

    async def apin_prefix(self, text):
        self.pins.append(text)
        return len(self.pins) - 1

    async def arelease_prefix(self, handle):
        self.released.append(handle)


@rl.function
async def plan_trip(s, city):
    s += f"Trip to {city}. Day 1: " + rl.gen("day1", max_tokens=8)
    first = await s.aget("day1")
    forks = await s.afork(2)
    for i, branch in enumerate(forks):
        branch += f"\nIdea {i} after {first}: " + rl.gen("idea", max_tokens=8)
    ideas = (await forks.ajoin())["idea"]
    s += "\nBest: " + rl.select("best", ideas)


@rl.function
def appends_only(s, topic):
    s += f"About {topic}: " + rl.gen("a", max_tokens=8) + "\nMore: " + rl.gen("b", max_tokens=8)


@rl.function
def reads(s):
    s += "x" + rl.gen("x", max_tokens=2)
    s += s["x"]


def test_a_thousand_programs_on_one_thread():
    """Every run is a task: a backend call that waits holds no thread, so 1,000 programs
    wait at once and the process gains no threads."""
    backend = SleepyBackend()

    async def main():
        before = threading.active_count()
        states = await plan_trip.arun_batch([{"city": f"c{i}"} for i in range(1000)],
                                            backend=backend, concurrency=1000,
                                            progress_bar=False)
        return before, threading.active_count(), states

    before, after, states = asyncio.run(main())
    assert after <= before + 1  # at most the background loop, started by nothing here
    assert backend.most_in_flight >= 1000
    assert all(s.error() is None for s in states)
    assert states[7]["best"] in states[7]["idea"]
    assert sorted(backend.released) == list(range(len(backend.pins)))  # every fork released


def test_async_programs_give_what_run_gives(default_model_folder):
    with Engine(str(default_model_folder)) as engine:
        backend = rl.Engine(engine=engine)
        expected = plan_trip.run(city="Paris", backend=backend, temperature=0)  # sync API
        assert expected.error() is None

        async def main():
            one = await plan_trip.arun(city="Paris", backend=backend, temperature=0)
            batch = await appends_only.arun_batch([{"topic": "owls"}, {"topic": "rain"}],
                                                  backend=backend, temperature=0,
                                                  progress_bar=False)
            streamed = await appends_only.arun(topic="owls", backend=backend, temperature=0,
                                               stream=True)
            pieces = [p async for p in streamed.text_async_iter()]
            return one, batch, streamed, pieces

        one, batch, streamed, pieces = asyncio.run(main())
        assert one.text() == expected.text() and one["best"] == expected["best"]
        plain = appends_only.run(topic="owls", backend=backend, temperature=0)
        assert batch[0].text() == plain.text() == streamed.text() == "".join(pieces)
        assert len(pieces) > 4  # token by token
        s = engine.stats()
        assert s["num_running"] == s["num_waiting"] == s["leases"] == 0
        assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


def test_cancelling_arun_stops_its_requests(default_model_folder):
    with Engine(str(default_model_folder)) as engine:
        backend = rl.Engine(engine=engine)

        @rl.function
        async def long(s):
            s += "Count:" + rl.gen("n", max_tokens=400, ignore_eos=True)
            await s.aget("n")

        async def main():
            task = asyncio.create_task(long.arun(backend=backend, temperature=0))
            while engine.stats()["num_running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        for _ in range(200):  # the abort reaches the engine thread in its next round
            s = engine.stats()
            if s["num_running"] == s["num_waiting"] == 0:
                break
            threading.Event().wait(0.05)
        assert s["num_running"] == s["num_waiting"] == s["leases"] == 0
        assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


def test_a_blocking_read_inside_arun_fails_clearly():
    state = asyncio.run(reads.arun(backend=SleepyBackend(0.0)))
    assert isinstance(state.error(), rl.ProgramError)
    assert "await s.aget(name)" in str(state.error())


def test_plain_programs_run_under_arun_and_async_ones_under_run():
    backend = SleepyBackend(0.0)
    state = asyncio.run(appends_only.arun(topic="x", backend=backend))
    assert state.text() == "About x: <1>\nMore: <2>"
    state = plan_trip.run(city="y", backend=backend)
    assert state["day1"] == "<3>" and state.error() is None
    assert [s.error() for s in plan_trip.run_batch([{"city": "a"}, {"city": "b"}],
                                                   backend=backend, progress_bar=False)] \
        == [None, None]
    with rl.use_backend(backend):  # the caller's context picks the backend
        assert plan_trip.run(city="z").error() is None
