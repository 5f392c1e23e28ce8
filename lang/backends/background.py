"""The event loop the synchronous API runs on.

Program states execute as asyncio tasks, and backends talk to models with asyncio code. Code
that is not async (`program.run()`, a `backend.generate()` call) hands its work to one event
loop on a daemon thread, shared by the whole process, and waits for the result; `arun` runs
the same tasks on the caller's own loop instead. So both APIs share one implementation, and
neither needs a thread per program.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The background loop, started on first use."""
    global _loop, _thread
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            _thread = threading.Thread(target=_loop.run_forever, name="radixlm-loop",
                                       daemon=True)
            _thread.start()
        return _loop


def on_loop_thread() -> bool:
    return _thread is not None and threading.current_thread() is _thread


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start `coro` on the background loop; its result comes through the future."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the background loop and wait for its result (from any other thread)."""
    if on_loop_thread():
        coro.close()
        raise RuntimeError("a blocking radixlm call was made on radixlm's own event loop; "
                           "await the async form instead")
    future = submit(coro)
    try:
        return future.result()
    except BaseException:
        future.cancel()  # e.g. KeyboardInterrupt: the work stops too
        raise


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@atexit.register
def _stop() -> None:
    """Cancel what still runs on the loop (closing its HTTP sessions cleanly), then stop it."""
    if _loop is None or _loop.is_closed() or not _loop.is_running():
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=2.0) if tasks else None

    try:
        asyncio.run_coroutine_threadsafe(cancel_all(), _loop).result(timeout=3.0)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    _loop.call_soon_threadsafe(_loop.stop)
