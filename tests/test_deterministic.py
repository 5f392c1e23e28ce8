"""Deterministic inference on the CPU: what a request gets does not depend on what else runs.

Guaranteed on the default CPU path (the embedded SmolLM2-135M GGUF: int4 blocks, bfloat16
activations) and on the float32 path (`dtype="float32"`): a greedy request's tokens, and its
logprobs and top logprobs, are bit-identical (exact float equality) to those of the same
request run alone on a cold engine with the plain configuration, whatever

- the batch around it: how many requests, its position among them, their prompts (some share
  its prefix) and their parameters (greedy or sampled, some ending before it);
- the chunked prefill size (and the token budget the batch shares);
- the prefix cache: cold, warm (its whole prompt cached) or a partial hit;
- n-gram speculation, or overlap scheduling.

A seeded sampled request (temperature > 0, a seed of its own) is reproducible the same way,
and after all of it every KV page is free or held by the prefix cache.

Each path keeps one reference engine (plain, default chunk size, flushed before each
reference run: every reference is a cold run alone) and an engine for the mode under test,
reused across examples: a model load per example would cost seconds. The tests come in the
order that loads each mode's engine once per path: plain, overlap, ngram.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from test_engine import assert_no_leak

from radixlm.runtime import Engine, Output, SamplingParams

pytestmark = pytest.mark.slow

# Varied text: prose, code, numbers, other scripts, a chat turn, and repetition (which gives
# the n-gram speculator drafts to verify). Prompts are random-length prefixes of their tokens.
TEXTS = [
    "The radix cache keeps every computed prefix in a tree of pages. A request that shares a "
    "prefix with an earlier one reuses its pages instead of computing them again.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n\ndef factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    "<|im_start|>user\nWhy is the sky blue? Answer in two sentences.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Les sanglots longs des violons de l'automne blessent mon coeur d'une langueur monotone.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps "
    "over the lazy dog. The quick brown fox",
    "Question: what is the capital of France?\nAnswer: Paris.\nQuestion: what is the capital "
    "of Italy?\nAnswer:",
]
PATHS: dict[str, dict[str, Any]] = {"default": {}, "float32": {"dtype": "float32"}}
MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "overlap": {"overlap_schedule": "on"},  # on CPU "auto" means off
    "ngram": {"speculative": "ngram"},
}
# A token budget smaller than a full batch's prompts: a request's prefill chunks then also
# depend on its neighbours (the budget they leave), not only on the chunk size.
COMMON: dict[str, Any] = {"max_total_tokens": 8192, "max_num_batched_tokens": 256}


class Budget(NamedTuple):
    new_tokens: int  # of the request under test
    neighbours: int  # at most, around it
    examples: int  # per test


# Up to 16 requests: batched steps of 8 rows or more are where the default path used to
# multiply by other weights (bfloat16 copies) than a lone request's decode. A float32 step
# reads 5 times the bytes: fewer of everything.
BUDGETS = {"default": Budget(16, 15, 6), "float32": Budget(8, 9, 3)}
# A deeper local run: RADIXLM_DETERMINISM_EXAMPLES=10 runs ten times the examples.
SCALE = int(os.environ.get("RADIXLM_DETERMINISM_EXAMPLES", "1"))
CACHE_STATES = ("cold", "warm", "partial")


def check(name: str, examples: int, prop: Callable[[st.DataObject], None]) -> None:
    """Run `prop` on `examples` hypothesis examples, seeded by `name`: the same examples on
    every run (CI never flips on a new draw), other ones per path and mode. No shrinking:
    each example runs the model, and a failing one would shrink for minutes."""
    runner = given(data=st.data())(prop)
    runner = settings(max_examples=examples * SCALE, deadline=None, database=None,
                      phases=(Phase.explicit, Phase.generate),
                      suppress_health_check=[HealthCheck.too_slow])(runner)
    seed(zlib.crc32(name.encode()))(runner)()


def set_chunk_size(engine: Engine, size: int) -> None:
    """Change an idle engine's chunked prefill size. It is engine configuration, and only the
    scheduler reads it (each step): swapping the scheduler's copy saves a model load per
    example."""
    scheduler = engine.core.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, chunked_prefill_size=size)


class PathEngines:
    """One path's engines: the reference, and the engine of the mode in use (switching modes
    closes the previous one, so that at most two engine threads, each with an OpenMP pool of
    its own, share the cores)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.budget = BUDGETS[path]
        self.options = {**COMMON, **PATHS[path]}
        self.reference = Engine(**self.options)
        self._alone: dict[tuple, Output] = {}
        self._mode: str | None = None
        self._engine: Engine | None = None

    def engine(self, mode: str) -> Engine:
        if mode != self._mode:
            if self._engine is not None:
                self._engine.close()
            # A failed load must not leave the closed engine in use.
            self._engine, self._mode = None, None
            self._engine = Engine(**self.options, **MODES[mode])
            self._mode = mode
        return self._engine

    def alone(self, prompt: list[int], params: SamplingParams) -> Output:
        """The request run alone on a cold engine (memoized: examples repeat prompts)."""
        key = (tuple(prompt), params)
        if key not in self._alone:
            self.reference.flush_cache()
            self._alone[key] = self.reference.generate(input_ids=prompt, sampling_params=params)
        return self._alone[key]

    def close(self) -> None:
        self.reference.close()
        if self._engine is not None:
            self._engine.close()


