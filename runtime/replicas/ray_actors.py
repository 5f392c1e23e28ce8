"""Engine replicas as Ray actors: placement, restarts and cluster membership are Ray's.

Each replica is one actor (`_ReplicaActor`) holding one engine with its own KV pool and radix
cache. What the engine is and how it talks are given by the caller, as two functions Ray
pickles by reference and runs inside the actor:

    load()             -> (engine, info)     at start, and again after every restart
    serve(engine, end)                       on a thread, until `end` delivers a stop message

`end` has the two methods of a pipe connection: `recv()` (the next message from the front
end, blocking) and `send(batch)` (a list of messages to it). The front end's side is
`ReplicaHandle`: `send(message)` and `recv() -> batch`, like the other end of that pipe, so a
client written for an engine process drives a replica unchanged. Messages go in order: one push
call at a time carries everything queued since the last; outputs come back by long polling,
one call at a time, everything made since the last.

A replica that dies (its process killed, its node lost) is restarted by Ray up to
`max_restarts` times, which runs `load` again. The handle turns the loss into `EOFError` from
`recv()`, like a pipe's end, and `wait_ready()` returns once the new incarnation has loaded its
engine, or raises `ReplicaGone` when Ray will not restart it.

Only this module and those of distributed/ray_cluster.py and parallel/ray_workers.py import
Ray; the server imports it only for `--dp` > 1.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

# The replica set calls them as ray_actors.connect and ray_actors.disconnect.
from radixlm.runtime.distributed.ray_cluster import connect, disconnect  # noqa: F401

log = logging.getLogger("radixlm.replicas")

PULL_SECONDS = 2.0  # a long poll returns after this long with nothing to say
# Variables a replica must not inherit: a tensor-parallel group inside a replica meets on its
# own machine at a port of its own (two replicas of one machine would otherwise collide).
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "RADIXLM_TP_EXTERNAL_WORKERS")


class ReplicaGone(RuntimeError):
    """The replica died and Ray will not restart it (restarts used up, or it failed to
    start)."""


@dataclass(frozen=True)
class ReplicaPlace:
    """Where a replica's current incarnation runs."""

    pid: int
    node: str  # the node's IP address


class _ActorEnd:
    """The actor's end of the message channel, handed to `serve`."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: list[Any] = []
        self.ready = threading.Condition()

    def recv(self) -> Any:
        return self.inbox.get()

    def send(self, batch: list[Any]) -> None:
        with self.ready:
            self.outbox.extend(batch)
            self.ready.notify()


class _ReplicaActor:
    """One engine replica, inside its Ray actor. Ray runs its methods on a few threads (a long
    poll must not block a push); the front end keeps at most one push and one poll in flight,
    so messages stay in order."""

    def __init__(self, load: Callable[[], tuple[Any, Any]],
                 serve: Callable[[Any, _ActorEnd], None]) -> None:
        for name in _RENDEZVOUS_VARS:
            os.environ.pop(name, None)
        self.engine, self.info = load()
        self.end = _ActorEnd()
        self.thread = threading.Thread(target=serve, args=(self.engine, self.end),
                                       name="replica-serve", daemon=True)
        self.thread.start()

    def ready(self) -> tuple[Any, ReplicaPlace]:
        return self.info, ReplicaPlace(os.getpid(), ray.util.get_node_ip_address())

    def push(self, messages: list[Any]) -> None:
        for message in messages:
            self.end.inbox.put(message)

    def pull(self, timeout: float) -> list[Any]:
        with self.end.ready:
            self.end.ready.wait_for(lambda: self.end.outbox, timeout)
            batch, self.end.outbox = self.end.outbox, []
        return batch

    def join(self, timeout: float) -> bool:
        """Wait for `serve` to return (after its stop message); True when it did."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


class ReplicaHandle:
    """The front end's end of one replica: a pipe-like `send` / `recv`, plus waiting for the
    replica to be ready (again) and stopping it."""

    def __init__(self, index: int, load: Callable, serve: Callable, *, num_cpus: float,
                 num_gpus: float, max_restarts: int) -> None:
        self.index = index
        self.max_restarts = max_restarts
        actor = ray.remote(_ReplicaActor).options(
            name=None, num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts,
            max_task_retries=0, max_concurrency=4, scheduling_strategy="SPREAD")
        self.actor = actor.remote(load, serve)
        self._pushes: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._epoch = 0  # bumped when the replica is lost: queued pushes of before are dropped
        # Set by `stop`: no thread calls into Ray after it, so Ray can be shut down safely (a
        # thread still inside a Ray call when the interpreter exits aborts the process).
        self._stopped = threading.Event()
        self._push_thread = threading.Thread(target=self._push_loop, name=f"replica-{index}-push",
                                             daemon=True)
        self._push_thread.start()

    # -- the pipe ----------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue a message; never blocks. Lost with the replica if it dies first."""
        self._pushes.put((self._epoch, message))

    def recv(self) -> list[Any]:
        """The next batch of messages from the replica; EOFError once it is lost or stopped."""
        while True:
            if self._stopped.is_set():
                raise EOFError(f"replica {self.index} stopped")
            try:
                batch = ray.get(self.actor.pull.remote(PULL_SECONDS))
            except RayActorError as exc:
                self._epoch += 1
                raise EOFError(f"replica {self.index} lost: {type(exc).__name__}") from exc
            if batch:
                return batch

    def _push_loop(self) -> None:
        while True:
            items = [self._pushes.get()]
            while True:
                try:
                    items.append(self._pushes.get_nowait())
                except queue.Empty:
                    break
            batch = [item[1] for item in items if item is not None and item[0] == self._epoch]
            if batch:
                try:
                    ray.get(self.actor.push.remote(batch))
                except RayActorError:
                    pass  # lost: the reader reports it; what was pushed is gone with it
            if None in items:
                return

    # -- lifecycle ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> tuple[Any, ReplicaPlace]:
        """(info, place) once the replica's engine is loaded; ReplicaGone when Ray will not
        start it (again), TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        died = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"replica {self.index} was not ready in {timeout:.0f} s")
            if self._stopped.is_set():
                raise ReplicaGone(f"replica {self.index} stopped")
            try:
                # Short waits, so that a stop is noticed while the replica loads.
                return ray.get(self.actor.ready.remote(), timeout=min(left, PULL_SECONDS))
            except GetTimeoutError:
                continue
            except ActorUnavailableError:  # restarting: ask again shortly
                time.sleep(0.2)
            except ActorDiedError as exc:
                # Dead for good, or a call that raced the restart: ask a few times.
                died += 1
                if died >= 3 or "error raised in its creation task" in str(exc):
                    raise ReplicaGone(f"replica {self.index} is gone: {_reason(exc)}") from None
                time.sleep(0.5)

    def kill(self, restart: bool = True) -> None:
        """Kill the replica's process; Ray restarts it when `restart` and restarts are left."""
        ray.kill(self.actor, no_restart=not restart)

    def stop(self, timeout: float) -> None:
        """After a stop message was sent: wait for the replica to finish, then end it. Its
        threads here end too (a reader in `recv` within PULL_SECONDS of the call)."""
        self._pushes.put(None)
        self._push_thread.join(timeout)  # the stop message, and what came before it, pushed
        try:
            ray.get(self.actor.join.remote(timeout), timeout=timeout + 5)
        except Exception:  # gone already, or stuck: it is killed below either way
            pass
        self._stopped.set()
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass


def _reason(exc: BaseException) -> str:
    """The first lines of a Ray error: its messages carry whole tracebacks."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[-2:])[:500] if lines else type(exc).__name__
