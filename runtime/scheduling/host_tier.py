"""The prefix cache's host-memory tier: KV pages in (pinned) host memory under the tree, so a
GPU's cache holds more than its KV pool, with the disk tier optionally below it.

Pages are named as the disk tier names them (`page_names`: the hash chain of their prefix),
and the tier has the disk tier's interface, so the KV manager drives either, or this one with
the disk below: a lookup takes the pages this tier holds first, then what the disk has after
them.

Write-through: a page the tree takes is copied to host memory at once, so when the device
evicts it (least recently used first), its KV is still here; a prompt that matches past what
the device holds loads it back instead of computing it. On a GPU the copies run on a stream
of their own: a store gathers the pages on the compute stream (they may be evicted and
reused right after) and copies them out on the side stream; a load enqueues its copies on the
side stream on the engine thread (so a later store into the same host slot comes after it)
and is done when that stream reaches its event, which a background thread waits for: the
request waits in the queue meanwhile, as for a disk load. The host pool is allocated once
(`max_bytes`, pinned on a GPU); its slots are reused least recently used first. With the disk
below, the disk's writer reads each page from its host slot (the device is not gathered twice
and no staging memory is pinned on the engine thread), and a slot is not reused until its
page is written.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from radixlm.runtime.scheduling.disk_tier import DiskTier, gather_pages, page_index, page_names


class HostTier:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, page_size: int, max_bytes: int,
                 below: DiskTier | None = None) -> None:
        """`k`, `v`: the KV cache's tensors, [num_layers, num_slots, heads, head_dim]."""
        self.k, self.v = k, v
        self.page_size = page_size
        self.below = below
        layers, _, heads, dim = k.shape
        self.page_bytes = 2 * layers * page_size * heads * dim * k.element_size()
        self.num_slots = max_bytes // self.page_bytes
        if self.num_slots < 1:
            raise ValueError(f"host_cache_gb holds no page: a page of KV takes "
                             f"{self.page_bytes} bytes")
        self.cuda = k.device.type == "cuda"
        self.buffer = torch.empty((self.num_slots, 2, layers, page_size, heads, dim),
                                  dtype=k.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(k.device) if self.cuda else None
        # name -> slot, least recently used first; only the engine thread touches it
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="radixlm-host-load")
        # slot -> pages of it queued for the disk writer: not reused until written
        self._writing: Counter[int] = Counter()
        self._writing_lock = threading.Lock()
        self.counters = {"host_hit_tokens": 0, "host_load_bytes": 0, "host_load_seconds": 0.0,
                         "host_store_bytes": 0}

    def chain(self, tokens: Sequence[int], num_pages: int, namespace: Hashable = None,
              known: list[str] | None = None) -> list[str]:
        return page_names(tokens, num_pages, self.page_size, namespace, known)

    def present(self, names: Sequence[str]) -> int:
        """How many of `names`, from the first, this tier holds, then the disk after them."""
        count = 0
        while count < len(names) and names[count] in self._slots:
            count += 1
        if self.below is not None and count < len(names):
            count += self.below.present(names[count:])
        return count

    # ---- loading ----

    def load_async(self, names: Sequence[str], pages: Sequence[int]) -> Future:
        """Load `names` into `pages` of the KV cache: what this tier holds from the first,
        the rest from the disk below. A Future of how many pages were loaded; the pages must
        be the caller's alone until it is done."""
        start = time.perf_counter()
        found: list[tuple[int, int]] = []  # (slot, page)
        for name, page in zip(names, pages):
            slot = self._slots.get(name)
            if slot is None:
                break
            self._slots.move_to_end(name)
            found.append((slot, page))
        event = None
        if found:
            compute = torch.cuda.current_stream(self.k.device) if self.cuda else None
            with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
                if compute is not None:
                    # The destination pages may have been written by the compute stream
                    # before they were freed.
                    self.stream.wait_stream(compute)
                # Each page is one contiguous copy; one scatter per tensor puts them in place.
                staged = torch.empty((len(found), *self.buffer.shape[1:]), dtype=self.k.dtype,
                                     device=self.k.device)
                for i, (slot, _) in enumerate(found):
                    staged[i].copy_(self.buffer[slot], non_blocking=True)
                index = page_index([page for _, page in found], self.k.device)
                # As bytes: a scatter of any KV storage type (float8 too).
                staged = staged.view(torch.uint8)
                for i, cache in enumerate((self.k, self.v)):
                    raw = cache.view(torch.uint8)
                    raw.view(raw.shape[0], -1, self.page_size, *raw.shape[2:]).index_copy_(
                        1, index, staged[:, i].transpose(0, 1))
                event = self.stream.record_event() if self.cuda else None
        loaded = len(found)
        rest = (self.below.load_async(names[loaded:], pages[loaded:])
                if self.below is not None and loaded < len(names) else None)
        return self._waiter.submit(self._finish_load, event, loaded, rest, start)

    def _finish_load(self, event: Any, loaded: int, rest: Future | None,
                     start: float) -> int:
        if event is not None:
            event.synchronize()
        self.counters["host_hit_tokens"] += loaded * self.page_size
        self.counters["host_load_bytes"] += loaded * self.page_bytes
        self.counters["host_load_seconds"] += time.perf_counter() - start
        # The disk's pages count only after all of this tier's: a load is a prefix.
        return loaded + (rest.result() if rest is not None else 0)

    # ---- storing ----

    def store(self, names: Sequence[str], pages: Sequence[int]) -> None:
        """Copy these pages (their KV as it is now) into host memory, and to the disk below;
        returns at once on a GPU (the side stream copies)."""
        new: list[tuple[int, int]] = []  # (page, slot)
        for name, page in zip(names, pages):
            if name not in self._slots:
                slot = self._take_slot(name)
                if slot is None:
                    break  # every slot waits for the disk writer
                new.append((page, slot))
        if new:
            self._copy_out(new)
        if self.below is not None:
            self._store_below(names, pages)

    def _copy_out(self, new: list[tuple[int, int]]) -> None:
        # One gather on the compute stream, in the host pool's layout: [n, 2, L, ps, H, D].
        kv = gather_pages(self.k, self.v, self.page_size, [page for page, _ in new])
        kv = kv.permute(2, 0, 1, 3, 4, 5).contiguous()
        host = self.buffer.view(torch.uint8)
        compute = torch.cuda.current_stream(self.k.device) if self.cuda else None
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            if compute is not None:
                self.stream.wait_stream(compute)  # the gather above
                kv.record_stream(self.stream)
            for i, (_, slot) in enumerate(new):
                host[slot].copy_(kv[i], non_blocking=True)
        self.counters["host_store_bytes"] += len(new) * self.page_bytes

    def _store_below(self, names: Sequence[str], pages: Sequence[int]) -> None:
        """The disk writes the pages from their host slots (no second gather on the device,
        no staging memory), which stay out of reuse until written; a page without a slot
        goes from the device."""
        assert self.below is not None
        copies, others = [], []
        with self._writing_lock:  # once per call: the disk writer's thread takes it per page
            for name, page in zip(names, pages):
                slot = self._slots.get(name)
                if slot is None:
                    others.append((name, page))
                else:
                    self._writing[slot] += 1
                    copies.append((name, self.buffer[slot],
                                   functools.partial(self._written, slot)))
        # After every copy into host memory so far (this call's and earlier ones').
        self.below.store_copies(copies, self.stream.record_event() if self.cuda else None)
        if others:
            self.below.store([n for n, _ in others], [p for _, p in others])

    def _written(self, slot: int) -> None:
        """(the disk writer's thread) A slot's page is on disk, or was skipped."""
        with self._writing_lock:
            self._writing[slot] -= 1
            if not self._writing[slot]:
                del self._writing[slot]

    def _take_slot(self, name: str) -> int | None:
        """A slot for `name`: a free one, or the least recently used one's that the disk
        writer is not reading; None when there is none. Copies into it are enqueued on the
        side stream after any load still reading it."""
        if self._free:
            slot = self._free.pop()
        else:
            for old, slot in self._slots.items():  # least recently used first
                if slot not in self._writing:
                    break
            else:
                return None
            del self._slots[old]
        self._slots[name] = slot
        return slot

    def settle(self, future: Future, loaded: int) -> int:
        """The pages of a finished load that can be used: all it loaded (one process)."""
        return loaded

    def flush(self, timeout: float | None = None) -> None:
        if self.cuda:
            self.stream.synchronize()
        if self.below is not None:
            self.below.flush(timeout)

    def close(self) -> None:
        self.flush(timeout=30)
        self._waiter.shutdown(wait=True)
        if self.below is not None:
            self.below.close()

    def stats(self) -> dict[str, Any]:
        return {**(self.below.stats() if self.below is not None else {}), **self.counters,
                "host_pages": len(self._slots), "host_pages_total": self.num_slots,
                "host_bytes": len(self._slots) * self.page_bytes}

