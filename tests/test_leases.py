"""Leases (pinned prefixes) and choice scoring: the engine side of the program compile hints."""

from __future__ import annotations

import math

import pytest

from radixlm.runtime import Engine
from radixlm.runtime.scheduling.leases import LeaseTable
from radixlm.runtime.scheduling.pages import PageAllocator
from radixlm.runtime.scheduling.radix_cache import RadixCache

PAGE = 16


def ids(seed: int, length: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(length)]


def no_leak(engine: Engine) -> None:
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]


def test_lease_table_bounds_and_expiry() -> None:
    allocator = PageAllocator(8, 2)
    cache = RadixCache(2, allocator)
    now = [0.0]
    table = LeaseTable(cache, max_pages=3, clock=lambda: now[0])
    node = cache.insert([1, 2, 3, 4], allocator.allocate(2)).node
    other = cache.insert([5, 6, 7, 8], allocator.allocate(2)).node
    first = table.pin(node, ttl=10)
    assert first is not None and cache.evictable_pages == 2
    assert table.pin(other, ttl=10) is None  # 2 + 2 pages > 3: refused, nothing locked
    assert cache.evictable_pages == 2
    now[0] = 11
    assert table.expire() == 1 and len(table) == 0 and table.leased_pages == 0
    assert cache.evictable_pages == 4
    assert not table.release(first)


def test_pinned_prefix_survives_cache_pressure(tiny_chat_model) -> None:
    prefix = ids(1, 5 * PAGE + 3)
    with Engine(str(tiny_chat_model), max_total_tokens=16 * PAGE, page_size=PAGE,
                lease_memory_fraction=0.5) as eng:
        lease = eng.pin_prefix(input_ids=prefix)
        assert lease is not None
        s = eng.stats()
        assert s["leases"] == 1 and s["kv_pages_leased"] == 5
        # Unrelated traffic that needs the whole rest of the pool.
        eng.generate(input_ids=[ids(2 + i, 9 * PAGE) for i in range(3)],
                     sampling_params={"temperature": 0, "max_new_tokens": 4})
        before = eng.stats()["prefill_tokens_computed"]
        out = eng.generate(input_ids=prefix + [7, 8, 9], sampling_params={"max_new_tokens": 1})
        assert out.cached_tokens == 5 * PAGE  # the pinned pages were not evicted
        assert eng.stats()["prefill_tokens_computed"] - before == 6
        assert eng.release_prefix(lease) and not eng.release_prefix(lease)
        assert eng.stats()["leases"] == 0
        no_leak(eng)


def test_pin_refused_over_the_bound_and_short_prefixes(tiny_chat_model) -> None:
    with Engine(str(tiny_chat_model), max_total_tokens=16 * PAGE, page_size=PAGE,
                lease_memory_fraction=0.25) as eng:
        assert eng.pin_prefix(input_ids=ids(3, 5 * PAGE)) is None  # 5 pages > 4 allowed
        assert eng.pin_prefix(input_ids=ids(4, PAGE - 1)) is None  # no whole page to pin
        with pytest.raises(ValueError, match="ttl"):
            eng.pin_prefix(input_ids=ids(4, 20), ttl=0)
        lease = eng.pin_prefix(input_ids=ids(5, 2 * PAGE))
        assert lease is not None
        eng.flush_cache()  # drops leases too
        assert eng.stats()["leases"] == 0 and eng.stats()["kv_pages_cached"] == 0
        no_leak(eng)


def test_score_matches_prompt_logprobs_and_computes_prefix_once(tiny_chat_model) -> None:
    prefix = ids(6, 3 * PAGE + 5)
    choices = [[11, 12], [13], [14, 15, 16]]
    with Engine(str(tiny_chat_model), max_total_tokens=64 * PAGE, page_size=PAGE) as eng:
        scores = eng.score(prefix, choices)
        computed = eng.stats()["prefill_tokens_computed"]
        # The prefix's whole pages once, then each choice with the prefix's partial page.
        assert computed == len(prefix) + sum(len(prefix) % PAGE + len(c) for c in choices[1:]) \
            + len(choices[0])
        for choice, got in zip(choices, scores):
            ref = eng.generate(input_ids=prefix + choice,
                               sampling_params={"max_new_tokens": 0,
                                                "logprob_start_len": len(prefix)})
            assert len(got) == len(choice)
            assert got == pytest.approx([e.logprob for e in ref.prompt_logprobs], abs=1e-5)
            assert all(math.isfinite(x) and x <= 0 for x in got)
        with pytest.raises(ValueError, match="continuation_ids"):
            eng.score(prefix, [])
        no_leak(eng)


def test_leases_give_way_when_nothing_else_can_run(tiny_chat_model) -> None:
    with Engine(str(tiny_chat_model), max_total_tokens=16 * PAGE, page_size=PAGE,
                lease_memory_fraction=0.5) as eng:
        assert eng.pin_prefix(input_ids=ids(7, 8 * PAGE)) is not None
        # Needs 12 of the 16 pages while 8 are leased: the lease must yield, not deadlock.
        out = eng.generate(input_ids=ids(8, 12 * PAGE - 4),
                           sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert out.completion_tokens == 3
        assert eng.stats()["leases"] == 0
        no_leak(eng)
