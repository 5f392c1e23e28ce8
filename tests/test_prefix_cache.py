"""The radix prefix cache inside the engine: hits, sharing, eviction, retraction, control."""

from __future__ import annotations

import threading
import time

import pytest

from radixlm.runtime import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PAGE = 16


def ids(seed: int, length: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(length)]


SYSTEM = ids(1, 70)  # a shared "system prompt"


def workload() -> list[list[int]]:
    shared = [SYSTEM + ids(10 + i, 5 + 3 * i) for i in range(6)]  # shared prefix, own tails
    repeated = [ids(2, 37)] * 3  # identical prompts
    return shared + repeated + [ids(3, 20)]


def no_leak(engine: Engine) -> None:
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]
    assert s["kv_pages_evictable"] == s["kv_pages_cached"]  # no lock left behind


def run(engine: Engine, prompts, params=GREEDY):
    return [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def uncached(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=4096, disable_radix_cache=True) as eng:
        outs = run(eng, workload())
        assert eng.stats()["cached_tokens"] == 0 and eng.stats()["kv_pages_cached"] == 0
        no_leak(eng)
        return outs


def test_greedy_identical_with_cache_on_and_off(tiny_chat_model, uncached):
    with Engine(str(tiny_chat_model), max_total_tokens=4096, page_size=PAGE) as eng:
        assert run(eng, workload()) == uncached
        first = eng.stats()
        assert first["cached_tokens"] > 0
        # A second pass is served mostly from the cache and still gives the same tokens.
        assert run(eng, workload()) == uncached
        second = eng.stats()
        computed = second["prefill_tokens_computed"] - first["prefill_tokens_computed"]
        # Only what lies past each prompt's last whole cached page is computed again.
        assert computed == sum(len(p) - (len(p) - 1) // PAGE * PAGE for p in workload())
        no_leak(eng)


def test_identical_prompt_hit_is_exact(tiny_chat_model):
    prompt = ids(4, 37)
    with Engine(str(tiny_chat_model), max_total_tokens=2048, page_size=PAGE) as eng:
        assert eng.generate(input_ids=prompt, sampling_params=GREEDY).cached_tokens == 0
        again = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert again.cached_tokens == 32  # 37 rounded down to whole pages of 16
        exact = ids(5, 48)  # a page multiple: the last token must still be computed
        eng.generate(input_ids=exact, sampling_params=GREEDY)
        assert eng.generate(input_ids=exact, sampling_params=GREEDY).cached_tokens == 32
        no_leak(eng)


def test_multi_turn_continuation_hits_the_generated_tokens(tiny_chat_model):
    turn1 = ids(6, 30)
    with Engine(str(tiny_chat_model), max_total_tokens=2048, page_size=PAGE) as eng:
        out1 = eng.generate(input_ids=turn1, sampling_params={**GREEDY, "max_new_tokens": 20})
        turn2 = turn1 + out1.token_ids + ids(7, 9)
        out2 = eng.generate(input_ids=turn2, sampling_params=GREEDY)
        # Turn 1 computed KV for its prompt and all but its last generated token.
        assert out2.cached_tokens == (len(turn1) + len(out1.token_ids) - 1) // PAGE * PAGE
        no_leak(eng)


def test_n_samples_share_the_prompt(tiny_chat_model):
    prompt = ids(8, 40)
    with Engine(str(tiny_chat_model), max_total_tokens=2048, page_size=PAGE) as eng:
        outs = eng.generate(input_ids=prompt, sampling_params={
            "n": 4, "temperature": 1.0, "seed": 3, "max_new_tokens": 6, "ignore_eos": True})
        assert [o.cached_tokens for o in outs] == [0, 32, 32, 32]
        # The prompt once, plus each later sample's uncached last 8 tokens.
        assert eng.stats()["prefill_tokens_computed"] == 40 + 3 * 8
        no_leak(eng)


def test_small_pool_evicts_and_retracts_without_changing_outputs(tiny_chat_model):
    # Long generations in a 160-token pool: admission's decode reserve (half the remaining
    # tokens at first) is too small, so running requests must evict and then retract.
    params = {**GREEDY, "max_new_tokens": 60}
    with Engine(str(tiny_chat_model), max_total_tokens=4096, disable_radix_cache=True) as eng:
        reference = run(eng, workload(), params)
    with Engine(str(tiny_chat_model), max_total_tokens=160, page_size=PAGE) as eng:
        assert run(eng, workload(), params) == reference
        stats = eng.stats()
        assert stats["retractions"] > 0 and stats["cached_tokens"] > 0
        no_leak(eng)


def test_fcfs_policy_gives_the_same_outputs(tiny_chat_model, uncached):
    with Engine(str(tiny_chat_model), max_total_tokens=4096, schedule_policy="fcfs") as eng:
        assert run(eng, workload()) == uncached
        no_leak(eng)


def test_flush_cache(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=2048) as eng:
        eng.generate(input_ids=ids(9, 50), sampling_params=GREEDY)
        assert eng.stats()["kv_pages_cached"] > 0
        done = threading.Event()
        long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
        thread = threading.Thread(target=lambda: (eng.generate(input_ids=ids(1, 9),
                                                               sampling_params=long),
                                                  done.set()))
        thread.start()
        while eng.stats()["num_running"] == 0 and not done.is_set():
            time.sleep(0.005)
        if not done.is_set():
            with pytest.raises(ValueError, match="running"):
                eng.flush_cache()
        thread.join(timeout=120)
        eng.flush_cache()
        stats = eng.stats()
        assert stats["kv_pages_cached"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
        again = eng.generate(input_ids=ids(9, 50), sampling_params=GREEDY)
        assert again.cached_tokens == 0


def test_cache_salt_keeps_kv_apart(tiny_chat_model):
    prompt = ids(12, 40)
    with Engine(str(tiny_chat_model), max_total_tokens=2048, page_size=PAGE) as eng:
        base = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="alice")
        other = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="bob")
        same = eng.generate(input_ids=prompt, sampling_params=GREEDY, cache_salt="alice")
        unsalted = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        assert [o.cached_tokens for o in (base, other, same, unsalted)] == [0, 0, 32, 0]
        assert base.token_ids == other.token_ids == same.token_ids == unsalted.token_ids
        with pytest.raises(ValueError, match="cache_salt"):
            eng.generate(input_ids=prompt, cache_salt=3)
        no_leak(eng)


def test_bad_policy_is_named(tiny_chat_model):
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(str(tiny_chat_model), schedule_policy="random")


def test_multi_turn_and_n_samples_identical_with_cache_on_and_off(tiny_chat_model):
    sampled = {"n": 3, "temperature": 0.8, "seed": 11, "max_new_tokens": 8, "ignore_eos": True}
    results = []
    for disable in (True, False):
        with Engine(str(tiny_chat_model), max_total_tokens=2048,
                    disable_radix_cache=disable) as eng:
            turn1 = SYSTEM + ids(20, 9)
            first = eng.generate(input_ids=turn1, sampling_params=GREEDY)
            second = eng.generate(input_ids=turn1 + first.token_ids + ids(21, 7),
                                  sampling_params=GREEDY)
            samples = eng.generate(input_ids=SYSTEM + ids(22, 5), sampling_params=sampled)
            assert (second.cached_tokens > 0) != disable
            assert (samples[1].cached_tokens > 0) != disable
            results.append((first.token_ids, second.token_ids, [o.token_ids for o in samples]))
            no_leak(eng)
    assert results[0] == results[1]
