"""A request's KV pages: where they come from, where they go.

Every page is in exactly one place: the allocator's free list, a running request, or the radix
cache. A request's page list is split in two:

    request.pages = [ tree pages ........ | private pages ...... ]
                      0 .. num_tree_pages   allocated for this request

Tree pages belong to the cache and are protected by the lock the request holds on
`request.cache_node`. Private pages belong to the request until `cache_computed` hands the
full ones to the tree (or frees them as duplicates of pages the tree already had), or until
`release` frees them.

With a lower tier under the tree (host_tier.py, disk_tier.py, or host memory above disk), a
waiting request's prefix may go on past what the tree holds: `start_load` allocates pages for
what the tier has and loads them in the background while other requests run (or, when the
device cannot take all of it yet and running requests will give pages back, has the request
wait for them first: a partial load would leave the rest of the prefix to be computed); the
request waits, and `finish_loads` (on the engine thread, before each schedule) inserts the loaded
pages into the tree, as if just computed, so its attach then hits them. Until then the pages
are neither free nor cached: they are `loading_pages`. Every page the tree takes is written
to the tier too.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from enum import Enum

from radixlm.runtime.scheduling.disk_tier import DiskTier
from radixlm.runtime.scheduling.host_tier import HostTier
from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
from radixlm.runtime.scheduling.radix_cache import RadixCache, TreeNode
from radixlm.runtime.scheduling.request import Request

log = logging.getLogger(__name__)


class TierLoad(Enum):
    """What start_load says of a waiting request."""
    NONE = "none"  # nothing (more) to load: attach it
    LOADING = "loading"  # its prefix is loading: it waits, others may run meanwhile
    NO_ROOM = "no room"  # the tier has more of its prefix than the device can take now


@dataclass
class _Load:
    node: TreeNode  # the tree's match, locked while the rest loads
    tree_pages: list[int]  # its pages
    pages: list[int]  # allocated for the pages that come from the tier
    future: Future  # how many of them were loaded
    names: list[str]  # the tier's names of them


class KVManager:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable,
                 cache: RadixCache | None, tier: DiskTier | HostTier | None = None) -> None:
        if tier is not None and cache is None:
            raise ValueError("a lower tier needs the radix cache")
        self.allocator = allocator
        self.table = table
        self.cache = cache
        self.tier = tier
        self.page_size = allocator.page_size
        self._loads: dict[Request, _Load] = {}  # waiting requests whose prefix is loading

    @property
    def available_pages(self) -> int:
        """Pages that an allocation could get: free ones plus evictable cached ones."""
        return self.allocator.num_free + (self.cache.evictable_pages if self.cache else 0)

    def match(self, request: Request) -> int:
        """Tokens of the request's prefix that the cache holds (no side effects on request)."""
        if self.cache is None:
            return 0
        return self.cache.match_prefix(request.token_ids, request.namespace,
                                       _matchable(request)).num_tokens

    def attach(self, request: Request) -> bool:
        """Give a waiting request a table row and its cached prefix (locked). False when no
        row is free. Advances num_computed_tokens by the hit."""
        row = self.table.acquire()
        if row is None:
            return False
        request.table_row = row
        if self.cache is not None:
            hit = self.cache.match_prefix(request.token_ids, request.namespace,
                                          _matchable(request))
            self.cache.lock(hit.node)
            request.cache_node = hit.node
            request.pages = list(hit.pages)
            request.num_tree_pages = len(hit.pages)
            request.num_computed_tokens = hit.num_tokens
            self.table.write_pages(row, 0, request.pages)
        return True

    # ---- the lower tier ----

    @property
    def loading(self) -> bool:
        return bool(self._loads)

    @property
    def loading_pages(self) -> int:
        return sum(len(load.pages) for load in self._loads.values())

    def start_load(self, request: Request, wait_for_room: bool = False) -> TierLoad:
        """For a waiting request: LOADING while the lower tier is loading its prefix (it
        should wait), including when a load starts now; NONE when there is nothing to load
        (attach it). With `wait_for_room` (other requests hold pages they will give back),
        NO_ROOM when the device cannot take all the tier holds of the prefix now: loading
        part of it would leave the rest to be computed again. Otherwise a request is looked
        up in the tier once, and loads what fits."""
        if self.tier is None:
            return TierLoad.NONE
        if request in self._loads:
            return TierLoad.LOADING
        if request.tier_checked:
            return TierLoad.NONE
        assert self.cache is not None
        limit = _matchable(request)
        wanted = limit // self.page_size
        hit = self.cache.match_prefix(request.token_ids, request.namespace, limit)
        have = len(hit.pages)
        if have >= wanted:
            request.tier_checked = True
            return TierLoad.NONE
        names = self.tier.chain(request.token_ids, wanted, request.namespace,
                                request.tier_names)
        if any(load.names[0] == names[have] for load in self._loads.values()):
            return TierLoad.LOADING  # another request is loading the same pages
        count = self.tier.present(names[have:])
        if not count:
            request.tier_checked = True
            return TierLoad.NONE
        self.cache.lock(hit.node)  # the match stays while the rest loads
        if wait_for_room and count > self.available_pages:
            self.cache.unlock(hit.node)
            return TierLoad.NO_ROOM
        request.tier_checked = True
        if count > self.allocator.num_free:
            self.cache.evict(count - self.allocator.num_free)
        pages = self.allocator.allocate(min(count, self.allocator.num_free)) or []
        if not pages:
            self.cache.unlock(hit.node)
            return TierLoad.NONE
        future = self.tier.load_async(names[have:have + len(pages)], pages)
        self._loads[request] = _Load(hit.node, list(hit.pages), pages, future,
                                     names[have:have + len(pages)])
        return TierLoad.LOADING

    def finish_loads(self) -> None:
        """Insert the pages of the loads that are done into the tree (what failed to load
        is freed)."""
        assert self.cache is not None or not self._loads
        for request, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[request]
            try:
                loaded = load.future.result()
            except Exception:  # a read that failed outright: those pages get computed
                log.exception("KV cache tier: a load failed")
                loaded = 0
            # (under tensor parallelism: what every rank loaded)
            loaded = self.tier.settle(load.future, loaded)
            self.allocator.free(load.pages[loaded:])
            if loaded:
                have = len(load.tree_pages)
                result = self.cache.insert(
                    request.token_ids[:(have + loaded) * self.page_size],
                    load.tree_pages + load.pages[:loaded], request.namespace)
                # (another request may have computed some of them meanwhile: the tree's win)
                kept = [p == q for p, q in zip(load.pages, result.pages[have:])]
                self.allocator.free([p for p, keep in zip(load.pages, kept) if not keep])
                # Through the tiers again: what came from the disk is kept in host memory
                # too (each tier skips what it holds).
                self.tier.store([n for n, keep in zip(load.names, kept) if keep],
                                [p for p, keep in zip(load.pages, kept) if keep])
            self.cache.unlock(load.node)

    def wait_for_a_load(self, timeout: float) -> None:
        futures = [load.future for load in self._loads.values()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Make sure the request has pages for its first num_tokens tokens, evicting cached
        pages if the free list is short. False (and nothing taken) when that is impossible."""
        needed = self.allocator.pages_for(num_tokens) - len(request.pages)
        if needed <= 0:
            return True
        if needed > self.allocator.num_free and self.cache is not None:
            self.cache.evict(needed - self.allocator.num_free)
        pages = self.allocator.allocate(needed)
        if pages is None:
            return False
        self.table.write_pages(request.table_row, len(request.pages), pages)
        request.pages.extend(pages)
        return True

    def cache_computed(self, request: Request) -> None:
        """Hand the request's computed full pages to the tree, so later requests (and this one,
        after a retraction) can reuse them."""
        if self.cache is None:
            return
        full = min(request.num_computed_tokens // self.page_size, len(request.pages))
        if full <= request.num_tree_pages:
            return
        result = self.cache.insert(request.token_ids[: full * self.page_size],
                                   request.pages[:full], request.namespace)
        # Pages another request computed first are the tree's; ours are duplicates.
        taken = []
        for i in range(request.num_tree_pages, full):
            if request.pages[i] != result.pages[i]:
                self.allocator.free([request.pages[i]])
                request.pages[i] = result.pages[i]
                self.table.write_pages(request.table_row, i, [result.pages[i]])
            else:
                taken.append(i)
        if self.tier is not None and taken:  # written through to the tier, off this thread
            names = self.tier.chain(request.token_ids, full, request.namespace,
                                    request.tier_names)
            self.tier.store([names[i] for i in taken], [request.pages[i] for i in taken])
        self.cache.lock(result.node)
        self.cache.unlock(request.cache_node)
        request.cache_node = result.node
        request.num_tree_pages = full

    def trim(self, request: Request) -> None:
        """Free the private pages past the request's tokens (those that held rejected
        speculative drafts). Their slot-table entries go stale and are never read."""
        keep = max(self.allocator.pages_for(len(request.token_ids)), request.num_tree_pages)
        if len(request.pages) > keep:
            self.allocator.free(request.pages[keep:])
            del request.pages[keep:]

    def release(self, request: Request) -> None:
        """The request stops running (finished or retracted): cache what it computed, free
        its private pages, drop its lock and its table row."""
        if self.cache is not None and request.table_row is not None:
            self.cache_computed(request)
            self.cache.unlock(request.cache_node)
        self.allocator.free(request.pages[request.num_tree_pages:])
        request.pages = []
        request.num_tree_pages = 0
        request.cache_node = None
        if request.table_row is not None:
            self.table.release(request.table_row)
            request.table_row = None


def _matchable(request: Request) -> int:
    """How much of the request may come from the cache: at least one token must be computed
    (its logits give the next token), and prompt logprobs need the hidden states from
    logprob_start_len - 1 on."""
    limit = len(request.token_ids) - 1
    start = request.prompt_logprob_start
    if start is not None:
        limit = min(limit, max(start - 1, 0))
    return limit