@pytest.fixture(scope="module", params=list(PATHS))
def engines(request: pytest.FixtureRequest, default_model_folder: Any) -> Iterator[PathEngines]:
    """Module-scoped and parametrized: pytest runs every test of one path before the other
    path's, so the first path's engines are closed before the second's load.
    `default_model_folder` skips the tests where the embedded model is missing."""
    built = PathEngines(request.param)
    yield built
    built.close()


@pytest.fixture(scope="module")
def pool(engines: PathEngines) -> list[list[int]]:
    tokenizer = engines.reference.tokenizer
    return [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]


def draw_prompt(data: st.DataObject, pool: list[list[int]], label: str) -> list[int]:
    ids = pool[data.draw(st.integers(0, len(pool) - 1), label=f"{label} text")]
    return ids[: data.draw(st.integers(2, len(ids)), label=f"{label} length")]


def draw_neighbours(data: st.DataObject, pool: list[list[int]],
                    budget: Budget) -> list[tuple[list[int], SamplingParams]]:
    """Other requests: greedy or sampled (unseeded), some ending before the request (none
    after it: the steps after it ends cannot change its output)."""
    neighbours = []
    for i in range(data.draw(st.integers(0, budget.neighbours), label="neighbours")):
        params = SamplingParams(
            max_new_tokens=data.draw(st.integers(1, budget.new_tokens),
                                     label=f"other {i} new tokens"),
            temperature=data.draw(st.sampled_from([0.0, 1.0]), label=f"other {i} temperature"),
            ignore_eos=True)
        neighbours.append((draw_prompt(data, pool, f"other {i}"), params))
    return neighbours


def prepare_cache(data: st.DataObject, engine: Engine, prompt: list[int]) -> str:
    """Cold, or the whole prompt cached, or a prefix of it cached (a partial hit)."""
    engine.flush_cache()
    state = data.draw(st.sampled_from(CACHE_STATES), label="cache")
    if state != "cold":
        cut = len(prompt) if state == "warm" else data.draw(
            st.integers(1, len(prompt) - 1), label="cached prefix")
        engine.generate(input_ids=prompt[:cut],
                        sampling_params={"max_new_tokens": 1, "temperature": 0})
    return state


