"""One replica's side of `radixlm serve --dp N`: what runs inside its Ray actor (loading the
engine, serving the engine process's pipe protocol over the actor's channel) and, in the front
end, `ReplicaClient`: an `EngineClient` whose pipe is the replica's Ray handle
(replicas/ray_actors.py), which notices the replica's loss, waits for Ray to restart it and
stops it so that no thread of ours is inside a Ray call when Ray shuts down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.runtime.engine_process.client import EngineClient
from radixlm.runtime.engine_process.messages import EngineError, EngineInfo

log = logging.getLogger("radixlm.server")

START_TIMEOUT = 1800.0  # seconds a replica may take to load (a first download included)


# -- inside the actor --------------------------------------------------------------------------

def load_engine(options: dict[str, Any], threads: int | None) -> tuple[Any, EngineInfo]:
    """The replica's engine and what the front end needs to know of it."""
    import torch

    from radixlm.runtime.engine.engine import Engine

    if threads:
        torch.set_num_threads(threads)
    engine = Engine(**options)
    eos = set(engine.model_config.eos_token_ids)
    tokenizer = engine.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    info = EngineInfo(max_model_len=engine.max_model_len,
                      vocab_size=engine.model_config.vocab_size,
                      architecture=engine.model_config.architecture,
                      eos_token_ids=sorted(eos), config=dataclasses.asdict(engine.config))
    return engine, info


def serve_engine(engine: Any, end: Any) -> None:
    """Serve the pipe protocol over the actor's channel until the stop message."""
    from radixlm.runtime.engine_process.loop import EngineServer

    try:
        asyncio.run(EngineServer(engine, end).serve())
    finally:
        engine.close()


class ReplicaLost(EngineError):
    """The replica serving a request died (a request with nothing sent yet is retried)."""


class ReplicaClient(EngineClient):
    """An EngineClient whose engine is one replica actor."""

    def __init__(self, handle: Any, on_ready: Any, log_level: str) -> None:
        super().__init__({}, log_level)
        self.handle = handle
        self.index = handle.index
        self.on_ready = on_ready  # called (index, seconds down or None) when (re)started
        self.gone = False  # dead for good
        self.restarts = 0
        self.place: Any = None
        self._recovering = False
        # Waiting for the replica blocks a thread for as long as it loads: one of its own.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-wait")
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None

    async def start(self) -> EngineInfo:
        self._loop = asyncio.get_running_loop()
        self._conn = self.handle
        info, self.place = await self._loop.run_in_executor(self._waiter,
                                                            self.handle.wait_ready,
                                                            START_TIMEOUT)
        self._resume(info)
        self._writer = threading.Thread(target=self._write, name=f"replica-{self.index}-writer",
                                        daemon=True)
        self._writer.start()
        return info

    def _resume(self, info: EngineInfo) -> None:
        self.info = info
        self.died.clear()
        self.stalled = False
        self._rounds = -1
        self._last_progress = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"replica-{self.index}-reader",
                                        daemon=True)
        self._reader.start()

    def _on_engine_exit(self) -> None:
        if self._closing or self._recovering:
            return
        if not self.died.is_set():
            log.error("engine replica %d was lost (pid %s on %s); Ray is restarting it",
                      self.index, self.place.pid if self.place else "?",
                      self.place.node if self.place else "?")
            self._fail_everything(ReplicaLost(
                503, f"engine replica {self.index} failed while serving this request "
                     f"(it is being restarted); retry"))
        self._recovering = True
        asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        lost = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            info, self.place = await loop.run_in_executor(self._waiter, self.handle.wait_ready,
                                                          START_TIMEOUT)
        except Exception as exc:
            log.error("engine replica %d will not come back: %s", self.index, exc)
            self.gone = True
            self._recovering = False
            self.on_ready(self.index, None)
            return
        self._recovering = False
        if self._closing:
            return
        self.restarts += 1
        self._resume(info)
        self.on_ready(self.index, time.monotonic() - lost)

    def stuck_for(self) -> float:
        """Seconds since the replica's loop last showed progress while it had work."""
        return time.monotonic() - self._last_progress

    def fail_stalled(self, seconds: float) -> None:
        """The watchdog's verdict: fail its requests and kill it (Ray restarts it)."""
        self.stalled = True
        self._fail_everything(ReplicaLost(
            503, f"engine replica {self.index} made no progress for {seconds:.0f} s; it is "
                 f"being restarted"))
        self.handle.kill(restart=True)

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        if self.info is not None and self.alive:
            self._outbox.put(("shutdown",))
        self._outbox.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._stop, timeout)

    def _stop(self, timeout: float) -> None:
        """Stop the replica and end every thread of ours that calls into Ray: Ray is shut down
        next, and a thread still inside a Ray call when the interpreter exits aborts it."""
        if self._writer is not None:
            self._writer.join(timeout)  # the stop message has reached the handle
        self.handle.stop(timeout)
        self._waiter.shutdown(wait=True, cancel_futures=True)
        if self._reader is not None:
            self._reader.join(timeout)
