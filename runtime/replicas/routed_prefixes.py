"""The routed-prefix tree of the cache-aware router: one radix tree of the prompts sent to
every replica, each node recording which replicas were sent a prompt through it and when, so
the router can find the replica that was sent the longest prefix of a new prompt. Bounded: each
replica holds at most `capacity` units, the least recently used going first.

Keys are strings of units (radixlm.runtime.replicas.routing.prefix_key: one character per
token id, or the prompt's text), so matching runs on str comparisons in C.
"""

from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("key", "end", "parent", "children", "holders")

    def __init__(self, key: str, end: int, parent: _Node | None) -> None:
        self.key = key  # this edge's units
        self.end = end  # units from the root to the end of this edge
        self.parent = parent
        self.children: dict[str, _Node] = {}  # by their first unit
        self.holders: dict[int, int] = {}  # replica -> tick of its last use of this node


class RoutedPrefixes:
    """One radix tree of the prompts routed to every replica; each node records which replicas
    were sent a prompt through it, and when last.

    Invariant: a replica holding a node holds all its ancestors (it was sent the whole prefix).
    Each replica holds at most `capacity` units (the sum of its nodes' edge lengths); past
    that, its least recently used nodes are dropped, deepest first. A node no replica holds
    is removed, so the tree has at most `num_replicas * capacity` units and as many nodes.

    LRU without a list per replica: every use stamps the path from the root with one new tick,
    so a node's tick is never older than any descendant's of the same replica. A heap per
    replica, ordered by (tick, deeper first), therefore pops a node with no descendant the
    replica still holds. Entries go stale when a node is re-stamped; the heap is compacted
    when stale entries outnumber live ones.
    """

    def __init__(self, num_replicas: int, capacity: int) -> None:
        self.capacity = capacity
        self.root = _Node("", 0, None)
        self._tick = 0
        self._seq = itertools.count()  # heap tie-breaker: nodes are not comparable
        self._units = [0] * num_replicas
        self._held = [0] * num_replicas  # nodes per replica
        self._heaps: list[list[tuple[int, int, int, _Node]]] = [[] for _ in range(num_replicas)]

    def units(self, replica: int) -> int:
        """Units of prefixes `replica` holds."""
        return self._units[replica]

    def num_nodes(self) -> int:
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    def match(self, key: str) -> dict[int, int]:
        """For each replica holding any prefix of `key`, the length of the longest. Read-only."""
        matched: dict[int, int] = {}
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_length(child.key, key, pos)
            for replica in child.holders:  # a subset of the parent's holders
                matched[replica] = pos + n
            if n < len(child.key):
                break
            node, pos = child, pos + n
        return matched

    def insert(self, key: str, replica: int) -> None:
        """Record that `key` was sent to `replica`: stamp its path, then evict to capacity."""
        self._tick += 1
        tick, heap = self._tick, self._heaps[replica]
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                child = _Node(key[pos:], len(key), node)
                node.children[key[pos]] = child
            else:
                n = _common_length(child.key, key, pos)
                if n < len(child.key):
                    child = self._split(child, n)
            if replica not in child.holders:
                self._units[replica] += len(child.key)
                self._held[replica] += 1
            child.holders[replica] = tick
            heapq.heappush(heap, (tick, -child.end, next(self._seq), child))
            node, pos = child, pos + len(child.key)
        self._evict(replica)
        if len(heap) > 2 * self._held[replica] + 64:
            heap[:] = [e for e in heap if e[3].holders.get(replica) == e[0]]
            heapq.heapify(heap)

    def drop(self, replica: int) -> None:
        """Forget everything routed to `replica`."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in list(node.children.items()):
                child.holders.pop(replica, None)
                if child.holders:
                    stack.append(child)
                else:  # nobody holds it, so nobody holds its descendants either
                    del node.children[first]
        self._units[replica] = self._held[replica] = 0
        self._heaps[replica] = []

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node`'s edge after `n` units; the new upper node has the same holders."""
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:n], node.end - len(node.key) + n, parent)
        parent.children[node.key[0]] = upper
        node.key = node.key[n:]
        node.parent = upper
        upper.children[node.key[0]] = node
        upper.holders = dict(node.holders)
        for replica, tick in upper.holders.items():
            self._held[replica] += 1
            heapq.heappush(self._heaps[replica], (tick, -upper.end, next(self._seq), upper))
        return upper

    def _evict(self, replica: int) -> None:
        heap = self._heaps[replica]
        while self._units[replica] > self.capacity and heap:
            tick, _, _, node = heapq.heappop(heap)
            if node.holders.get(replica) == tick:
                self._release(node, replica)

    def _release(self, node: _Node, replica: int) -> None:
        # By the tick order `node` has no descendant `replica` holds; the loop is a safeguard
        # that keeps the invariant even if it had.
        for child in [c for c in node.children.values() if replica in c.holders]:
            self._release(child, replica)
        del node.holders[replica]
        self._units[replica] -= len(node.key)
        self._held[replica] -= 1
        if not node.holders and node.parent is not None:
            del node.parent.children[node.key[0]]


def _common_length(edge: str, key: str, pos: int) -> int:
    """How many leading units of `edge` equal `key[pos:]`'s (at least 1: the caller found the
    edge by its first unit). Binary search over slice comparisons, which run in C."""
    if key.startswith(edge, pos):
        return len(edge)
    lo, hi = 1, min(len(edge), len(key) - pos)  # edge[:lo] matches; edge[:hi + 1] does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo
