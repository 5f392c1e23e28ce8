"""The engine process: an `Engine` driven over a pipe by the HTTP process.

Started with the spawn method by `EngineClient`. Besides the engine's own thread: a reader
thread turns pipe messages into callbacks on the main thread's asyncio loop, which starts
requests (`Engine.submit_stream`) and runs method calls; a writer thread sends the outputs.
The engine thread hands each output to the writer as it is made (one queue put: no event-loop
wake-up, which costs a system call, per token), and the writer turns everything that piled up
meanwhile, typically a whole step's tokens, into one pipe write. None of them ever waits on
the engine loop, so the engine steps while the pipe is busy, and vice versa.

The process exits when the HTTP process goes away: the pipe reaches EOF, or (if the pipe is
somehow kept open) the parent pid changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from radixlm.runtime.engine_process.messages import Chunk, EngineError, EngineInfo, LogprobEntry

log = logging.getLogger("radixlm.engine_process")

# Engine methods the HTTP process may call, each run on a worker thread because most block
# until the engine loop has done the work (pin_prefix computes the prefix, score a batch).
CALLS = ("pin_prefix", "release_prefix", "release_program", "score", "flush_cache", "stats",
         "load_lora", "unload_lora")
BEAT_SECONDS = 1.0


def run(options: dict[str, Any], conn: Connection, parent_pid: int, log_level: str) -> None:
    """Process entry point: load the engine, report, then serve until told to stop."""
    # Ctrl-C in a terminal signals the whole process group; the HTTP process decides how to
    # shut down and tells us, so the engine must not die half-way on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s engine: %(message)s")
    _watch_parent(parent_pid)
    try:
        from radixlm.runtime.engine.engine import Engine

        engine = Engine(**options)
        tokenizer = engine.tokenizer
        eos = set(engine.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        info = EngineInfo(max_model_len=engine.max_model_len,
                          vocab_size=engine.model_config.vocab_size,
                          architecture=engine.model_config.architecture,
                          eos_token_ids=sorted(eos), config=_plain(engine.config),
                          loras=engine.loras())
    except BaseException as exc:  # report why, or the HTTP process waits for nothing
        log.exception("engine failed to start")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    conn.send(("ready", info))
    try:
        asyncio.run(EngineServer(engine, conn).serve())
    finally:
        engine.close()


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(1)  # orphaned: nobody can ever read our results
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _plain(config: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(config)


class EngineServer:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        # Messages to send, and ("out", key, Output, time) from the engine thread, which the
        # writer turns into messages.
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Request key -> samples whose last output has not been sent. The loop adds keys, the
        # writer removes them.
        self.active: dict[str, int] = {}
        self._active_lock = threading.Lock()
        self.calls = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-call")
        self.stopped: asyncio.Event | None = None

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        threading.Thread(target=self._read, args=(loop,), name="pipe-reader",
                         daemon=True).start()
        threading.Thread(target=self._write, name="pipe-writer", daemon=True).start()
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        await self.stopped.wait()
        with self._active_lock:
            keys = list(self.active)
        for key in keys:
            self.engine.abort(key)
        deadline = time.monotonic() + 5  # let the aborts reach the HTTP process
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.outbox.put(None)
        self.calls.shutdown(wait=False, cancel_futures=True)

    # -- pipe ------------------------------------------------------------------------------

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the HTTP process is gone; nothing left to serve
            loop.call_soon_threadsafe(self._handle, message)
            if message[0] == "shutdown":
                return

    def _write(self) -> None:
        sent: dict[tuple[str, int], int] = {}  # (key, sample) -> its tokens sent so far
        while True:
            items = [self.outbox.get()]
            while True:
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            done = items[-1] is None
            batch = [self._message(m, sent) if m[0] == "out" else m
                     for m in items if m is not None]
            try:
                if batch:
                    self.conn.send(batch)
            except (OSError, ValueError):
                os._exit(0)  # the HTTP process is gone
            if done:
                return

    def _message(self, item: tuple[str, str, Any, float],
                 sent: dict[tuple[str, int], int]) -> tuple:
        """An engine output as the message that carries its new tokens."""
        _, key, out, made = item
        start = sent.pop((key, out.index), 0)
        if out.finish_reason is None:
            sent[(key, out.index)] = len(out.token_ids)
            if out.logprobs is None:  # most of a stream: a plain tuple (cheap to pickle)
                return ("tokens", key, out.index, out.delta, out.token_ids[start:], made,
                        out.prompt_tokens, out.cached_tokens)
        else:
            with self._active_lock:
                left = self.active.get(key, 1) - 1
                if left > 0:
                    self.active[key] = left
                else:
                    self.active.pop(key, None)
        return ("chunk", key, _chunk(out, start, made))

    def _beat(self) -> None:
        """Every BEAT_SECONDS, how far the engine loop got and whether it has work: the HTTP
        process's watchdog tells a stalled engine (or a frozen process: no beats) from a busy
        one with it."""
        while True:
            self.outbox.put(("beat", self.engine.loop_rounds, self.engine.has_work))
            time.sleep(BEAT_SECONDS)

    # -- messages --------------------------------------------------------------------------

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "generate":
            self._generate(*message[1:])
        elif kind == "abort":
            # Its "generate" was handled before it, so the engine sees add, then abort.
            self.engine.abort(message[1])
        elif kind == "call":
            _, call_id, method, kwargs = message
            asyncio.ensure_future(self._call(call_id, method, kwargs))
        elif kind == "shutdown":
            assert self.stopped is not None
            self.stopped.set()
        else:
            log.error("unknown message %r", kind)

    def _generate(self, key: str, input_ids: list[int], params: Any, cache_salt: str | None,
                  rank: int, tags: dict[str, Any]) -> None:
        put = self.outbox.put

        def on_output(out: Any) -> None:  # on the engine thread: one put, nothing more
            put(("out", key, out, time.monotonic()))

        with self._active_lock:
            self.active[key] = params.n
        try:
            self.engine.submit_stream(on_output, input_ids=input_ids, sampling_params=params,
                                      request_id=key, cache_salt=cache_salt, queue_rank=rank,
                                      **tags)
        except Exception as exc:
            with self._active_lock:
                self.active.pop(key, None)
            if isinstance(exc, ValueError):  # input the engine refused
                self.outbox.put(("error", key, EngineError(400, str(exc))))
            else:
                log.exception("request %s failed", key)
                self.outbox.put(("error", key, EngineError(500, f"{type(exc).__name__}: "
                                                                f"{exc}")))

    async def _call(self, call_id: int, method: str, kwargs: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        result, error = None, None
        try:
            if method not in CALLS:
                raise AttributeError(method)
            fn = getattr(self.engine, method)  # AttributeError: an engine without it
            result = await loop.run_in_executor(self.calls, lambda: fn(**kwargs))
        except AttributeError:
            error = EngineError(501, f"the engine does not support {method}")
        except ValueError as exc:
            error = EngineError(400, str(exc))
        except PermissionError as exc:
            error = EngineError(403, str(exc))
        except Exception as exc:
            log.exception("%s failed", method)
            error = EngineError(500, f"{type(exc).__name__}: {exc}")
        self.outbox.put(("reply", call_id, result, error))


def _chunk(out: Any, start: int, made: float) -> Chunk:
    """The part of an engine Output after its first `start` tokens, made at time `made`."""
    chunk = Chunk(index=out.index, delta=out.delta, token_ids=out.token_ids[start:],
                  logprobs=None if out.logprobs is None else
                  [_entry(e) for e in out.logprobs[start:]],
                  time=made, finish_reason=out.finish_reason,
                  prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
    if out.finish_reason is not None:
        chunk.text = out.text
        chunk.completion_tokens = out.completion_tokens
        chunk.matched_stop = out.matched_stop
        chunk.error = out.error
        chunk.error_invalid = out.error_invalid
        chunk.grammar_warnings = out.grammar_warnings
        chunk.queue_time = out.queue_time
        if out.queue_time is not None and out.time_to_first_token is not None:
            chunk.prefill_time = out.time_to_first_token - out.queue_time
        if out.prompt_logprobs is not None:
            chunk.prompt_logprobs = [None if e is None else _entry(e)
                                     for e in out.prompt_logprobs]
    return chunk


def _entry(entry: Any) -> LogprobEntry:
    top = None if entry.top is None else [(int(t), float(lp)) for t, lp in entry.top]
    return (int(entry.token_id), float(entry.logprob), top)
