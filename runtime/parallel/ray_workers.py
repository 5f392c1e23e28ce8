"""Ranks 1..N-1 of one engine as Ray actors (`distributed_executor_backend="ray"`).

Ray places them on its cluster's nodes: one bundle per rank (a GPU each on CUDA) in a
placement group packed node by node, so the tensor-parallel ranks of one pipeline stage land
on one node while stages spread across nodes. Each actor runs the same loop as a worker
process rank 0 starts itself (parallel/worker.py), with the rendezvous variables rank 0 gives
it; the model path must exist on every node. Rank 0 (the engine's own process, the Ray
driver) watches the actors through `RayRank`, which answers as the subprocess.Popen handles
of local workers do. Ray stops the actors when their owner, this process, goes away.
"""

from __future__ import annotations

import os
import runpy
import subprocess
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from radixlm.runtime.distributed.ray_cluster import connect

PLACEMENT_TIMEOUT_S = 300.0  # the cluster may be scaling up to fit the group


@ray.remote
class _Rank:
    def run(self, env: dict[str, str]) -> int:
        """The worker module, run as `python -m` runs it for a local rank."""
        os.environ.update(env)
        try:
            runpy.run_module("radixlm.runtime.parallel.worker", run_name="__main__")
        except SystemExit as exit_:  # the worker exits 1 when its rank fails
            return int(exit_.code or 0)
        return 0


class RayRank:
    """One rank's actor, through the part of subprocess.Popen's interface rank 0 uses."""

    def __init__(self, actor: Any, done: Any) -> None:
        self.actor = actor
        self.done = done  # the reference to its run(): ready once the rank has stopped

    def poll(self) -> int | None:
        ready, _ = ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            return ray.get(self.done)
        except Exception:  # noqa: BLE001 - the actor died (killed, its node lost)
            return -9

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = ray.wait([self.done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray rank", timeout or 0.0)
        return self.poll()

    def kill(self) -> None:
        ray.kill(self.actor)


def join_cluster() -> str:
    """Join the cluster at RAY_ADDRESS (or start a local one); this node's address in it,
    where the other ranks reach rank 0's rendezvous."""
    connect(os.environ.get("RAY_ADDRESS"))
    return ray.util.get_node_ip_address()


def launch(ranks: list[int], env: dict[str, str], gpus: bool
           ) -> tuple[dict[int, RayRank], Any]:
    """Start `ranks` as actors, each with the rendezvous variables and its RANK; with the
    placement group that holds their resources (`release` it once they are stopped)."""
    bundles = [{"CPU": 1, "GPU": 1} if gpus else {"CPU": 1} for _ in ranks]
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster has no room for {len(ranks)} more ranks "
                           f"({bundles[0]} each) after {PLACEMENT_TIMEOUT_S:.0f} s")
    handles = {}
    for index, rank in enumerate(ranks):
        actor = _Rank.options(
            num_cpus=1, num_gpus=1 if gpus else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index)).remote()
        # On a GPU Ray shows the actor its own device alone: it is cuda:0 there.
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK="0" if gpus else str(rank))
        handles[rank] = RayRank(actor, actor.run.remote(rank_env))
    return handles, group


def release(group: Any) -> None:
    remove_placement_group(group)
