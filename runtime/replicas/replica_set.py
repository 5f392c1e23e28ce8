"""`radixlm serve --dp N`: N engine replicas (Ray actors, see replicas/ray_actors.py) behind
the one HTTP front end, each with its own KV pool and radix cache.

`ReplicaSet` has the methods of `EngineClient`, so the routes, the watchdog and the shutdown
path use it unchanged. Each request goes where the router (replicas/routing.py) sends it,
given each replica's load (its requests in flight, known exactly here). A replica speaks the
engine process's pipe protocol (the same `EngineServer` runs inside the actor), so its client
is an `EngineClient` whose pipe is a Ray handle (replica_client.py).

When a replica dies, Ray restarts it (it loads its engine again). Its requests that had sent
nothing to their client yet are submitted again on another replica; the others end with an
error naming the replica (503). Nothing waits for the dead replica: new requests go to the
others until the new one is ready, and the router is told its cache is empty. The server
exits (status 1) only when every replica is gone for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from functools import partial
from typing import Any

from radixlm.runtime.engine_process.client import EngineCallError, Rerun, Sink
from radixlm.runtime.engine_process.messages import Chunk, EngineError, EngineInfo
from radixlm.runtime.replicas.replica_client import (
    ReplicaClient,
    ReplicaLost,
    load_engine,
    serve_engine,
)
from radixlm.runtime.replicas.routing import (
    ReplicaLoad,
    RouteRequest,
    cache_capacity,
    make_router,
)

log = logging.getLogger("radixlm.server")

MAX_RESTARTS = 8  # per replica, by Ray
# Stats that describe a replica rather than count its work: taken from one, not summed.
_SHARED_STATS = ("page_size", "max_model_len")


class _Relay:
    """Stands between a replica and a request's sink: notes whether anything reached the
    consumer, resubmits on another replica when the replica died before anything could have
    left the server (nothing delivered yet, or a consumer that sends only at the end: it is
    told to drop what it has), and tells the router when the request has ended."""

    def __init__(self, replicas: "ReplicaSet", key: str, route: RouteRequest,
                 submit_args: tuple, sink: Sink, samples: int) -> None:
        self.replicas = replicas
        self.key = key
        self.route = route
        self.submit_args = submit_args  # (input_ids, params, cache_salt, group, rank, tags)
        self.sink = sink
        self.n = samples
        self.samples = samples  # samples whose last chunk has not come
        self.replica = -1
        self.delivered = False
        self.retried = False

    def put_nowait(self, item: tuple[str, Chunk | EngineError]) -> None:
        _, payload = item
        if isinstance(payload, ReplicaLost) and not self.retried and (
                not self.delivered or getattr(self.sink, "rerunnable", False)):
            self.retried = True
            if self.delivered:
                self.sink.put_nowait((self.key, Rerun()))
            self.delivered = False
            self.samples = self.n
            self.replicas._retry(self)
            return
        self.delivered = True
        if isinstance(payload, EngineError):
            self.samples = 0
        elif payload.finished:
            self.samples -= 1
        self.sink.put_nowait(item)
        if self.samples == 0:
            self.replicas._ended(self)


class ReplicaSet:
    """N replicas behind one front end, with EngineClient's interface (see its docstrings)."""

    def __init__(self, options: dict[str, Any], log_level: str = "info", *, dp_size: int,
                 policy: str = "cache_aware", ray_address: str | None = None,
                 ray_host: str | None = None) -> None:
        """`ray_address`: the Ray cluster to join (default: RAY_ADDRESS, else a local one);
        `ray_host`: this node's address in it, where Ray listens (default: 127.0.0.1 for a
        local cluster, Ray's pick when joining one; see ray_actors.connect)."""
        self.options = options
        self.log_level = log_level
        self.dp_size = dp_size
        self.policy = policy
        self.ray_address = ray_address
        self.ray_host = ray_host
        self.router = make_router(policy, dp_size)
        self.replicas: list[ReplicaClient] = []
        self.info: EngineInfo | None = None
        self.died = asyncio.Event()  # every replica is gone for good
        self.stalled = False
        self._owner: dict[str, _Relay] = {}  # request key -> its relay (and so its replica)
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        from radixlm.runtime.replicas import ray_actors

        loop = asyncio.get_running_loop()
        local = not (self.ray_address or os.environ.get("RAY_ADDRESS"))
        cpus = os.cpu_count() or 1
        where = await loop.run_in_executor(None, partial(
            ray_actors.connect, self.ray_address, max(cpus, self.dp_size) if local else None,
            self.ray_host))
        device = str(self.options.get("device") or "auto")
        ranks = self.options.get("tp_size", 1) * self.options.get("pp_size", 1)
        gpus = (ranks if device.startswith("cuda") or (
            device == "auto" and _cluster_gpus() > 0) else 0)
        threads = max(1, cpus // self.dp_size) if local and not gpus else None
        log.info("starting %d engine replicas on the Ray cluster at %s (%s per replica, "
                 "router %s)", self.dp_size, where, f"{gpus} GPU(s)" if gpus else "1 CPU",
                 self.policy)
        load = partial(load_engine, self.options, threads)
        handles = [ray_actors.ReplicaHandle(i, load, serve_engine, num_cpus=0 if gpus else 1,
                                              num_gpus=gpus, max_restarts=MAX_RESTARTS)
                   for i in range(self.dp_size)]
        self.replicas = [ReplicaClient(h, self._on_ready, self.log_level) for h in handles]
        infos = await asyncio.gather(*(r.start() for r in self.replicas),
                                     return_exceptions=True)
        failed = [(i, e) for i, e in enumerate(infos) if isinstance(e, BaseException)]
        if failed:
            await self.close()
            i, exc = failed[0]
            raise RuntimeError(f"engine replica {i} failed to start: {exc}")
        for r in self.replicas:
            log.info("engine replica %d ready: pid %d on %s", r.index, r.place.pid, r.place.node)
        if self.policy == "cache_aware":
            # The router's picture of each replica's cache holds about what its pool and
            # tiers do.
            stats = await self.replicas[0].call("stats")
            self.router = make_router(self.policy, self.dp_size,
                                      tree_capacity=cache_capacity(stats))
        first = infos[0]
        config = dict(first.config)
        # The server's queue limit counts what all replicas run at once.
        config["max_running_requests"] = config.get("max_running_requests", 0) * self.dp_size
        config["dp_size"] = self.dp_size
        config["router"] = self.policy
        self.info = dataclasses.replace(first, config=config)
        return self.info

    def _on_ready(self, index: int, down_seconds: float | None) -> None:
        replica = self.replicas[index]
        if down_seconds is None:  # gone for good
            if all(r.gone for r in self.replicas) and not self._closing:
                log.error("every engine replica is gone")
                self.died.set()
            return
        # A disk tier outlives the process: the restarted replica finds its prefixes again.
        self.router.replica_reset(index, keeps_cache=self.options.get("disk_cache_dir")
                                  is not None)
        log.info("engine replica %d replaced in %.1f s: pid %d on %s (restart %d)", index,
                 down_seconds, replica.place.pid, replica.place.node, replica.restarts)

    async def close(self, timeout: float = 10.0) -> None:
        self._closing = True
        await asyncio.gather(*(r.close(timeout) for r in self.replicas), return_exceptions=True)
        from radixlm.runtime.replicas import ray_actors

        # Leaves a cluster we joined; stops the local one we started.
        await asyncio.get_running_loop().run_in_executor(None, ray_actors.disconnect)

    @property
    def alive(self) -> bool:
        return self.info is not None and any(r.alive for r in self.replicas)

    def replica_stats(self) -> list[dict[str, Any]]:
        return [{"replica": r.index, "alive": r.alive, "restarts": r.restarts,
                 "in_flight": r.in_flight} for r in self.replicas]

    # -- requests ----------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    def is_tracked(self, key: str) -> bool:
        return key in self._owner or any(r.is_tracked(key) for r in self.replicas)

    def submit(self, key: str, input_ids: list[int], params: Any, cache_salt: str | None,
               sink: Sink, group: str | None = None, rank: int = 0,
               tags: dict[str, Any] | None = None) -> None:
        if key in self._owner:
            raise ValueError(f"request id {key!r} is already in use")
        relay = _Relay(self, key, RouteRequest(token_ids=input_ids, session=cache_salt),
                       (input_ids, params, cache_salt, group, rank, tags), sink, params.n)
        self._send(relay)

    def _send(self, relay: _Relay) -> None:
        replica = self._choose(relay.route)
        if replica is None:
            relay.sink.put_nowait((relay.key, EngineError(503, "no engine replica is "
                                                               "running")))
            return
        relay.replica = replica
        log.debug("request %s (%d tokens) -> replica %d", relay.key,
                  len(relay.submit_args[0]), replica)
        self._owner[relay.key] = relay
        input_ids, params, cache_salt, group, rank, tags = relay.submit_args
        self.replicas[replica].submit(relay.key, input_ids, params, cache_salt, relay, group,
                                      rank, tags)

    def _retry(self, relay: _Relay) -> None:
        """Its replica died before the request sent anything: run it elsewhere."""
        self._ended(relay)
        log.info("request %s resubmitted after replica %d was lost", relay.key, relay.replica)
        self._send(relay)

    def _ended(self, relay: _Relay) -> None:
        if self._owner.get(relay.key) is relay:
            del self._owner[relay.key]
            self.router.finished(relay.replica, relay.route)

    def _choose(self, route: RouteRequest) -> int | None:
        loads = []
        for r in self.replicas:
            running_cap = max(1, (r.info.config.get("max_running_requests") or 1)
                              if r.info else 1)
            flight = r.in_flight
            loads.append(ReplicaLoad(running=min(flight, running_cap),
                                     waiting=max(0, flight - running_cap), healthy=r.alive))
        if not any(load.healthy for load in loads):
            return None
        return self.router.choose(route, loads)

    def abort(self, key: str) -> None:
        relay = self._owner.get(key)
        if relay is not None:
            self.replicas[relay.replica].abort(key)

    def detach(self, key: str) -> None:
        relay = self._owner.get(key)
        if relay is not None:
            self.replicas[relay.replica].detach(key)
            self._ended(relay)  # nothing more reaches the relay once detached

    def abort_matching(self, rid: str) -> int:
        return sum(r.abort_matching(rid) for r in self.replicas)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    # -- calls -------------------------------------------------------------------------------

    async def call(self, method: str, **kwargs: Any) -> Any:
        if method == "stats":
            return await self._stats()
        if method == "flush_cache":
            for r in self._live():
                await r.call("flush_cache")
            return None
        if method in ("load_lora", "unload_lora"):  # every replica serves every adapter
            for r in self._live():
                await r.call(method, **kwargs)
            return None
        if method == "release_program":  # its calls may have run on any replica
            results = [await r.call(method, **kwargs) for r in self._live()]
            return any(results)
        if method == "release_prefix":
            index, _, lease = str(kwargs.get("lease_id", "")).partition(":")
            if not (index.isdigit() and int(index) < self.dp_size):
                return False
            replica = self.replicas[int(index)]
            if not replica.alive:
                return False  # its leases went with it
            return await replica.call(method, **{**kwargs, "lease_id": lease})
        route = RouteRequest(token_ids=kwargs.get("input_ids") or kwargs.get("prefix_ids"),
                             session=kwargs.get("cache_salt"))
        index = self._choose(route)
        if index is None:
            raise EngineCallError(EngineError(503, "no engine replica is running"))
        try:
            result = await self.replicas[index].call(method, **kwargs)
        finally:
            self.router.finished(index, route)
        if method == "pin_prefix" and result is not None:
            return f"{index}:{result}"  # release_prefix finds the replica from it
        return result

    async def call_counted(self, key: str, count: int, method: str, **kwargs: Any) -> Any:
        route = RouteRequest(token_ids=kwargs.get("prefix_ids"), session=kwargs.get("cache_salt"))
        index = self._choose(route)
        if index is None:
            raise EngineCallError(EngineError(503, "no engine replica is running"))
        try:
            return await self.replicas[index].call_counted(key, count, method, **kwargs)
        finally:
            self.router.finished(index, route)

    def _live(self) -> list[ReplicaClient]:
        return [r for r in self.replicas if r.alive]

    async def _stats(self) -> dict[str, Any]:
        """Every live replica's statistics, summed (sizes taken from one), and each one's
        under "replicas"."""
        live = self._live()
        if not live:
            raise EngineCallError(EngineError(503, "no engine replica is running"))
        results = await asyncio.gather(*(r.call("stats") for r in live), return_exceptions=True)
        total: dict[str, Any] = {}
        per_replica = []
        for r, stats in zip(live, results):
            if isinstance(stats, BaseException):
                continue
            per_replica.append({"replica": r.index, "restarts": r.restarts, **stats})
            for name, value in stats.items():
                if name == "programs":
                    merge_programs(total.setdefault("programs", {}), value)
                elif name in _SHARED_STATS or not isinstance(value, (int, float)) \
                        or isinstance(value, bool):
                    total.setdefault(name, value)
                else:
                    total[name] = total.get(name, 0) + value
        total["replicas"] = per_replica
        total["replicas_alive"] = len(live)
        return total

    # -- watchdog ----------------------------------------------------------------------------

    async def watch(self, timeout: float) -> None:
        """A replica with work whose loop has not moved for `timeout` seconds (or that stopped
        answering) has its requests failed and is killed; Ray restarts it."""
        while not (self.died.is_set() or self._closing):
            await asyncio.sleep(min(1.0, timeout / 4))
            for r in self.replicas:
                stuck = r.stuck_for()
                if r.alive and stuck > timeout and not self._closing:
                    log.error("engine replica %d made no progress for %.0f s while it had "
                              "work (or stopped answering): failing its requests and "
                              "restarting it (--watchdog-timeout %g)", r.index, stuck, timeout)
                    r.fail_stalled(stuck)


def _cluster_gpus() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0)


def merge_programs(into: dict[str, dict[str, Any]], programs: dict[str, dict[str, Any]]) -> None:
    """One replica's per-program statistics added to `into`: a program whose calls went to
    several replicas has its counts summed, and its last time the latest."""
    for program_id, record in programs.items():
        mine = into.setdefault(program_id, {})
        for field, value in record.items():
            if field == "last_seen":
                mine[field] = max(mine.get(field, value), value)
            else:
                mine[field] = mine.get(field, 0) + value
