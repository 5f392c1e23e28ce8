"""A condition that threads and coroutines both wait on: a program state's reads wait for
its executing task, from the program's thread (`run`) or as coroutines (`arun`)."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable


class BlockingWaitOnLoop(RuntimeError):
    """A thread tried to block on the event loop that must make the progress it waits for."""


class Condition:
    """`with condition:` guards the shared state; whoever changes it calls `notify()` (with
    the lock held), which wakes every waiting thread and coroutine to check again."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def __enter__(self) -> "Condition":
        self._cv.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._cv.__exit__(*exc)

    def notify(self) -> None:
        self._cv.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_wake, waiter)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

    def wait(self, ready: Callable[[], bool], progress: asyncio.AbstractEventLoop) -> None:
        """Block this thread until `ready()`; `progress` is the loop whose tasks make it so,
        which this thread must not be running (BlockingWaitOnLoop)."""
        with self._cv:
            if ready():
                return
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is progress:
                raise BlockingWaitOnLoop()
            self._cv.wait_for(ready)

    async def wait_async(self, ready: Callable[[], bool]) -> None:
        """Wait until `ready()` without blocking the running loop."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cv:
                if ready():
                    return
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
            await waiter


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
