"""Paged KV ownership: the page allocator and the request-to-token table.

Ownership: every page is in exactly one place at a time: the allocator's free list, a running
request, or the radix cache. `allocate` returning None is a normal event (the scheduler then
evicts or retracts); nothing here raises on exhaustion. The KV tensors themselves live in
`radixlm.runtime.attention.kv_cache`.
"""

from __future__ import annotations

import torch

from radixlm.kernels.host_copy import to_device


class PageAllocator:
    """A free list of page indices. Pages are handed out and returned whole."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        # Popping from the end hands out low page numbers first (nicer to read in tests).
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages, or None (and take nothing) when there are not enough."""
        if num_pages > len(self._free):
            return None
        taken = self._free[len(self._free) - num_pages:]
        del self._free[len(self._free) - num_pages:]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class ReqToTokenTable:
    """Maps (request row, token position) -> KV slot, as a device tensor the kernels can read.

    Each running request holds one row. Rows are recycled when requests finish or are
    retracted; a row's entries beyond the request's allocated pages are stale and never read.
    """

    def __init__(self, num_rows: int, max_len: int, page_size: int,
                 device: torch.device) -> None:
        self.table = torch.zeros(num_rows, max_len, dtype=torch.int64, device=device)
        self.page_size = page_size
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=device)

    def acquire(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def release(self, row: int) -> None:
        self._free_rows.append(row)

    def write_pages(self, row: int, first_page_index: int, pages: list[int]) -> None:
        """Record `pages` as the request's pages number first_page_index, first_page_index+1..."""
        if not pages:
            return
        page_ids = to_device(pages, torch.int64, self.table.device)
        slots = (page_ids[:, None] * self.page_size + self._offsets[None, :]).flatten()
        start = first_page_index * self.page_size
        end = min(start + slots.numel(), self.table.shape[1])
        self.table[row, start:end] = slots[: end - start]
