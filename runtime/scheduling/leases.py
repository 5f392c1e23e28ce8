"""Leases: prefixes pinned in the radix cache on behalf of a program (or a server client).

A lease holds one lock on the radix node that ends a computed prefix, so the prefix's pages
survive eviction until the lease is released or expires. Programs take one at a `fork` and
release it when the branches join; the expiry bounds the damage of a client that never comes
back. Leased memory is bounded: a pin that would exceed `max_pages` is refused (the program
then runs unpinned). And leases yield: when the engine cannot schedule anything because
leased pages are in the way, it releases leases, oldest first, rather than stall.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from radixlm.runtime.scheduling.radix_cache import RadixCache, TreeNode

log = logging.getLogger(__name__)


@dataclass
class Lease:
    lease_id: str
    node: TreeNode
    num_pages: int  # pages on the path from the root to `node`
    expires_at: float


class LeaseTable:
    def __init__(self, cache: RadixCache, max_pages: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.max_pages = max_pages
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        # Overlapping leases count their shared pages twice: a conservative bound.
        self.leased_pages = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def pin(self, node: TreeNode, ttl: float, quiet: bool = False) -> str | None:
        """Lock `node` (a prefix the cache holds) under a new lease; None when refused (with a
        warning unless `quiet`: a pin the engine takes by itself)."""
        num_pages = _path_pages(node)
        if num_pages == 0:
            return None  # shorter than a page: nothing is cached to protect
        if self.leased_pages + num_pages > self.max_pages:
            (log.debug if quiet else log.warning)(
                "prefix pin refused: %d leased + %d pages would exceed the bound of %d pages; "
                "the program runs unpinned", self.leased_pages, num_pages, self.max_pages)
            return None
        self.cache.lock(node)
        lease = Lease(uuid.uuid4().hex, node, num_pages, self.clock() + ttl)
        self._leases[lease.lease_id] = lease
        self.leased_pages += num_pages
        return lease.lease_id

    def release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.cache.unlock(lease.node)
        self.leased_pages -= lease.num_pages
        return True

    def expire(self) -> int:
        """Release every lease past its expiry; returns how many."""
        now = self.clock()
        expired = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            log.info("lease %s expired", lease_id)
            self.release(lease_id)
        return len(expired)

    def release_oldest(self) -> bool:
        if not self._leases:
            return False
        return self.release(next(iter(self._leases)))

    def release_all(self) -> None:
        for lease_id in list(self._leases):
            self.release(lease_id)


def _path_pages(node: TreeNode) -> int:
    pages = 0
    while node is not None and not node.is_root:
        pages += len(node.value)
        node = node.parent
    return pages
