"""A segment running in the background: its events in order as the runtime produces them,
and a way to stop it (radixlm/segments.py replays them into a program's state)."""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable

from radixlm.runtime.programs.segment import Segment, SegmentEvent, SegmentOps, run_segment


class SegmentStream:
    """A segment running on a backend: its events in order, and a way to stop it."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self._events: queue.SimpleQueue[SegmentEvent | BaseException | None] = (
            queue.SimpleQueue())
        self.cancel = cancel

    def put(self, item: SegmentEvent | BaseException | None) -> None:
        """From the producer: an event, the failure that ends the segment, or None (done)."""
        self._events.put(item)

    def next(self) -> SegmentEvent | None:
        """The next event (None: the segment ended); raises what failed the segment."""
        item = self._events.get()
        if isinstance(item, BaseException):
            raise item
        return item


def run_in_thread(segment: Segment, ops: SegmentOps) -> SegmentStream:
    """Run a segment on an event loop of its own thread (for backends whose calls are
    asyncio code in this process); cancelling stops the step in flight."""
    started = threading.Event()
    handles: dict[str, Any] = {}

    async def pump() -> None:
        handles["task"] = asyncio.current_task()
        handles["loop"] = asyncio.get_running_loop()
        started.set()
        try:
            async for event in run_segment(segment, ops):
                stream.put(event)
            stream.put(None)
        except asyncio.CancelledError:
            stream.put(None)
        except BaseException as exc:  # noqa: BLE001 - the replay raises it in the program
            stream.put(exc)

    def cancel() -> None:
        started.wait()
        try:
            handles["loop"].call_soon_threadsafe(handles["task"].cancel)
        except RuntimeError:  # the loop already finished: nothing runs
            pass

    stream = SegmentStream(cancel)
    threading.Thread(target=asyncio.run, args=(pump(),), name="radixlm-segment",
                     daemon=True).start()
    return stream
