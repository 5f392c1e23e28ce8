"""RadixAttention prefix cache: a radix tree over token ids whose values are KV page indices.

Every edge of the tree holds a run of whole pages: `key` is its token ids (a multiple of
`page_size` long) and `value` the KV pages that hold them, one page per `page_size` tokens.
Only whole pages are stored or matched, because a page is the unit the allocator hands out.

    root ── (1 2 | 3 4) ──┬── (5 6)        page_size = 2: the prompt 1 2 3 4 5 6 holds
                          └── (7 8 | 9 9)  3 pages, and 1 2 3 4 7 8 9 9 shares the first 2

Ownership (DESIGN.md): every KV page is in exactly one place: the allocator's free list, a
running request, or this tree. The tree takes pages in `insert` and gives them back to the
allocator only in `evict` and `reset`. A running request protects the pages it reads from the
cache by `lock`ing the node its match ended at; locks count, and a lock on a node also covers
all its ancestors, so a node's lock count is the number of locks in its subtree.

A request's life, as the scheduler drives it (token ids are plain ints: they become keys):

    m = cache.match_prefix(prompt); cache.lock(m.node)   # m.pages are shared, read-only
    ... allocate pages for the rest, compute them ...
    r = cache.insert(tokens, m.pages + own)              # then free own pages not in r.pages
    cache.lock(r.node); cache.unlock(m.node)             # and use r.pages from now on
    ... when it finishes or is retracted: cache.unlock(r.node)

LRU eviction keeps a heap of (last access, node) entries with lazy deletion: an entry is
skipped when popped if its node was touched since, got a child, got locked or left the tree.
Not thread-safe: the scheduler is the only caller.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple

from radixlm.runtime.scheduling.pages import PageAllocator

# Stale heap entries accumulate (one per touch of a leaf); rebuild the heap once they
# outnumber the nodes by this factor, which keeps pushes O(log n) amortized.
HEAP_SLACK_FACTOR, HEAP_SLACK_MIN = 2, 64


class TreeNode:
    """One edge: a run of whole pages. The root of a namespace has an empty key.

    A node object always means "the prefix ending here": splits insert a new parent above it
    instead of shortening it from below, so references held by the scheduler stay valid. A
    node that left the tree (evicted or reset) has `parent is None` and must not be locked.
    """

    __slots__ = ("key", "value", "children", "parent", "lock_count", "last_access",
                 "namespace")

    def __init__(self, key: tuple[int, ...], value: list[int], parent: TreeNode | None,
                 last_access: int = 0, namespace: Hashable = None) -> None:
        self.key = key
        self.value = value
        self.children: dict[tuple[int, ...], TreeNode] = {}  # keyed by the child's first page
        self.parent = parent
        self.lock_count = 0
        self.last_access = last_access
        self.namespace = namespace  # only meaningful on roots

    @property
    def is_root(self) -> bool:
        return not self.key

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def attached(self) -> bool:
        return self.is_root or self.parent is not None

    def __repr__(self) -> str:
        return (f"TreeNode(key={self.key!r}, value={self.value!r}, lock={self.lock_count}, "
                f"t={self.last_access})")


class MatchResult(NamedTuple):
    pages: list[int]  # KV pages of the matched prefix, in order
    num_tokens: int  # len(pages) * page_size
    node: TreeNode  # deepest node of the match (the namespace root when nothing matched)


class InsertResult(NamedTuple):
    num_existing_tokens: int  # leading tokens the tree already had before this insert
    pages: list[int]  # the tree's pages for the whole inserted prefix, after the insert
    node: TreeNode  # the node that ends exactly at the end of the inserted prefix


class RadixCache:
    """Prefix cache over token ids, one tree per namespace, values are KV pages."""

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page_size "
                             f"{allocator.page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self._roots: dict[Hashable, TreeNode] = {}
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, tiebreak, leaf)
        self._tiebreak = itertools.count()
        self._clock = 0  # a counter, not wall time: LRU order is deterministic in tests
        self._num_nodes = 0  # non-root nodes
        self._evictable = 0  # pages in nodes with lock_count == 0
        self._protected = 0  # pages in nodes with lock_count > 0

    # ---- sizes: O(1) counters kept up to date by every mutation ----

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes; `evict` can free all of them (unlocked subtrees)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages in locked nodes (used by running requests); never evicted."""
        return self._protected

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    # ---- the interface the scheduler uses ----

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None,
                     max_tokens: int | None = None) -> MatchResult:
        """The longest prefix of `tokens[:max_tokens]` made of whole pages in the tree.

        Mutates: refreshes the last-access time of the matched path, and splits the last
        node at a page boundary if the match ends inside it, so that `result.node` ends
        exactly at the match. The returned pages stay owned by the tree and are NOT
        protected: `lock(result.node)` before anything can call `evict`, or they may be
        freed under you. An unknown namespace matches nothing and returns a fresh root.
        """
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        limit -= limit % self.page_size
        root = self._root(namespace, create=False)
        path, pages = self._descend(root, tuple(tokens[:limit]))
        if not path:
            return MatchResult([], 0, root)
        self._touch(path)
        return MatchResult(pages, len(pages) * self.page_size, path[-1])

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               namespace: Hashable = None) -> InsertResult:
        """Cache `tokens` (a whole number of pages) whose KV is in `pages`.

        The leading part the tree already has keeps the tree's pages; the caller's pages for
        that part are NOT taken: compare them with `result.pages` and free your own
        duplicates (those that differ). The caller's pages for the rest become owned by the
        tree. Mutates: may split one node at a page boundary, adds at most one leaf, and
        refreshes the last-access time of the whole path. Does not lock anything.
        """
        ps = self.page_size
        if len(tokens) % ps or len(pages) * ps != len(tokens):
            raise ValueError(f"insert needs whole pages: {len(tokens)} tokens, "
                             f"{len(pages)} pages of {ps}")
        root = self._root(namespace, create=bool(tokens))
        key = tuple(tokens)
        path, tree_pages = self._descend(root, key)
        num_existing = len(tree_pages) * ps
        if num_existing < len(key):
            parent = path[-1] if path else root
            leaf = TreeNode(key[num_existing:], list(pages[num_existing // ps:]), parent)
            parent.children[leaf.key[:ps]] = leaf
            self._num_nodes += 1
            self._evictable += len(leaf.value)
            path.append(leaf)
            tree_pages.extend(leaf.value)
        if not path:
            return InsertResult(0, [], root)
        self._touch(path)
        return InsertResult(num_existing, tree_pages, path[-1])

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (counted; undo with `unlock`).

        Locking a root is a no-op. Raises ValueError if the node already left the tree
        (it was evicted because it was not locked right after the match that returned it).
        """
        if node.is_root:
            return
        if not node.attached:
            raise ValueError(f"cannot lock {node!r}: it was evicted")
        while not node.is_root:
            if node.lock_count == 0:
                self._evictable -= len(node.value)
                self._protected += len(node.value)
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises ValueError when the node is not locked."""
        if node.is_root:
            return
        # Ancestors' counts are >= the node's, so checking the node first leaves nothing
        # half-done.
        if node.lock_count <= 0:
            raise ValueError(f"unlock without a matching lock on {node!r}")
        while not node.is_root:
            node.lock_count -= 1
            if node.lock_count == 0:
                self._protected -= len(node.value)
                self._evictable += len(node.value)
                self._push_if_evictable(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free `num_pages` unlocked cached pages to the allocator (fewer only if fewer are
        evictable), LRU leaves first; returns how many were freed.

        A parent becomes a candidate once its last child is gone. The last leaf taken is
        trimmed from its end rather than dropped whole, so no more than asked is freed and
        the head stays cached. Locked nodes are never touched. O(k log n) for k nodes
        removed, plus stale heap entries skipped (each was pushed once, in O(log n)).
        """
        freed = 0
        while freed < num_pages and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if stamp != node.last_access or not self._is_evictable_leaf(node):
                continue  # stale entry: touched, extended, locked or gone since it was pushed
            keep = freed + len(node.value) - num_pages
            if keep > 0:
                # Cut off the unneeded tail only; the head (same age) goes back in the heap.
                self._split(node, keep * self.page_size)
            freed += self._remove_leaf(node)
        return freed

    def reset(self) -> None:
        """Drop the whole tree and free all its pages. RuntimeError if anything is locked."""
        if self._protected:
            raise RuntimeError(f"cannot reset the radix cache: {self._protected} pages are "
                               "locked by running requests")
        nodes = list(self._iter_nodes())
        self.allocator.free([page for node in nodes for page in node.value])
        for node in nodes:
            node.parent = None  # any reference still held now reads as evicted
        self._roots.clear()
        self._heap.clear()
        self._num_nodes = self._evictable = 0

    def held_pages(self) -> list[int]:
        """Every page in the tree (O(n); for invariant checks)."""
        return [page for node in self._iter_nodes() for page in node.value]

    def walk(self) -> Iterator[tuple[Hashable, tuple[int, ...], TreeNode]]:
        """(namespace, full token prefix ending at the node, node) for every non-root node,
        parents before children. O(total prefix length); for tests and debugging."""
        for namespace, root in self._roots.items():
            stack = [((), child) for child in root.children.values()]
            while stack:
                prefix, node = stack.pop()
                prefix += node.key
                yield namespace, prefix, node
                stack.extend((prefix, child) for child in node.children.values())

    # ---- internals ----

    def _root(self, namespace: Hashable, create: bool) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = TreeNode((), [], None, namespace=namespace)
            if create:
                self._roots[namespace] = root
        return root

    def _descend(self, root: TreeNode,
                 tokens: tuple[int, ...]) -> tuple[list[TreeNode], list[int]]:
        """Follow page-aligned `tokens` down from `root` as far as whole pages match; split the
        last node if the match ends inside it. Returns the path (root excluded) and its pages.
        """
        ps = self.page_size
        path: list[TreeNode] = []
        pages: list[int] = []
        node, pos = root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:
                break
            # >= 1 page: the child's first page is the key we looked it up by.
            matched = self._common_pages(child.key, tokens, pos) * ps
            if matched < len(child.key):
                child = self._split(child, matched)
            path.append(child)
            pages.extend(child.value)
            node, pos = child, pos + matched
            # After a split the next lookup misses: the tail's first page differs from ours.
        return path, pages

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
        """Number of whole pages at which `key` and `tokens[start:]` agree."""
        if tokens[start:start + len(key)] == key:  # the common case, compared in C
            return len(key) // self.page_size
        n = min(len(key), len(tokens) - start)
        i = 0
        while i < n and key[i] == tokens[start + i]:
            i += 1
        return i // self.page_size

    def _split(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Cut `node` after `num_tokens` (a page multiple, inside it); returns the new head.

        `node` keeps its identity as the tail (see TreeNode). The head inherits the lock count
        and age: every lock on `node` covers the head too, and they were used together.
        """
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_tokens < len(node.key) and num_tokens % ps == 0
        head = TreeNode(node.key[:num_tokens], node.value[:num_tokens // ps], parent,
                        node.last_access)
        head.lock_count = node.lock_count
        parent.children[head.key[:ps]] = head
        node.key = node.key[num_tokens:]
        node.value = node.value[num_tokens // ps:]
        node.parent = head
        head.children[node.key[:ps]] = node
        self._num_nodes += 1
        return head

    def _touch(self, path: list[TreeNode]) -> None:
        """One tick for the whole path: the nodes on it were used together."""
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        self._push_if_evictable(path[-1])  # only the last node can be a leaf

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.parent is not None and not node.children and node.lock_count == 0

    def _push_if_evictable(self, node: TreeNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))
        if len(self._heap) > HEAP_SLACK_FACTOR * self._num_nodes + HEAP_SLACK_MIN:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(node.last_access, next(self._tiebreak), node)
                      for node in self._iter_nodes() if self._is_evictable_leaf(node)]
        heapq.heapify(self._heap)

    def _remove_leaf(self, node: TreeNode) -> int:
        """Detach an unlocked leaf and free its pages; returns how many."""
        parent = node.parent
        assert parent is not None and node.is_leaf and node.lock_count == 0
        del parent.children[node.key[:self.page_size]]
        node.parent = None
        self._num_nodes -= 1
        self._evictable -= len(node.value)
        self.allocator.free(node.value)
        if not parent.is_root:
            self._push_if_evictable(parent)
        elif not parent.children and self._roots.get(parent.namespace) is parent:
            del self._roots[parent.namespace]  # don't keep one empty root per old cache salt
        return len(node.value)

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, iteratively (chats make deep trees)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())
