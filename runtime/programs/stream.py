"""A segment running in the background: its events in order as the runtime produces them,
and a way to stop it (radixlm/segments.py replays them into a program's state)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from radixlm.runtime.programs.segment import SegmentEvent


class SegmentStream:
    """Runs `events` (a backend's segment: steps executed in process, or read from a server)
    as a task of the running loop, ahead of the program that consumes them."""

    def __init__(self, events: AsyncIterator[SegmentEvent]) -> None:
        self._events: asyncio.Queue[SegmentEvent | BaseException | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(events))

    async def _pump(self, events: AsyncIterator[SegmentEvent]) -> None:
        try:
            async for event in events:
                self._events.put_nowait(event)
            self._events.put_nowait(None)
        except asyncio.CancelledError:
            self._events.put_nowait(None)
            raise
        except BaseException as exc:  # noqa: BLE001 - the replay raises it in the program
            self._events.put_nowait(exc)

    async def next(self) -> SegmentEvent | None:
        """The next event (None: the segment ended); raises what failed the segment."""
        item = await self._events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        """Stop the step in flight (an engine request is aborted, an HTTP stream hung up)."""
        self._task.cancel()
