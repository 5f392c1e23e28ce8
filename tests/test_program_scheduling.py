"""The "plas" program policy against a simulated model: the real Scheduler, KV manager and
radix cache, steps that compute what they are given and emit one token per sampled request.
Agent programs submit their next call when the last one ends; single requests come too."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.scheduling import scheduler as scheduler_module
from radixlm.runtime.scheduling.kv_manager import KVManager
from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
from radixlm.runtime.scheduling.radix_cache import RadixCache
from radixlm.runtime.scheduling.request import Request, RequestStatus
from radixlm.runtime.scheduling.scheduler import Scheduler

PAGE = 4
PAGES = 96


class Simulation:
    def __init__(self, policy: str, max_running: int = 4) -> None:
        self.config = EngineConfig(model=None, program_policy=policy, page_size=PAGE,
                                   max_running_requests=max_running,
                                   max_num_batched_tokens=64, chunked_prefill_size=32)
        self.allocator = PageAllocator(PAGES, PAGE)
        table = ReqToTokenTable(max_running, PAGES * PAGE, PAGE, torch.device("cpu"))
        self.cache = RadixCache(PAGE, self.allocator)
        self.kv = KVManager(self.allocator, table, self.cache)
        self.scheduler = Scheduler(self.config, self.kv)
        self.clock = 0.0  # seconds, a step each 0.05
        self.admitted: list[Request] = []
        self.finished: list[Request] = []
        self.ids = itertools.count()

    def submit(self, prompt: list[int], tokens: int, program: str | None = None,
               rank: int = 0) -> Request:
        request = Request(request_id=str(next(self.ids)), prompt_ids=list(prompt),
                          params=SamplingParams(max_new_tokens=tokens),
                          eos_token_ids=frozenset(), detokenizer=None,
                          on_output=lambda out: None, program_id=program, queue_rank=rank)
        request.arrival_time = self.clock
        self.scheduler.add(request)
        return request

    def step(self) -> list[Request]:
        """One step; the requests that finished in it."""
        self.clock += 0.05
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        done = []
        for request, count in zip(batch.requests, batch.num_new_tokens):
            if request not in self.admitted:
                self.admitted.append(request)
            request.num_computed_tokens += count
            self.kv.cache_computed(request)
            if request.num_computed_tokens < len(request.token_ids):
                continue  # a prefill chunk: nothing sampled yet
            if request.num_output_tokens >= request.params.max_new_tokens:
                self.scheduler.finish(request, "length")
                self.scheduler.programs.record(request)
                done.append(request)
            else:
                request.token_ids.append(1000 + len(request.token_ids))
        self.finished += done
        return done


@pytest.fixture()
def fake_clock(monkeypatch):
    """The scheduler reads the simulation's clock (aging), not the wall's."""
    holder: dict[str, Simulation] = {}

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return holder["sim"].clock

    monkeypatch.setattr(scheduler_module, "time", Clock)
    return holder


programs = st.lists(st.tuples(st.integers(1, 8),  # calls
                              st.integers(4, 40),  # prompt growth per call
                              st.integers(1, 12)),  # tokens per call
                    min_size=1, max_size=6)
singles = st.lists(st.tuples(st.integers(0, 60),  # arrival step
                             st.integers(2, 30), st.integers(1, 8)), max_size=12)
groups = st.lists(st.integers(2, 4), max_size=3)  # HTTP requests of several prompts


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(programs=programs, singles=singles, groups=groups,
       policy=st.sampled_from(["plas", "fcfs"]))
def test_every_request_finishes_fairly_and_no_page_leaks(fake_clock, programs, singles,
                                                         groups, policy):
    sim = Simulation(policy)
    fake_clock["sim"] = sim
    remaining = {f"p{i}": calls for i, (calls, _, _) in enumerate(programs)}
    context = {f"p{i}": [i + 1] * 8 for i in range(len(programs))}
    shape = {f"p{i}": (grow, tokens) for i, (_, grow, tokens) in enumerate(programs)}
    last: dict[str, Request] = {}

    def next_call(pid: str) -> None:
        grow, tokens = shape[pid]
        context[pid] += [len(context[pid]) % 50 + 1] * grow
        last[pid] = sim.submit(context[pid], tokens, pid)
        remaining[pid] -= 1

    for pid in remaining:
        next_call(pid)
    group_requests = [[sim.submit([90 + g] * 6, 3, None, rank) for rank in range(size)]
                      for g, size in enumerate(groups)]
    pending = sorted(singles)
    total = sum(calls for calls, _, _ in programs) + len(singles) + sum(groups)
    for step in range(4000):
        while pending and pending[0][0] <= step:
            _, length, tokens = pending.pop(0)
            sim.submit([77] * length, tokens)
        for request in sim.step():
            pid = request.program_id
            if pid is not None and last.get(pid) is request and remaining[pid]:
                next_call(pid)  # the agent's next call, right away (no tool latency here)
        if len(sim.finished) == total:
            break
    assert len(sim.finished) == total, "a request was never served"
    assert all(r.status is RequestStatus.FINISHED for r in sim.finished)
    # Within one HTTP request, the prompts are admitted in their order.
    for requests in group_requests:
        order = [sim.admitted.index(r) for r in requests]
        assert order == sorted(order)
    assert not sim.scheduler.has_work
    assert sim.allocator.num_free + sim.cache.total_pages == PAGES


def test_plas_lets_a_new_program_pass_a_long_one(fake_clock):
    """With one request running at a time, a program that has had much service waits behind
    a newcomer; under fcfs the newcomer waits behind it."""
    order = {}
    for policy in ("plas", "fcfs"):
        sim = Simulation(policy, max_running=1)
        fake_clock["sim"] = sim
        for _ in range(3):  # "big" has had service: three calls of 200 tokens
            sim.submit([5] * 8, 200, "big")
            while not sim.step():
                pass
        big = sim.submit([5] * 8, 50, "big")
        sim.submit([6] * 8, 50, "busy")  # runs now; the two above wait behind it
        sim.step()
        small = sim.submit([7] * 8, 5, "small")
        while len(sim.finished) < 6:
            sim.step()
        order[policy] = sim.finished.index(small) < sim.finished.index(big)
    assert order == {"plas": True, "fcfs": False}


def test_a_forked_program_counts_its_longest_branch(fake_clock):
    """Four parallel branches of 150 tokens attain the service of one (its critical path), four
    sequential calls of 150 the sum: after both, a new call of the forked program goes first."""
    sim = Simulation("plas", max_running=1)
    fake_clock["sim"] = sim
    for rank in range(4):  # the fork: every branch arrives before any finishes
        sim.submit([5] * 8 + [rank], 150, "forked")
    while len(sim.finished) < 4:
        sim.step()
    for _ in range(4):
        sim.submit([6] * 8, 150, "serial")
        while not sim.step():
            pass
    programs = sim.scheduler.programs
    assert programs.attained("forked") < 200 < 600 < programs.attained("serial")
    assert programs.snapshot()["forked"]["service_tokens"] > 600  # the total still counts
    sim.submit([7] * 8, 50, "busy")
    sim.step()  # runs now; the two below wait behind it
    serial = sim.submit([6] * 8, 5, "serial")
    forked = sim.submit([5] * 8, 5, "forked")
    while len(sim.finished) < 11:
        sim.step()
    assert sim.finished.index(forked) < sim.finished.index(serial)


def test_plas_preempts_a_much_served_program_for_a_new_one(fake_clock):
    """With the only running slot held by a program that has had much service, a newcomer
    takes the slot under plas (the other resumes after, from the cache, with its output
    unchanged); under fcfs it waits."""
    outcome = {}
    for policy in ("plas", "fcfs"):
        sim = Simulation(policy, max_running=1)
        fake_clock["sim"] = sim
        for _ in range(4):  # "big" has had ~1,000 tokens of service: level 3
            sim.submit([5] * 8, 250, "big")
            while not sim.step():
                pass
        big = sim.submit([5] * 8, 60, "big")
        for _ in range(10):
            sim.step()
        small = sim.submit([7] * 8, 5, "small")
        while len(sim.finished) < 6:
            sim.step()
        assert big.num_output_tokens == 60
        assert sim.allocator.num_free + sim.cache.total_pages == PAGES
        outcome[policy] = (sim.finished.index(small) < sim.finished.index(big),
                           sim.scheduler.num_preemptions)
    assert outcome == {"plas": (True, 1), "fcfs": (False, 0)}
