"""Tests for radixlm.runtime.replicas.routing: each policy's contract, cache-aware affinity,
balance, sticky sessions and restarts, and the routed-prefix tree against a naive model."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.replicas.routed_prefixes import RoutedPrefixes
from radixlm.runtime.replicas.routing import (
    POLICIES,
    CacheAwareRouter,
    NoHealthyReplica,
    ReplicaLoad,
    RouteRequest,
    cache_capacity,
    make_router,
    prefix_key,
)

IDLE = ReplicaLoad()


def loads(*totals: int, down: tuple[int, ...] = ()) -> list[ReplicaLoad]:
    return [ReplicaLoad(running=t, healthy=i not in down) for i, t in enumerate(totals)]


def prompt(prefix: int, suffix: int, length: int = 400) -> RouteRequest:
    """`length` tokens shared by every prompt with the same `prefix`, then 8 of its own."""
    rng = random.Random(prefix)
    shared = [rng.randrange(32_000) for _ in range(length)]
    return RouteRequest(token_ids=shared + [suffix] * 8)


def test_make_router_knows_the_policies():
    for policy in POLICIES:
        assert make_router(policy, 3).num_replicas == 3
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router("random", 3)
    with pytest.raises(ValueError):
        make_router("round_robin", 0)
    with pytest.raises(TypeError):
        make_router("round_robin", 2, overload_abs=3)


@pytest.mark.parametrize("policy", POLICIES)
def test_unhealthy_replicas_never_chosen(policy):
    router = make_router(policy, 4)
    for i in range(40):
        request = prompt(i % 3, i) if i % 2 else RouteRequest(text=f"hello {i}", session="s")
        assert router.choose(request, loads(0, 0, 0, 0, down=(1, 3))) in (0, 2)
    with pytest.raises(NoHealthyReplica):
        router.choose(RouteRequest(), loads(0, 0, 0, 0, down=(0, 1, 2, 3)))
    with pytest.raises(ValueError, match="3 loads for 4 replicas"):
        router.choose(RouteRequest(), loads(0, 0, 0))


def test_round_robin_goes_in_order_skipping_the_unhealthy():
    router = make_router("round_robin", 3)
    assert [router.choose(RouteRequest(), [IDLE] * 3) for _ in range(4)] == [0, 1, 2, 0]
    assert [router.choose(RouteRequest(), loads(9, 0, 0, down=(2,))) for _ in range(3)] == [1, 0, 1]


def test_least_load_picks_the_minimum_and_rotates_ties():
    router = make_router("least_load", 4)
    assert router.choose(RouteRequest(), loads(5, 3, 1, 2)) == 2
    assert router.choose(RouteRequest(), loads(0, 3, 1, 2, down=(0,))) == 2
    router = make_router("least_load", 3)
    assert [router.choose(RouteRequest(), loads(4, 4, 4)) for _ in range(3)] == [0, 1, 2]


def test_outstanding_requests_are_a_floor_on_load():
    # Load reports that never change (stale): the router's own count still spreads a burst.
    router = make_router("least_load", 3)
    picks = [router.choose(RouteRequest(), [IDLE] * 3) for _ in range(9)]
    assert sorted(picks) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert router.outstanding() == [3, 3, 3]
    router.finished(1, RouteRequest())
    assert router.choose(RouteRequest(), [IDLE] * 3) == 1
    router.replica_reset(2)
    assert router.outstanding() == [3, 3, 0]


def test_cache_aware_keeps_a_shared_prefix_on_one_replica():
    router = make_router("cache_aware", 8, overload_abs=16)
    # Forks of one program arrive together, none finished yet: they follow the first, up to
    # overload_abs + 1 of them while the other replicas are idle.
    forks = [router.choose(prompt(7, i), [IDLE] * 8) for i in range(17)]
    assert len(set(forks)) == 1
    # Other prefixes spread over the other replicas (least loaded first).
    others = {router.choose(prompt(100 + p, 0), [IDLE] * 8) for p in range(7)}
    assert forks[0] not in others and len(others) == 7
    assert router.decisions["prefix"] == 16
    # The others hold one request each now: forks go home until 1 + 16 are there.
    assert router.choose(prompt(7, 17), [IDLE] * 8) == forks[0]
    assert router.choose(prompt(7, 18), [IDLE] * 8) != forks[0]


def test_cache_aware_leaves_an_overloaded_replica():
    router = CacheAwareRouter(4, overload_abs=8, overload_rel=1.5)
    home = router.choose(prompt(1, 0), [IDLE] * 4)
    busy = [ReplicaLoad(running=40 if i == home else 10) for i in range(4)]
    spilled = router.choose(prompt(1, 1), busy)
    assert spilled != home and router.decisions["spill"] == 1
    # Both now hold the prefix: the next one goes to the less loaded of the two.
    busy[spilled] = ReplicaLoad(running=12)
    assert router.choose(prompt(1, 2), busy) == spilled
    # A prefix only one replica holds stays there while its load is within either bound.
    home = router.choose(prompt(2, 0), [IDLE] * 4)
    for load, stays in ((48, True), (49, False)):  # 48 <= 1.5 x 32, 49 > 32 + 8 and 1.5 x 32
        others = loads(*[load if i == home else 32 for i in range(4)])
        assert (router.choose(prompt(2, load), others) == home) == stays


def test_cache_aware_ignores_short_matches():
    router = CacheAwareRouter(4, min_match=64)
    first = router.choose(prompt(3, 0, length=30), [IDLE] * 4)
    # 30 shared tokens are not worth a replica: the next goes to the least loaded one.
    assert router.choose(prompt(3, 1, length=30), loads(*[1 if i == first else 0
                                                         for i in range(4)])) != first


def test_cache_aware_sessions_are_sticky():
    router = make_router("cache_aware", 4)
    home = router.choose(RouteRequest(text="turn one", session="alice"), [IDLE] * 4)
    for turn in range(5):  # unrelated prompts, other replicas lighter: still home
        light = loads(*[3 if i == home else 0 for i in range(4)])
        assert router.choose(RouteRequest(text=f"q{turn}", session="alice"), light) == home
    # Unhealthy home: the session moves, and stays where it moved.
    moved = router.choose(RouteRequest(session="alice"), loads(0, 0, 0, 0, down=(home,)))
    assert moved != home
    assert router.choose(RouteRequest(session="alice"), [IDLE] * 4) == moved


def test_cache_aware_session_map_is_bounded():
    router = CacheAwareRouter(4, max_sessions=10)
    for i in range(100):
        router.choose(RouteRequest(session=f"user{i}"), [IDLE] * 4)
    assert len(router._sessions) == 10 and "user99" in router._sessions


def test_cache_aware_routes_text_on_its_prefix():
    router = make_router("cache_aware", 4)  # overload_abs 8: 9 requests may share one
    system = "You are a careful assistant. " * 10
    picks = {router.choose(RouteRequest(text=system + f"Question {i}?"), [IDLE] * 4)
             for i in range(9)}
    assert len(picks) == 1
    # The same words as token ids are another key: text and tokens never match each other.
    assert prefix_key(RouteRequest(token_ids=[ord(c) for c in system]))[1:] == system
    assert RoutedPrefixes(1, 100).match(prefix_key(RouteRequest(text=system))) == {}


def test_odd_token_ids_never_fail_a_request():
    folded = "T" + chr(0x10FFFF) + chr(2**40 % 0x110000)
    assert prefix_key(RouteRequest(token_ids=[-1, 2**40])) == folded
    assert prefix_key(RouteRequest(token_ids=[[1, 2], [3]])) == ""  # type: ignore[list-item]
    assert prefix_key(RouteRequest(token_ids=[])) == prefix_key(RouteRequest()) == ""
    router = make_router("cache_aware", 2)
    assert router.choose(RouteRequest(token_ids=[[1, 2]]), [IDLE] * 2) in (0, 1)  # type: ignore


def test_replica_reset_forgets_its_prefixes_and_sessions():
    router = make_router("cache_aware", 3)
    home = router.choose(RouteRequest(token_ids=list(range(500)), session="bob"), [IDLE] * 3)
    assert router.tree.match(prefix_key(RouteRequest(token_ids=list(range(500))))) == {home: 501}
    router.replica_reset(home)
    assert router.tree.units(home) == 0 and router.tree.num_nodes() == 0
    assert "bob" not in router._sessions
    # With nothing remembered, the next request goes by load alone.
    lighter = (home + 1) % 3
    busy = loads(*[0 if i == lighter else 5 for i in range(3)])
    assert router.choose(RouteRequest(token_ids=list(range(500)), session="bob"), busy) == lighter


def test_memory_stays_bounded_under_many_distinct_prompts():
    router = CacheAwareRouter(8, tree_capacity=5_000)
    rng = random.Random(0)
    for i in range(3_000):
        unique = [rng.randrange(50_000) for _ in range(rng.randrange(1, 300))]
        ids = [rng.randrange(8)] * 20 + unique
        replica = router.choose(RouteRequest(token_ids=ids, session=str(i)), [IDLE] * 8)
        router.finished(replica, RouteRequest())
    tree = router.tree
    assert all(tree.units(r) <= 5_000 for r in range(8))
    assert tree.num_nodes() <= 8 * 5_000
    assert all(len(heap) <= 2 * tree._held[r] + 64 for r, heap in enumerate(tree._heaps))
    check_tree(tree, 8)


def check_tree(tree: RoutedPrefixes, num_replicas: int) -> None:
    """Per replica: units and node counts agree with the nodes; holders of a node hold its
    parent; nobody-held nodes are gone."""
    units, held = [0] * num_replicas, [0] * num_replicas
    stack = [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.key[0] == first and child.parent is node
            assert child.holders, "a node nobody holds must be removed"
            assert child.end == node.end + len(child.key)
            if node is not tree.root:
                assert set(child.holders) <= set(node.holders)
            for r in child.holders:
                units[r] += len(child.key)
                held[r] += 1
            stack.append(child)
    assert units == [tree.units(r) for r in range(num_replicas)]
    assert held == tree._held


def common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


keys = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(
    lambda ids: "".join(chr(65 + i) for i in ids))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(keys, st.integers(0, 2)), max_size=40), st.lists(keys, max_size=8))
def test_tree_matches_the_longest_routed_prefix_like_a_naive_model(inserts, queries):
    tree = RoutedPrefixes(3, capacity=10_000)  # nothing evicted
    sent: list[set[str]] = [set(), set(), set()]
    for key, replica in inserts:
        tree.insert(key, replica)
        sent[replica].add(key)
        check_tree(tree, 3)
    for query in queries + [k for k, _ in inserts]:
        naive = {r: max(common(query, k) for k in sent[r]) for r in range(3) if sent[r]}
        assert tree.match(query) == {r: n for r, n in naive.items() if n > 0}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(keys, st.integers(0, 1)), max_size=60), st.integers(4, 20))
def test_tree_under_eviction_stays_within_capacity_and_keeps_the_newest(inserts, capacity):
    tree = RoutedPrefixes(2, capacity=capacity)
    sent: list[set[str]] = [set(), set()]
    for key, replica in inserts:
        tree.insert(key, replica)
        sent[replica].add(key)
        check_tree(tree, 2)
        assert tree.units(replica) <= capacity
        if len(key) <= capacity:  # the newest prompt is the last to go
            assert tree.match(key).get(replica) == len(key)
        # Eviction only forgets: nothing is matched that was not routed there.
        for r, n in tree.match(key).items():
            assert n <= max(common(key, k) for k in sent[r])


def test_per_program_stats_are_merged_across_replicas():
    from radixlm.runtime.replicas.replica_set import merge_programs

    merged: dict = {}
    merge_programs(merged, {"agent": {"calls": 2, "queue_s": 0.5, "service_tokens": 40,
                                      "cached_tokens": 16, "last_seen": 10.0}})
    merge_programs(merged, {"agent": {"calls": 1, "queue_s": 0.25, "service_tokens": 8,
                                      "cached_tokens": 32, "last_seen": 7.0},
                            "chat": {"calls": 1, "queue_s": 0.0, "service_tokens": 5,
                                     "cached_tokens": 0, "last_seen": 9.0}})
    assert merged == {"agent": {"calls": 3, "queue_s": 0.75, "service_tokens": 48,
                                "cached_tokens": 48, "last_seen": 10.0},
                      "chat": {"calls": 1, "queue_s": 0.0, "service_tokens": 5,
                               "cached_tokens": 0, "last_seen": 9.0}}


def test_a_replica_with_a_disk_tier_keeps_its_prefixes_over_a_restart():
    router = make_router("cache_aware", 3)
    home = router.choose(RouteRequest(token_ids=list(range(500)), session="bob"), [IDLE] * 3)
    router.replica_reset(home, keeps_cache=True)
    assert router.tree.units(home) == 501 and router.outstanding()[home] == 0
    lighter = (home + 1) % 3
    busy = loads(*[0 if i == lighter else 2 for i in range(3)])
    assert router.choose(RouteRequest(token_ids=list(range(500))), busy) == home


def test_the_routed_capacity_counts_the_cache_tiers():
    pool = {"kv_pages_total": 1000, "page_size": 16}
    assert cache_capacity(pool) == 16_000
    assert cache_capacity({**pool, "host_pages_total": 3000}) == 64_000
    assert cache_capacity({**pool, "host_pages_total": 3000, "disk_pages_total": 6000}) \
        == 160_000
