"""Give the HTTP process's freed heap back to the operating system after large requests.

A multi-megabyte body becomes tens of megabytes of Python objects while it is parsed (on a
worker thread, so in a malloc arena of that thread). Freed, that memory stays with glibc's
allocator, fragmented across arenas, and the process only ever grows under a storm of large
(often invalid) requests. `malloc_trim(0)` returns the free pages of every arena; it runs on a
worker thread, at most once per second, shortly after a large request has finished, and the
process keeps to two arenas. Where the C library has neither call (macOS, musl), this does
nothing.
"""

from __future__ import annotations

import asyncio

from radixlm.runtime.models.quantization.host_memory import libc

TRIM_DELAY = 0.5  # seconds after a large request: its objects are gone by then
MIN_INTERVAL = 1.0


M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2


class HeapTrimmer:
    def __init__(self) -> None:
        c = libc()
        self._trim = getattr(c, "malloc_trim", None)
        self._scheduled = False  # a trim is pending, running, or cooling down
        self._again = False  # asked for again meanwhile: trim once more after the cool-down
        if c is not None and hasattr(c, "mallopt"):
            # Each thread that parses a large body would otherwise get an arena of its own
            # (up to 8 per core), and freed memory scatters across them.
            c.mallopt(M_ARENA_MAX, ARENAS)

    def trim_soon(self) -> None:
        """Trim the heap shortly (called on the event loop); repeated calls coalesce."""
        if self._trim is None:
            return
        if self._scheduled:
            self._again = True
            return
        self._scheduled, self._again = True, False
        asyncio.get_running_loop().call_later(TRIM_DELAY, self._start)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self._trim, 0)
        # The next trim may be scheduled once this one is done and a second has passed.
        future.add_done_callback(lambda _: loop.call_later(MIN_INTERVAL, self._ready))

    def _ready(self) -> None:
        self._scheduled = False
        if self._again:  # a large request finished after the trim started
            self.trim_soon()

