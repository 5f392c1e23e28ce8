"""The HTTP process's handle on the engine process: start it, stream requests through it,
call its methods, and stop it.

Pipe I/O happens on two threads (a reader and a writer), so the event loop never blocks on a
slow or full pipe. Results reach the loop with `call_soon_threadsafe` and are routed by request
key to the sink (an asyncio.Queue) of whoever submitted the request.

A request stays tracked until the engine has sent the last chunk of each of its n samples,
even when its consumer has gone (a client that disconnected): that is what makes the in-flight
count, and so the queue limit, exact, and what keeps a reused request id from colliding with
the engine's copy of an aborted one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.engine_process import loop as engine_loop
from radixlm.runtime.engine_process.messages import Chunk, EngineError, EngineInfo

log = logging.getLogger("radixlm.server")

Sink = asyncio.Queue  # receives (key, Chunk | EngineError | Rerun)


class Rerun:
    """Put in a generation's sink in place of a key's chunks: the request is running again
    from the start (the engine replica serving it was lost before anything of it had left
    the server), so what it produced so far is dropped."""


class EngineCallError(Exception):
    def __init__(self, error: EngineError) -> None:
        super().__init__(error.message)
        self.status = error.status
        self.message = error.message


@dataclass
class _Tracked:
    sink: Sink
    remaining: int  # samples whose last chunk has not arrived
    group: str | None  # e.g. the OpenAI request id of a batch, for /abort_request
    detached: bool = False  # the consumer is gone; chunks are counted, not delivered


class EngineClient:
    def __init__(self, options: dict[str, Any], log_level: str = "info") -> None:
        self.options = options
        self.log_level = log_level
        self.info: EngineInfo | None = None
        self.process: Any = None
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._in_flight = 0
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self.died = asyncio.Event()  # set when the engine process exits unexpectedly
        self.stalled = False  # the watchdog found it making no progress (and killed it)
        self._rounds = -1  # the engine loop's rounds at the last heartbeat
        self._last_progress = time.monotonic()  # when a heartbeat last showed progress

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        """Spawn the engine process and wait until its model is loaded."""
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        # daemon: multiprocessing terminates it when this process exits normally; the child
        # also exits by itself when the pipe closes or its parent pid changes (a crash).
        self.process = ctx.Process(target=engine_loop.run, name="radixlm-engine",
                                   args=(self.options, child_conn, os.getpid(), self.log_level),
                                   daemon=True)
        self.process.start()
        child_conn.close()  # only the child holds its end: its death is EOF here
        self._conn = parent_conn
        status, payload = await self._loop.run_in_executor(None, self._first_message)
        if status != "ready":
            self.process.join(timeout=5)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.info = payload
        self._last_progress = time.monotonic()
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="engine-writer", daemon=True).start()
        return payload

    def _first_message(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return "failed", f"it exited with code {self.process.exitcode}"

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop; kill it if it does not."""
        self._closing = True
        if self.process is None:
            return
        loop = asyncio.get_running_loop()
        if self.info is not None:
            self._outbox.put(("shutdown",))
            await loop.run_in_executor(None, self.process.join, timeout)
        # else: still loading the model (a signal during startup): nothing to finish.
        if self.process.is_alive():
            if self.info is not None:
                log.warning("engine process did not stop in %.0f s; terminating it", timeout)
            self.process.terminate()
            await loop.run_in_executor(None, self.process.join, 5)
            if self.process.is_alive():
                self.process.kill()
        self._outbox.put(None)

    @property
    def alive(self) -> bool:
        return self.info is not None and not self.died.is_set()

    # -- requests --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Engine requests (one per sample) submitted and not finished."""
        return self._in_flight

    def is_tracked(self, key: str) -> bool:
        return key in self._tracked

    def submit(self, key: str, input_ids: list[int], params: Any, cache_salt: str | None,
               sink: Sink, group: str | None = None, rank: int = 0,
               tags: dict[str, Any] | None = None) -> None:
        """Start a request; its chunks (or an EngineError) arrive in `sink` as (key, item).
        `rank`: how many samples of the same HTTP request come before it (fair admission);
        `tags`: its program_id and priority (Engine.submit_stream's keywords)."""
        if not self.alive:
            sink.put_nowait((key, EngineError(503, "the engine is not running")))
            return
        if key in self._tracked:
            raise ValueError(f"request id {key!r} is already in use")
        self._tracked[key] = _Tracked(sink, params.n, group)
        self._in_flight += params.n
        self._outbox.put(("generate", key, input_ids, params, cache_salt, rank, tags or {}))

    def abort(self, key: str) -> None:
        """Stop a request; the engine still sends its last chunks (finish_reason "abort")."""
        if key in self._tracked:
            self._outbox.put(("abort", key))

    def detach(self, key: str) -> None:
        """The consumer is gone: abort the request and stop delivering its chunks."""
        tracked = self._tracked.get(key)
        if tracked is not None:
            tracked.detached = True
            self._outbox.put(("abort", key))

    def abort_matching(self, rid: str) -> int:
        """Abort every request whose key or group is `rid`; return how many."""
        keys = [k for k, t in self._tracked.items() if k == rid or t.group == rid]
        for key in keys:
            self.abort(key)
        return len(keys)

    def abort_all(self) -> None:
        for key in list(self._tracked):
            self.abort(key)

    async def call(self, method: str, **kwargs: Any) -> Any:
        """Run an Engine method (see engine_loop.CALLS) in the engine process."""
        if not self.alive:
            raise EngineCallError(EngineError(503, "the engine is not running"))
        assert self._loop is not None
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._outbox.put(("call", call_id, method, kwargs))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def call_counted(self, key: str, count: int, method: str, **kwargs: Any) -> Any:
        """A call that runs `count` engine requests named "<key>#<i>" (e.g. score): they count
        as in flight while it runs, and are aborted when the caller goes away."""
        self._in_flight += count
        try:
            return await self.call(method, request_id=key, **kwargs)
        except asyncio.CancelledError:
            self._outbox.put(("abort", key))
            raise
        finally:
            self._in_flight -= count

    # -- pipe threads and routing (results are handled on the event loop) -------------------

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not unpickle: never seen, but be loud
                log.exception("bad message from the engine process")
                continue
            self._loop.call_soon_threadsafe(self._dispatch, batch)
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_engine_exit)

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the engine is gone; the reader reports it

    def _dispatch(self, batch: list[tuple]) -> None:
        for message in batch:
            kind = message[0]
            if kind == "tokens":
                _, key, index, delta, token_ids, made, prompt_tokens, cached = message
                self._deliver_chunk(key, Chunk(index, delta, token_ids, None, made,
                                               prompt_tokens=prompt_tokens,
                                               cached_tokens=cached))
            elif kind == "chunk":
                self._deliver_chunk(message[1], message[2])
            elif kind == "error":
                tracked = self._tracked.pop(message[1], None)
                if tracked is not None:
                    self._in_flight -= tracked.remaining
                    if not tracked.detached:
                        tracked.sink.put_nowait((message[1], message[2]))
            elif kind == "beat":
                _, rounds, has_work = message
                if rounds != self._rounds or not has_work:
                    self._rounds = rounds
                    self._last_progress = time.monotonic()
            elif kind == "reply":
                _, call_id, result, error = message
                future = self._calls.get(call_id)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(EngineCallError(error))

    def _deliver_chunk(self, key: str, chunk: Chunk) -> None:
        tracked = self._tracked.get(key)
        if tracked is None:
            return
        if chunk.finished:
            tracked.remaining -= 1
            self._in_flight -= 1
            if tracked.remaining == 0:
                del self._tracked[key]
        if not tracked.detached:
            tracked.sink.put_nowait((key, chunk))

    async def watch(self, timeout: float) -> None:
        """The watchdog: when the engine has work but its loop has not moved for `timeout`
        seconds (or its heartbeats stopped: a frozen process), fail every request with a
        503, kill the engine process and set `died`, so that the server exits 1."""
        while not (self.died.is_set() or self._closing):
            await asyncio.sleep(min(1.0, timeout / 4))
            stuck = time.monotonic() - self._last_progress
            if stuck > timeout and not (self.died.is_set() or self._closing):
                log.error("the engine made no progress for %.0f s while it had work (or it "
                          "stopped answering): failing its requests and stopping "
                          "(--watchdog-timeout %g)", stuck, timeout)
                self.stalled = True
                self._fail_everything(EngineError(
                    503, f"the engine made no progress for {stuck:.0f} s; the server is "
                         f"restarting"))
                if self.process is not None:
                    self.process.kill()
                return

    def _on_engine_exit(self) -> None:
        if self._closing or self.died.is_set():
            return
        log.error("the engine process exited unexpectedly (exit code %s)",
                  self.process.exitcode if self.process else None)
        self._fail_everything(EngineError(500, "the engine process exited"))

    def _fail_everything(self, error: EngineError) -> None:
        self.died.set()
        for key, tracked in self._tracked.items():
            if not tracked.detached:
                tracked.sink.put_nowait((key, error))
        self._tracked.clear()
        self._in_flight = 0
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineCallError(error))
