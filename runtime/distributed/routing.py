"""Which data-parallel replica serves a request.

A front end holding N engine replicas asks a `Router` for each request:

    router = make_router("cache_aware", num_replicas=4)
    replica = router.choose(RouteRequest(token_ids=ids, session=salt), loads)
    ...                                   # send it there; when it ends (done or failed):
    router.finished(replica, request)

`loads` is one `ReplicaLoad` per replica, as recent as the caller has it. Unhealthy replicas
never get a request; when none is healthy, `choose` raises `NoHealthyReplica`. A replica that
was restarted has an empty cache: tell the router with `replica_reset`.

The router also counts the requests it sent to each replica that have not `finished`; that
count is a floor on the replica's load, so a burst routed between two load reports does not
all go to the replica that looked idle. Call `finished` exactly once per `choose`.

Routers are not thread-safe: call them from one thread (the front end's event loop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

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
        effective = [max(load.total, out) for load, out in zip(loads, self._outstanding)]
        replica = self._pick(request, healthy, effective)
        self._outstanding[replica] += 1
        return replica

    def finished(self, replica: int, request: RouteRequest) -> None:
        """A request routed to `replica` ended (completed, failed or aborted)."""
        self._check(replica)
        self._outstanding[replica] = max(0, self._outstanding[replica] - 1)

    def replica_reset(self, replica: int) -> None:
        """`replica` was restarted: nothing of it is cached, nothing of it is in flight."""
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
    low = min(loads[i] for i in candidates)
    tied = [i for i in candidates if loads[i] == low]
    return next((i for i in tied if i >= start), tied[0])


def make_router(policy: str, num_replicas: int, **options: object) -> Router:
    """A router for `policy` (one of `POLICIES`). `options` go to the policy's constructor;
    round_robin and least_load take none."""
    if policy == "round_robin":
        return RoundRobinRouter(num_replicas, **options)  # type: ignore[arg-type]
    if policy == "least_load":
        return LeastLoadRouter(num_replicas, **options)  # type: ignore[arg-type]
    if policy == "cache_aware":
        raise NotImplementedError("cache_aware routing is not built yet")
    raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