def run_in_batch(data: st.DataObject, engines: PathEngines, pool: list[list[int]], mode: str,
                 params: SamplingParams) -> None:
    """Draw a prompt, a cache state, a chunk size and a batch around the prompt; the request's
    output in that batch must be the one it gets alone."""
    engine = engines.engine(mode)
    prompt = draw_prompt(data, pool, "request")
    cache = prepare_cache(data, engine, prompt)
    chunk = data.draw(st.one_of(st.integers(1, 64), st.just(512)), label="chunk size")
    set_chunk_size(engine, chunk)
    batch = draw_neighbours(data, pool, engines.budget)
    position = data.draw(st.integers(0, len(batch)), label="position")
    batch.insert(position, (prompt, params))
    # The batch API: one call, every request submitted together; outputs in request order.
    outputs = engine.generate(input_ids=[p for p, _ in batch],
                              sampling_params=[s for _, s in batch])
    got, want = outputs[position], engines.alone(prompt, params)
    where = (f"{engines.path}/{mode}: position {position} of {len(batch)}, chunk {chunk}, "
             f"cache {cache}, prompt of {len(prompt)} tokens")
    assert got.token_ids == want.token_ids, f"tokens differ ({where}); {first_diff(got, want)}"
    # TokenLogprob tuples: token id, logprob and top logprobs, compared with float ==.
    assert got.logprobs == want.logprobs, f"logprobs differ ({where}); {first_diff(got, want)}"
    assert_no_leak(engine)


def first_diff(got: Output, want: Output) -> str:
    for i, (a, b) in enumerate(zip(got.logprobs or [], want.logprobs or [])):
        if a != b:
            return f"first at output token {i}: {a} != alone {b}"
    return f"{got.token_ids} != alone {want.token_ids}"


def test_seeded_sampling_is_batch_invariant(engines: PathEngines,
                                            pool: list[list[int]]) -> None:
    """A sampled request with a seed of its own: same tokens and logprobs as alone. Its own
    generator draws the same noise whatever the batch, so this holds once the logits do."""
    def prop(data: st.DataObject) -> None:
        params = SamplingParams(temperature=0.8, top_p=0.95,
                                seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
                                max_new_tokens=engines.budget.new_tokens, ignore_eos=True,
                                logprobs=True, top_logprobs_num=5)
        run_in_batch(data, engines, pool, "plain", params)
    check(f"seeded/{engines.path}", max(2, engines.budget.examples // 2), prop)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_and_logprobs_are_batch_invariant(engines: PathEngines,
                                                        pool: list[list[int]],
                                                        mode: str) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=engines.budget.new_tokens,
                            ignore_eos=True, logprobs=True, top_logprobs_num=5)

    def prop(data: st.DataObject) -> None:
        run_in_batch(data, engines, pool, mode, params)
    check(f"greedy/{engines.path}/{mode}", engines.budget.examples, prop)


def test_pages_are_accounted_for_after_a_mixed_workload(engines: PathEngines,
                                                        pool: list[list[int]]) -> None:
    """Speculation, tiny chunks, shared prefixes, early and late finishers: afterwards every
    page is free or cached, nothing is locked, and the swapped chunk size took effect."""
    engine = engines.engine("ngram")
    engine.flush_cache()
    # A cached prefix, which the workload's prompts from the first text hit.
    engine.generate(input_ids=pool[0][:20], sampling_params={"max_new_tokens": 1,
                                                             "temperature": 0})
    set_chunk_size(engine, 3)
    steps = engine.stats()["steps"]
    engine.generate(input_ids=pool[2][:12], sampling_params={"max_new_tokens": 1,
                                                             "temperature": 0})
    assert engine.stats()["steps"] - steps == 4  # 12 prompt tokens in chunks of 3
    prompts = [ids[:n] for ids in pool for n in (len(ids) // 3, len(ids))]
    params = [SamplingParams(max_new_tokens=1 + 5 * (i % 4), temperature=(i % 2) * 0.7,
                             ignore_eos=True) for i in range(len(prompts))]
    engine.generate(input_ids=prompts, sampling_params=params)
    assert_no_leak(engine)
    assert_no_leak(engines.reference)
