"""Joining a Ray cluster, or starting a local one: shared by the engine replicas (`--dp`,
replicas/ray_actors.py) and the ranks of one engine placed by Ray
(`distributed_executor_backend="ray"`, parallel/ray_workers.py). Imported only when Ray is
asked for: Ray is an optional dependency.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from typing import Iterator

import ray

LOOPBACK = "127.0.0.1"
# Ray (Linux) turns a loopback node address into the machine's outward one, unless clusters
# are switched off, as on Windows and macOS by default; with them off, the node stays on
# loopback and its servers listen there alone.
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


@contextlib.contextmanager
def _loopback_node(on: bool) -> Iterator[None]:
    """While Ray starts: a loopback node address stays loopback (see _CLUSTER_SWITCH). Ray reads
    the switch from the environment when imported (here, before) and in the processes it
    starts, so both are set, and put back afterwards."""
    if not on:
        yield
        return
    from ray._private import ray_constants

    saved_env, saved = os.environ.get(_CLUSTER_SWITCH), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = saved_env


def connect(address: str | None = None, num_cpus: int | None = None,
            host: str | None = None) -> str:
    """Join the Ray cluster at `address` (also read from RAY_ADDRESS), or start a local one
    with `num_cpus` CPUs (None: all of this machine's). Returns where it is, for the log.

    `host` is this node's address in the cluster. A local cluster serves this process alone,
    so it defaults to 127.0.0.1, and on a loopback address Ray's own servers (control store,
    node manager, object manager, workers, metrics) listen on loopback only; on another address
    Ray (2.x) still listens on all interfaces and only advertises that one. Joining a cluster,
    it defaults to Ray's own pick (the interface that reaches the cluster)."""
    if not ray.is_initialized():
        local = not (address or os.environ.get("RAY_ADDRESS"))
        host = host or (LOOPBACK if local else None)
        if host is not None and _unspecified(host):
            raise ValueError(f"the Ray host must be an address this node is reached at, not "
                             f"{host!r} (for all interfaces, give this node's address)")
        extra = {"_node_ip_address": host} if host else {}
        with _loopback_node(host is not None and _loopback(host)):
            ray.init(address=address or None, num_cpus=num_cpus if local else None,
                     include_dashboard=False, log_to_driver=True, configure_logging=False,
                     **extra)
    context = ray.get_runtime_context()
    return context.gcs_address


def disconnect() -> None:
    if ray.is_initialized():
        ray.shutdown()
