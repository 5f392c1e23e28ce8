"""The engine thread: the one thread that builds an EngineCore and drives it. Other threads
reach the core only through the thread's inbox: add requests, abort one, call a function on
the core, stop. The loop blocks on the inbox only when the core is idle; otherwise it takes
what arrived and steps. Stopping fails whatever is still in flight (each request finishes
with finish_reason "abort" and error CLOSED), so that no caller waits on a loop that is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

import torch

from radixlm.runtime.engine.engine_core import EngineCore
from radixlm.runtime.parallel.sharded import TensorParallelGroup
from radixlm.runtime.scheduling.request import Request

log = logging.getLogger(__name__)

_STOP = object()
# The error of the requests a close found in flight (Output.error).
CLOSED = "the engine was closed"


class EngineClosedError(RuntimeError):
    """A call on a closed engine, or one that was waiting when the engine was closed."""


class EngineThread:
    """Starts the thread, which runs `build` and then the loop; returns once the core is
    built, raising here what `build` raised. `tp`: the tensor-parallel ranks to keep alive
    with heartbeats while idle (they time out after `tp_timeout` seconds)."""

    def __init__(self, build: Callable[[], EngineCore], tp: TensorParallelGroup | None,
                 tp_timeout: float) -> None:
        self._tp = tp
        self._tp_timeout = tp_timeout
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Held while checking `stopped` and queueing: nothing can be queued behind _STOP,
        # where the loop would never see it and its caller would wait forever.
        self._closing = threading.Lock()
        self.stopped = False
        # Rounds of the engine loop so far: a watchdog on another thread reads it (with
        # has_work) to tell a busy engine from a stalled one.
        self.rounds = 0
        self.core: EngineCore | None = None  # None again once the loop has ended
        self.final_stats: dict[str, Any] = {}  # the core's last stats, kept when it goes
        # The engine thread loads the model too, so that it is the only thread of ours that
        # runs torch's parallel CPU work: OpenMP gives each such thread a pool of its own, and
        # once the pools together hold more threads than there are cores, every worker stops
        # spinning between parallel regions and each small op pays a futex wake-up (decode on
        # 2 cores measured 55% slower).
        built: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        # `build` goes to the thread, not to self: the thread lets go of it when it ends, so
        # no cycle back to the Engine that owns this outlives the loop.
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name="radixlm-engine", daemon=True)
        self._thread.start()
        failure = built.get()
        if failure is not None:
            self._thread.join()
            raise failure

    # -- from any thread ----------------------------------------------------------------------

    def submit(self, requests: list[Request]) -> None:
        self._put(("add", requests))

    def abort(self, request_id: str) -> None:
        """Abort the request, or every sample "<request_id>#<i>" of it."""
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread (the core is not thread-safe); return its result
        or raise its exception here."""
        reply: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._put(("call", (fn, reply)))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def stop(self, timeout: float = 30) -> bool:
        """Stop the loop once it has handled what is in the inbox before this, failing the
        requests still in flight, then release the core's workers and the tensor-parallel
        ranks (on the engine thread, after its last step); later calls raise
        EngineClosedError. Waits up to `timeout` seconds for the loop to end (not when called
        from the engine thread itself, e.g. an on_output callback). False when the thread was
        already stopping."""
        with self._closing:
            if self.stopped:
                return False
            self.stopped = True
            self._inbox.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)
        return True

    def _put(self, message: tuple[str, Any]) -> None:
        with self._closing:
            if self.stopped:
                raise EngineClosedError("the engine is closed")
            self._inbox.put(message)

    # -- on the engine thread -----------------------------------------------------------------

    def _run(self, build: Callable[[], EngineCore],
             built: queue.SimpleQueue[BaseException | None]) -> None:
        try:
            self.core = build()
        except BaseException as exc:
            built.put(exc)
            return
        built.put(None)
        try:
            self._loop()
        finally:
            # Here, on this thread, once no step can be running: the grammar compile workers
            # and the tensor-parallel ranks are released after the last step, never under one.
            self.core.shutdown()
            if self._tp is not None:
                self._tp.shutdown()
            self._release()

    def _release(self) -> None:
        """Let go of the core and everything it holds (weights, KV pool, graphs, adapter
        slots) as the loop ends: an Engine that stays referenced after close (the name a
        `with Engine() as engine` block leaves behind) must not keep a GPU's memory from the
        next engine, which sizes its KV pool by what the device has free."""
        self.final_stats = self.core.stats()
        device = self.core.device
        self.core = None  # no reference cycle holds it (tests/test_engine.py): freed here
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _loop(self) -> None:
        core = self.core
        # Idle tensor-parallel workers wait in a collective that times out: wake up to send
        # them a heartbeat well within the timeout.
        beat = None if self._tp is None else self._tp_timeout / 4
        while True:
            # Block only when idle; otherwise take what arrived and keep stepping.
            try:
                message = self._inbox.get(block=not core.has_work, timeout=beat)
            except queue.Empty:
                message = None
            if beat is not None:  # sends only when nothing was sent for `beat` seconds
                self._tp.heartbeat(beat)
            while message is not None:
                if message is _STOP:
                    self._fail_in_flight()
                    return
                self._handle(message)
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    message = None
            core.expire_leases()
            self.rounds += 1
            if core.has_work:
                try:
                    core.step()
                except Exception as exc:  # a bug in postprocessing: fail the work, not the loop
                    log.exception("engine step failed")
                    for rid in list(core.requests):
                        core.abort(rid, error=f"internal error: {exc}")

    def _fail_in_flight(self) -> None:
        """Finish every request still waiting or running with error CLOSED: its caller gets
        a last Output instead of waiting for one that would never come."""
        for rid in list(self.core.requests):
            try:
                self.core.abort(rid, error=CLOSED)
            except Exception:  # e.g. a callback that raises: the others still get theirs
                log.exception("failing request %s at close", rid)

    def _handle(self, message: tuple[str, Any]) -> None:
        kind, payload = message
        if kind == "add":
            for request in payload:
                self.core.add_request(request)
        elif kind == "call":
            fn, reply = payload
            try:
                reply.put((True, fn(self.core)))
            except Exception as exc:
                reply.put((False, exc))
        elif kind == "abort":
            if not self.core.abort(payload):
                prefix = f"{payload}#"
                for rid in [r for r in self.core.requests if r.startswith(prefix)]:
                    self.core.abort(rid)
