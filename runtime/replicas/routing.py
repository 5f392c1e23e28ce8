"""Which data-parallel replica serves a request.

A front end holding N engine replicas asks a `Router` for each request:

    router = make_router("cache_aware", num_replicas=4)
    replica = router.choose(RouteRequest(token_ids=ids, session=salt), loads)
    ...                                   # send it there; when it ends (done or failed):
    router.finished(replica, request)

`loads` is one `ReplicaLoad` per replica, as recent as the caller has it. Unhealthy replicas
never get a request; when none is healthy, `choose` raises `NoHealthyReplica`. A replica that
was restarted has an empty cache, unless a disk tier kept it: tell the router with
`replica_reset`.

The router also counts the requests it sent to each replica that have not `finished`; that
count is a floor on the replica's load, so a burst routed between two load reports does not
all go to the replica that looked idle. Call `finished` exactly once per `choose`.

Routers are not thread-safe: call them from one thread (the front end's event loop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.replicas.routed_prefixes import RoutedPrefixes

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class RouteRequest:
    """What the router sees of a request."""

    token_ids: Sequence[int] | None = None  # the prompt's tokens when the front end has them
    text: str | None = None  # else its text (routed on a character prefix)
    session: str | None = None  # cache_salt / session id / "user": sticky routing


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load as last reported."""

    running: int = 0  # requests the replica is working on
    waiting: int = 0  # queued there
    healthy: bool = True  # False: never route there

    @property
    def total(self) -> int:
        return self.running + self.waiting


class NoHealthyReplica(RuntimeError):
    """Every replica is marked unhealthy."""


class Router(ABC):
    """Picks a replica per request. Subclasses implement `_pick`."""

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self._outstanding = [0] * num_replicas  # chosen, not yet finished

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> int:
        """The replica for `request`. Counts it as outstanding there until `finished`."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.num_replicas} replicas")
        healthy = [i for i, load in enumerate(loads) if load.healthy]
        if not healthy:
            raise NoHealthyReplica(f"none of the {self.num_replicas} replicas is healthy")
        effective = [(t if t > out else out) for t, out in
                     zip([load.running + load.waiting for load in loads], self._outstanding)]
        replica = self._pick(request, healthy, effective)
        self._outstanding[replica] += 1
        return replica

    def finished(self, replica: int, request: RouteRequest) -> None:
        """A request routed to `replica` ended (completed, failed or aborted)."""
        self._check(replica)
        self._outstanding[replica] = max(0, self._outstanding[replica] - 1)

    def replica_reset(self, replica: int, keeps_cache: bool = False) -> None:
        """`replica` was restarted: nothing of it is in flight, and nothing of it is cached
        unless `keeps_cache` (a disk tier outlives the process)."""
        self._check(replica)
        self._outstanding[replica] = 0

    def outstanding(self) -> list[int]:
        """Per replica, the requests routed there and not yet finished."""
        return list(self._outstanding)

    @abstractmethod
    def _pick(self, request: RouteRequest, healthy: list[int], loads: list[int]) -> int:
        """One of `healthy` (ascending replica indices, never empty). `loads[i]` is replica
        i's running + waiting requests (at least what this router has outstanding there)."""

    def _check(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} out of range 0..{self.num_replicas - 1}")


