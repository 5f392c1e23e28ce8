"""Tests for radixlm.runtime.scheduling.radix_cache: a hypothesis state machine against a naive
model (a flat dict from page-aligned prefixes to pages), plus unit tests of the tricky cases."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixlm.runtime.scheduling.pages import PageAllocator
from radixlm.runtime.scheduling.radix_cache import RadixCache, TreeNode

Key = tuple[Hashable, tuple[int, ...]]  # (namespace, page-aligned token prefix)


class RecordingAllocator(PageAllocator):
    """A real allocator that also records each `free` call (the cache frees one node per call)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.free_calls: list[list[int]] = []

    def free(self, pages: list[int]) -> None:
        self.free_calls.append(list(pages))
        super().free(pages)

    def free_list(self) -> list[int]:
        return list(self._free)


class NaiveCache:
    """The cache as a flat dict: each page-aligned prefix maps to the page holding its last
    page of tokens. Lock counts and access times are kept per prefix too."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: dict[Key, int] = {}
        self.locks: dict[Key, int] = {}
        self.stamp: dict[Key, int] = {}
        self.clock = 0

    def keys(self, namespace: Hashable, tokens: Sequence[int]) -> list[Key]:
        """The page-aligned prefixes of `tokens`, shortest first."""
        n = len(tokens) // self.ps
        return [(namespace, tuple(tokens[:(i + 1) * self.ps])) for i in range(n)]

    def touch(self, keys: list[Key]) -> None:
        self.clock += 1
        for k in keys:
            self.stamp[k] = self.clock

    def match(self, namespace: Hashable, tokens: Sequence[int],
              max_tokens: int | None = None) -> list[int]:
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        matched = []
        for k in self.keys(namespace, tokens[:limit]):
            if k not in self.pages:
                break
            matched.append(k)
        self.touch(matched)
        return [self.pages[k] for k in matched]

    def insert(self, namespace: Hashable, tokens: Sequence[int],
               pages: Sequence[int]) -> tuple[int, list[int]]:
        keys = self.keys(namespace, tokens)
        existing = 0
        while existing < len(keys) and keys[existing] in self.pages:
            existing += 1
        for k, page in zip(keys[existing:], pages[existing:]):
            self.pages[k] = page
            self.locks[k] = 0
        self.touch(keys)
        return existing * self.ps, [self.pages[k] for k in keys]

    def lock(self, namespace: Hashable, tokens: Sequence[int], delta: int) -> None:
        for k in self.keys(namespace, tokens):
            self.locks[k] += delta

    def evict(self, num_pages: int) -> list[int]:
        """Pages freed, in order: always the least recently used unlocked page-leaf."""
        order = []
        while len(order) < num_pages:
            parents = {(ns, prefix[:-self.ps]) for ns, prefix in self.pages}
            leaves = [k for k in self.pages if k not in parents and self.locks[k] == 0]
            if not leaves:
                break
            oldest = min(self.stamp[k] for k in leaves)
            victims = [k for k in leaves if self.stamp[k] == oldest]
            assert len(victims) == 1, "LRU order must be unambiguous among leaves"
            order.append(self.pages.pop(victims[0]))
            del self.locks[victims[0]], self.stamp[victims[0]]
        return order

    def reset(self) -> None:
        self.pages.clear()
        self.locks.clear()
        self.stamp.clear()


def path_of(node: TreeNode) -> tuple[Hashable, tuple[int, ...]]:
    """(namespace, the full token prefix ending at node), walking up to the root."""
    keys = []
    while not node.is_root:
        keys.append(node.key)
        node = node.parent
    return node.namespace, tuple(t for key in reversed(keys) for t in key)


class Lease(NamedTuple):
    """A lock the test holds, as a running request would."""
    namespace: Hashable
    tokens: tuple[int, ...]
    pages: list[int]
    node: TreeNode


NUM_PAGES = 24
NAMESPACES = st.sampled_from([None, "adapter-a"])
# Sequences are built from 3 page patterns, so prefixes collide often. With page_size 4 the
# patterns share leading tokens: a page that differs only at its end must not match.
PATTERNS = {1: [(0,), (1,), (2,)], 4: [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0)]}
MAX_SEQ_PAGES = 6
PAGE_IDS = st.lists(st.integers(0, 2), max_size=MAX_SEQ_PAGES)
# Most sequences extend a prefix of an earlier insert, so that matches hit, splits happen
# inside locked nodes, and evictions race with locks; None draws a fresh sequence.
BASES = st.none() | st.integers(0, 1000)
KEEPS = st.integers(0, MAX_SEQ_PAGES)
MAX_TOKENS = st.none() | st.integers(0, 26)
TAILS = st.lists(st.integers(0, 1), max_size=3)  # a partial page, ignored by matching


class RadixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: RadixCache | None = None

    @initialize(page_size=st.sampled_from([1, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.alloc = RecordingAllocator(NUM_PAGES, page_size)
        self.cache = RadixCache(page_size, self.alloc)
        self.model = NaiveCache(page_size)
        self.leases: list[Lease] = []
        self.history: list[list[int]] = [[]]  # page ids of recent inserts

    def page_ids(self, base: int | None, keep: int, suffix: list[int]) -> list[int]:
        prefix = [] if base is None else self.history[base % len(self.history)][:keep]
        return (prefix + suffix)[:MAX_SEQ_PAGES]

    def tokens(self, page_ids: list[int], tail: Sequence[int] = ()) -> list[int]:
        body = [t for i in page_ids for t in PATTERNS[self.ps][i]]
        return body + list(tail[:self.ps - 1])

    def evict_both(self, num_pages: int) -> int:
        self.alloc.free_calls.clear()
        freed = self.cache.evict(num_pages)
        calls, expected = self.alloc.free_calls, self.model.evict(num_pages)
        assert freed == len(expected) == sum(map(len, calls))
        assert freed == num_pages or (freed < num_pages and self.cache.evictable_pages == 0)
        # Each call frees one node; its pages must be the next ones in the naive LRU order.
        start = 0
        for call in calls:
            assert sorted(call) == sorted(expected[start:start + len(call)])
            start += len(call)
        return freed

    def allocate(self, num_pages: int) -> list[int] | None:
        pages = self.alloc.allocate(num_pages)
        if pages is None:  # what the scheduler does under memory pressure
            self.evict_both(num_pages - self.alloc.num_free)
            pages = self.alloc.allocate(num_pages)
        return pages

    # Hypothesis picks among rules uniformly, so the common operations get two rules each.

    @rule(namespace=NAMESPACES, base=BASES, keep=KEEPS, suffix=PAGE_IDS)
    def insert(self, namespace: Hashable, base: int | None, keep: int,
               suffix: list[int]) -> None:
        self.do_insert(namespace, self.page_ids(base, keep, suffix), reuse=False)

    @rule(namespace=NAMESPACES, base=BASES, keep=KEEPS, suffix=PAGE_IDS)
    def serve_request(self, namespace: Hashable, base: int | None, keep: int,
                      suffix: list[int]) -> None:
        self.do_insert(namespace, self.page_ids(base, keep, suffix), reuse=True)

    def do_insert(self, namespace: Hashable, page_ids: list[int], reuse: bool) -> None:
        self.history = [page_ids, *self.history[:7]]
        tokens = self.tokens(page_ids)
        cached: list[int] = []
        lease = None
        if reuse:  # as a request does: match, lock, compute the rest, insert, unlock
            m = self.cache.match_prefix(tokens, namespace)
            assert m.pages == self.model.match(namespace, tokens)
            self.cache.lock(m.node)
            self.model.lock(namespace, tokens[:m.num_tokens], +1)
            cached, lease = m.pages, Lease(namespace, tuple(tokens[:m.num_tokens]), m.pages,
                                           m.node)
        fresh = self.allocate(len(page_ids) - len(cached))
        if fresh is not None:
            mine = cached + fresh
            result = self.cache.insert(tokens, mine, namespace)
            assert (result.num_existing_tokens, result.pages) == self.model.insert(
                namespace, tokens, mine)
            assert path_of(result.node) == (namespace, tuple(tokens))
            # The caller frees its own duplicates; pages it got from the match are the tree's.
            self.alloc.free([p for p, q in zip(mine, result.pages) if p != q])
        if lease is not None:
            self.cache.unlock(lease.node)
            self.model.lock(namespace, lease.tokens, -1)

    @rule(namespace=NAMESPACES, base=BASES, keep=KEEPS, suffix=PAGE_IDS, tail=TAILS,
          max_tokens=MAX_TOKENS)
    def match(self, namespace: Hashable, base: int | None, keep: int, suffix: list[int],
              tail: list[int], max_tokens: int | None) -> None:
        self.do_match(namespace, self.page_ids(base, keep, suffix), tail, max_tokens, False)

    @rule(namespace=NAMESPACES, base=BASES, keep=KEEPS, suffix=PAGE_IDS, tail=TAILS,
          max_tokens=MAX_TOKENS)
    def match_and_lock(self, namespace: Hashable, base: int | None, keep: int,
                       suffix: list[int], tail: list[int], max_tokens: int | None) -> None:
        self.do_match(namespace, self.page_ids(base, keep, suffix), tail, max_tokens, True)

    def do_match(self, namespace: Hashable, page_ids: list[int], tail: list[int],
                 max_tokens: int | None, lock: bool) -> None:
        tokens = self.tokens(page_ids, tail)
        result = self.cache.match_prefix(tokens, namespace, max_tokens)
        assert result.pages == self.model.match(namespace, tokens, max_tokens)
        assert result.num_tokens == len(result.pages) * self.ps
        assert path_of(result.node) == (namespace, tuple(tokens[:result.num_tokens]))
        if lock:
            self.cache.lock(result.node)
            self.model.lock(namespace, tokens[:result.num_tokens], +1)
            self.leases.append(Lease(namespace, tuple(tokens[:result.num_tokens]),
                                     result.pages, result.node))

    def release(self, index: int) -> None:
        lease = self.leases.pop(index)
        self.cache.unlock(lease.node)
        self.model.lock(lease.namespace, lease.tokens, -1)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        self.release(data.draw(st.integers(0, len(self.leases) - 1)))

    @rule(num_pages=st.integers(0, 10))
    def evict(self, num_pages: int) -> None:
        self.evict_both(num_pages)

    @rule(release_first=st.booleans(), roll=st.integers(0, 5))
    def reset(self, release_first: bool, roll: int) -> None:
        if roll:
            return  # a reset wipes the state the other rules build up: make it rare
        if release_first:
            while self.leases:
                self.release(0)
        if any(not lease.node.is_root for lease in self.leases):
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return  # the invariants check that nothing changed
        self.cache.reset()
        self.model.reset()
        assert self.alloc.num_free == NUM_PAGES

    @invariant()
    def matches_naive_model(self) -> None:
        if self.cache is None:
            return
        tree: dict[Key, int] = {}
        locks: dict[Key, int] = {}
        counts = {True: 0, False: 0}  # locked -> pages
        for namespace, prefix, node in self.cache.walk():
            assert node.key and len(node.key) % self.ps == 0
            assert len(node.value) * self.ps == len(node.key)
            assert node.parent.children[node.key[:self.ps]] is node
            start = len(prefix) - len(node.key)
            for i, page in enumerate(node.value):
                key = (namespace, prefix[:start + (i + 1) * self.ps])
                tree[key], locks[key] = page, node.lock_count
            counts[node.lock_count > 0] += len(node.value)
        assert tree == self.model.pages
        assert locks == self.model.locks
        assert self.cache.evictable_pages == counts[False]
        assert self.cache.protected_pages == counts[True]
        assert self.cache.total_pages == len(tree)

    @invariant()
    def every_page_has_one_owner(self) -> None:
        if self.cache is None:
            return
        held = self.cache.held_pages()
        assert sorted(self.alloc.free_list() + held) == list(range(NUM_PAGES))

    @invariant()
    def leases_still_hold_their_pages(self) -> None:
        if self.cache is None:
            return
        for lease in self.leases:
            # Locking a root (an empty match) is a no-op.
            assert lease.node.is_root or (lease.node.attached and lease.node.lock_count > 0)
            assert path_of(lease.node) == (lease.namespace, lease.tokens)
            keys = self.model.keys(lease.namespace, lease.tokens)
            assert [self.model.pages[k] for k in keys] == lease.pages


TestRadixCacheStateMachine = RadixCacheMachine.TestCase
TestRadixCacheStateMachine.settings = settings(deadline=None, database=None, max_examples=300,
                                               stateful_step_count=40)


# ---- unit tests of the cases the state machine reaches only by luck ----


def make_cache(num_pages: int = 16, page_size: int = 2) -> tuple[RadixCache, RecordingAllocator]:
    alloc = RecordingAllocator(num_pages, page_size)
    return RadixCache(page_size, alloc), alloc


def insert_fresh(cache: RadixCache, alloc: PageAllocator, tokens: list[int],
                 namespace: Hashable = None) -> list[int]:
    """Insert with freshly allocated pages and free the duplicates, as the scheduler does."""
    mine = alloc.allocate(len(tokens) // cache.page_size)
    result = cache.insert(tokens, mine, namespace)
    alloc.free([p for p, q in zip(mine, result.pages) if p != q])
    return result.pages


def test_split_on_partial_match_keeps_lock_counts() -> None:
    cache, alloc = make_cache()
    pages = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6])
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(full.node)
    cache.lock(full.node)
    assert (cache.protected_pages, cache.evictable_pages) == (3, 0)

    half = cache.match_prefix([1, 2, 3, 4, 9, 9])  # ends inside the node: split after 2 pages
    assert half.pages == pages[:2] and half.num_tokens == 4
    assert full.node.parent is half.node and full.node.key == (5, 6)
    assert half.node.lock_count == full.node.lock_count == 2  # both locks cover the head
    assert (cache.protected_pages, cache.evictable_pages) == (3, 0)

    cache.unlock(full.node)
    cache.unlock(full.node)
    assert half.node.lock_count == full.node.lock_count == 0
    assert (cache.protected_pages, cache.evictable_pages) == (0, 3)
    with pytest.raises(ValueError):
        cache.unlock(full.node)


def test_lock_of_child_survives_later_split_above_it() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).node
    cache.lock(node)
    insert_fresh(cache, alloc, [1, 2, 7, 7])  # splits the locked node after its first page
    assert cache.evict(100) == 1  # only the new unlocked leaf (7, 7)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).num_tokens == 6
    cache.unlock(node)
    assert cache.evict(100) == 3 and alloc.num_free == 16


def test_evict_is_lru_and_frees_parents_once_they_become_leaves() -> None:
    cache, alloc = make_cache()
    a = insert_fresh(cache, alloc, [1, 2, 3, 4])  # [1 2] -> {[3 4], [5 6]}
    b = insert_fresh(cache, alloc, [1, 2, 5, 6])
    cache.match_prefix([1, 2, 3, 4])  # now [5 6] is the least recently used leaf
    alloc.free_calls.clear()
    assert cache.evict(1) == 1 and alloc.free_calls == [[b[1]]]
    assert cache.evict(1) == 1 and alloc.free_calls[-1] == [a[1]]
    assert cache.match_prefix([1, 2, 3, 4]).pages == [a[0]]
    assert cache.evict(1) == 1 and alloc.free_calls[-1] == [a[0]]  # the parent, now a leaf
    assert cache.total_pages == 0 and alloc.num_free == 16
    assert cache.evict(1) == 0


def test_interior_nodes_on_a_path_count_as_used() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, alloc, [1, 2])  # X
    v = cache.insert([7, 8], alloc.allocate(1))  # V, used after X
    insert_fresh(cache, alloc, [1, 2, 3, 4])  # Y under X: X is used again, after V
    cache.lock(v.node)
    assert cache.evict(1) == 1  # Y; X is now a leaf, last used with Y
    cache.unlock(v.node)
    alloc.free_calls.clear()
    assert cache.evict(1) == 1
    assert alloc.free_calls == [v.pages]  # V is older than X


def test_evict_trims_the_tail_of_the_last_leaf() -> None:
    cache, alloc = make_cache()
    pages = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.evict(1) == 1
    assert alloc.free_calls[-1] == [pages[3]]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == pages[:3]
    assert cache.evict(5) == 3 and alloc.num_free == 16


def test_trimmed_head_keeps_its_age() -> None:
    cache, alloc = make_cache()
    v = cache.insert([7, 8], alloc.allocate(1))  # V, older
    n = insert_fresh(cache, alloc, [1, 2, 3, 4])  # N, newer
    cache.lock(v.node)
    assert cache.evict(1) == 1 and alloc.free_calls[-1] == [n[1]]  # N trimmed to its head
    cache.unlock(v.node)
    assert cache.evict(1) == 1 and alloc.free_calls[-1] == v.pages  # the head is still newer


def test_locked_pages_are_never_evicted() -> None:
    cache, alloc = make_cache()
    a = insert_fresh(cache, alloc, [1, 2, 3, 4])
    insert_fresh(cache, alloc, [1, 2, 5, 6])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.lock(node)
    assert cache.evict(100) == 1  # only [5 6]; [1 2] is covered by the lock on [3 4]
    assert cache.match_prefix([1, 2, 3, 4]).pages == a
    assert (cache.protected_pages, cache.evictable_pages) == (2, 0)


def test_evicted_node_cannot_be_locked() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, alloc, [1, 2])
    node = cache.match_prefix([1, 2]).node
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(node)


def test_namespaces_do_not_match_each_other() -> None:
    cache, alloc = make_cache()
    base = insert_fresh(cache, alloc, [1, 2, 3, 4])
    other = insert_fresh(cache, alloc, [1, 2, 3, 4], namespace="adapter-a")
    assert not set(base) & set(other)
    assert cache.match_prefix([1, 2, 3, 4]).pages == base
    assert cache.match_prefix([1, 2, 3, 4], namespace="adapter-a").pages == other
    miss = cache.match_prefix([1, 2, 3, 4], namespace="salt-b")
    assert miss.pages == [] and miss.num_tokens == 0 and miss.node.is_root
    cache.lock(miss.node)  # locking a root is a no-op
    cache.unlock(miss.node)
    assert cache.total_pages == 4


def test_reset_refuses_while_locked_then_frees_everything() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, alloc, [1, 2, 3, 4])
    insert_fresh(cache, alloc, [5, 6], namespace="adapter-a")
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.total_pages == 3 and alloc.num_free == 13
    cache.unlock(node)
    cache.reset()
    assert cache.total_pages == 0 and alloc.num_free == 16 and cache.held_pages() == []
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    with pytest.raises(ValueError):
        cache.lock(node)  # gone with the tree


def test_insert_of_existing_prefix_returns_tree_pages() -> None:
    cache, alloc = make_cache()
    first = insert_fresh(cache, alloc, [1, 2, 3, 4])
    mine = alloc.allocate(3)
    result = cache.insert([1, 2, 3, 4, 5, 6], mine)
    assert result.num_existing_tokens == 4
    assert result.pages == first + mine[2:]
    assert result.node.key == (5, 6) and result.node.value == mine[2:]
    # Wholly existing, ending inside a node: split so that the node ends exactly there.
    again = cache.insert([1, 2], [99])
    assert again == (2, first[:1], again.node) and again.node.key == (1, 2)
    assert cache.total_pages == 3


def test_insert_and_match_reject_or_round_partial_pages() -> None:
    cache, alloc = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [0, 1])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [0])
    pages = insert_fresh(cache, alloc, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 9]).pages == pages[:1]  # whole pages only
    assert cache.match_prefix([1, 2, 3]).pages == pages[:1]
    assert cache.match_prefix([1, 2, 3, 4], max_tokens=3).pages == pages[:1]
    assert cache.match_prefix([1, 2, 3, 4], max_tokens=0).num_tokens == 0
    assert cache.match_prefix([1, 3]).num_tokens == 0  # the first page differs at its end
    with pytest.raises(ValueError):
        cache.match_prefix([1, 2], max_tokens=-1)


def test_heap_of_stale_entries_stays_bounded() -> None:
    cache, alloc = make_cache()
    insert_fresh(cache, alloc, [1, 2, 3, 4])
    for _ in range(1000):  # every touch of the leaf pushes an entry
        cache.match_prefix([1, 2, 3, 4])
    assert len(cache._heap) <= 2 * 2 + 64 + 1
    assert cache.evict(2) == 2
