"""A request's KV pages: where they come from, where they go.

Every page is in exactly one place: the allocator's free list, a running request, or the radix
cache. A request's page list is split in two:

    request.pages = [ tree pages ........ | private pages ...... ]
                      0 .. num_tree_pages   allocated for this request

Tree pages belong to the cache and are protected by the lock the request holds on
`request.cache_node`. Private pages belong to the request until `cache_computed` hands the
full ones to the tree (or frees them as duplicates of pages the tree already had), or until
`release` frees them.

With a disk tier (disk_tier.py) under the tree, a request's prefix may go on past what the tree
holds: `attach` loads the pages the disk has into freshly allocated pages and inserts them into
the tree, as if they had just been computed; and every page the tree takes is written to the
disk too.
"""

from __future__ import annotations

from radixlm.runtime.scheduling.disk_tier import DiskTier
from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
from radixlm.runtime.scheduling.radix_cache import RadixCache, TreeNode
from radixlm.runtime.scheduling.request import Request


class KVManager:
    def __init__(self, allocator: PageAllocator, table: ReqToTokenTable,
                 cache: RadixCache | None, tier: DiskTier | None = None) -> None:
        if tier is not None and cache is None:
            raise ValueError("a disk tier needs the radix cache")
        self.allocator = allocator
        self.table = table
        self.cache = cache
        self.tier = tier
        self.page_size = allocator.page_size

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
            limit = _matchable(request)
            hit = self.cache.match_prefix(request.token_ids, request.namespace, limit)
            self.cache.lock(hit.node)
            node, pages = hit.node, list(hit.pages)
            if self.tier is not None and len(pages) < limit // self.page_size:
                node, pages = self._load(request, node, pages, limit // self.page_size)
            request.cache_node = node
            request.pages = pages
            request.num_tree_pages = len(pages)
            request.num_computed_tokens = len(pages) * self.page_size
            self.table.write_pages(row, 0, request.pages)
        return True

    def _load(self, request: Request, node: TreeNode, pages: list[int],
              wanted: int) -> tuple[TreeNode, list[int]]:
        """Extend the locked tree match `node`/`pages` with the pages the disk tier holds
        for the request's prefix, up to `wanted` pages: loaded into new pages, inserted into
        the tree, locked in place of `node`."""
        assert self.tier is not None and self.cache is not None
        have = len(pages)
        names = self.tier.chain(request.token_ids, wanted, request.namespace,
                                request.tier_names)
        count = self.tier.present(names[have:])
        if count > self.allocator.num_free:
            self.cache.evict(count - self.allocator.num_free)  # (our match is locked)
        count = min(count, self.allocator.num_free)
        new = self.allocator.allocate(count) if count else None
        if not new:
            return node, pages
        loaded = self.tier.load(names[have:have + count], new)
        self.allocator.free(new[loaded:])
        if not loaded:
            return node, pages
        result = self.cache.insert(request.token_ids[:(have + loaded) * self.page_size],
                                   pages + new[:loaded], request.namespace)
        self.allocator.free([p for p, q in zip(new, result.pages[have:]) if p != q])
        self.cache.lock(result.node)
        self.cache.unlock(node)
        return result.node, list(result.pages)

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
        if self.tier is not None and taken:  # written through to the disk, off this thread
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