class RoundRobinRouter(Router):
    """Each healthy replica in turn, ignoring load and content."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def _pick(self, request: RouteRequest, healthy: list[int], loads: list[int]) -> int:
        # The first healthy replica at or after the cursor, wrapping around.
        replica = next((i for i in healthy if i >= self._next), healthy[0])
        self._next = (replica + 1) % self.num_replicas
        return replica


class LeastLoadRouter(Router):
    """The healthy replica with the fewest running + waiting requests. Ties rotate, so an idle
    cluster (or one whose load reports lag) still spreads requests."""

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def _pick(self, request: RouteRequest, healthy: list[int], loads: list[int]) -> int:
        replica = least_loaded(healthy, loads, self._next)
        self._next = (replica + 1) % self.num_replicas
        return replica


def least_loaded(candidates: Sequence[int], loads: Sequence[int], start: int) -> int:
    """The candidate with the smallest load; among equals, the first at or after `start`
    (wrapping around)."""
    low = min(map(loads.__getitem__, candidates))
    tied = [i for i in candidates if loads[i] == low]
    return next((i for i in tied if i >= start), tied[0])


class CacheAwareRouter(Router):
    """Send a request where its prefix most likely is cached, unless that replica is overloaded.

    The router keeps a `RoutedPrefixes` tree of the prompts it sent to each replica (an
    estimate of each replica's radix cache: it never hears of evictions there, only of
    restarts). For each request, in order:

    1. **Session**: a request with a `session` seen before goes to the replica that session
       last used, if that replica is healthy and not overloaded. The map holds the
       `max_sessions` most recently used sessions.
    2. **Prefix**: among healthy replicas that are not overloaded, the one with the longest
       routed prefix of this prompt, when that prefix has at least `min_match` units (tokens,
       or characters when routing on text). Ties go to the least loaded.
    3. **Load**: otherwise the least loaded healthy replica (ties rotate).

    A replica is **overloaded** when its load (running + waiting) exceeds the least loaded
    healthy replica's by more than `overload_abs` requests *and* by a factor of more than
    `overload_rel`. Both must hold, so a few requests of difference among lightly loaded
    replicas never move a prefix, and a proportionally small difference among heavily loaded
    ones neither. The least loaded replica is never overloaded, so step 2 always has a
    candidate. A prefix that is hot enough to overload its replica thus spills to the least
    loaded one, which from then on holds it too; ties between the two then follow load.

    Requests that share a prefix (a program's forks, a `run_batch`) arrive close together:
    the first one's prompt is recorded at once, so the others follow it to the same replica.

    Options (the thresholds from `benchmarks/router_sim.py`, see docs/distributed.md):
      overload_abs    8       requests above the least loaded replica. Smaller spreads a hot
                              prefix sooner (lower p99 TTFT, a lower hit rate); larger keeps
                              bigger fork groups together (up to overload_abs + 1 requests
                              on one replica while the others are idle).
      overload_rel    1.5     times the least loaded replica's load: what bounds the
                              imbalance once replicas are busy (above 16 requests each).
      min_match       64      units of matched prefix worth routing for
      tree_capacity   1 << 20 units remembered per replica (LRU); set it near the tokens the
                              replica's cache holds, its tiers included (`cache_capacity`).
                              Memory: ~4 bytes per unit plus ~200 per node.
      max_sessions    1 << 16 sticky sessions remembered (LRU)
    """

    def __init__(self, num_replicas: int, *, overload_abs: int = 8, overload_rel: float = 1.5,
                 min_match: int = 64, tree_capacity: int = 1 << 20,
                 max_sessions: int = 1 << 16) -> None:
        super().__init__(num_replicas)
        if overload_abs < 0 or overload_rel < 1.0:
            raise ValueError("overload_abs must be >= 0 and overload_rel >= 1")
        if min_match < 1 or tree_capacity < 1 or max_sessions < 0:
            raise ValueError("min_match and tree_capacity must be >= 1, max_sessions >= 0")
        self.overload_abs = overload_abs
        self.overload_rel = overload_rel
        self.min_match = min_match
        self.max_sessions = max_sessions
        self.tree = RoutedPrefixes(num_replicas, tree_capacity)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._next = 0
        self.decisions: Counter[str] = Counter()  # "session" / "prefix" / "spill" / "load"

    def _pick(self, request: RouteRequest, healthy: list[int], loads: list[int]) -> int:
        low = min(map(loads.__getitem__, healthy))
        bound = max(low + self.overload_abs, low * self.overload_rel)
        eligible = {i for i in healthy if loads[i] <= bound}
        key = prefix_key(request)
        replica, reason = self._sticky(request.session, eligible), "session"
        if replica is None:
            matched = self.tree.match(key) if key else {}
            useful = {r: n for r, n in matched.items() if n >= self.min_match}
            near = {r: n for r, n in useful.items() if r in eligible}
            if near:
                best = max(near.values())
                tied = sorted(r for r, n in near.items() if n == best)
                replica, reason = least_loaded(tied, loads, self._next), "prefix"
            else:
                replica = least_loaded(healthy, loads, self._next)
                reason = "spill" if useful else "load"
            self._next = (replica + 1) % self.num_replicas
        self.decisions[reason] += 1
        if key:
            self.tree.insert(key, replica)
        if request.session is not None and self.max_sessions:
            self._sessions[request.session] = replica
            self._sessions.move_to_end(request.session)
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return replica

    def _sticky(self, session: str | None, eligible: set[int]) -> int | None:
        replica = self._sessions.get(session) if session is not None else None
        return replica if replica is not None and replica in eligible else None

    def replica_reset(self, replica: int, keeps_cache: bool = False) -> None:
        super().replica_reset(replica)
        if keeps_cache:
            return
        self.tree.drop(replica)
        for session in [s for s, r in self._sessions.items() if r == replica]:
            del self._sessions[session]


def cache_capacity(stats: dict[str, Any]) -> int:
    """The tokens a replica's prefix cache can hold, from its Engine.stats(): the KV pool,
    plus its host-memory and disk tiers (pages that were evicted from the pool are still
    found there)."""
    pages = (stats["kv_pages_total"] + stats.get("host_pages_total", 0)
             + stats.get("disk_pages_total", 0))
    return max(1, pages * stats["page_size"])


TOKENS, TEXT = "T", "S"  # a key's first unit: token keys and text keys never share a prefix


def prefix_key(request: RouteRequest) -> str:
    """The request's prompt as a string of units: one character per token id when the ids are
    known (compact, and compared at C speed), else the text itself. Empty: nothing to match."""
    if request.token_ids is not None:
        if not request.token_ids:
            return ""
        try:
            return TOKENS + "".join(map(chr, request.token_ids))
        except (ValueError, OverflowError):  # an id outside chr's range: fold it in
            return TOKENS + "".join(chr(int(t) % 0x110000) for t in request.token_ids)
        except TypeError:  # not a flat list of ids (a batch?): route by load alone
            return ""
    return TEXT + request.text if request.text else ""


def make_router(policy: str, num_replicas: int, **options: object) -> Router:
    """A router for `policy` (one of `POLICIES`). `options` go to the policy's constructor:
    round_robin and least_load take none, cache_aware those of `CacheAwareRouter`."""
    if policy == "round_robin":
        return RoundRobinRouter(num_replicas, **options)  # type: ignore[arg-type]
    if policy == "least_load":
        return LeastLoadRouter(num_replicas, **options)  # type: ignore[arg-type]
    if policy == "cache_aware":
        return CacheAwareRouter(num_replicas, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
