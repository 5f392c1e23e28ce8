"""torch.distributed process groups for tensor parallelism: gloo on CPU, NCCL on CUDA.

Ranks meet through the standard env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), so a launch across machines needs only those variables. `TPInfo` is what a layer
needs to know to hold its shard: which rank it is on and how many ranks there are. Layers call
the collectives below only when `size > 1`; a model built without TPInfo never touches
torch.distributed.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    """This process's place in the tensor-parallel group (the default process group)."""

    rank: int
    size: int

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` items."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) must be divisible by tp_size ({self.size})")
        length = total // self.size
        return self.rank * length, length

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) held here. With more ranks than KV heads each rank holds
        one head, replicated: rank r holds head r * num_kv_heads // size."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_kv_heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tp_size ({self.size}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads}) when it is larger")
        return self.rank * num_kv_heads // self.size, 1

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, padded shard length): the vocabulary is cut in `size` equal
        shards of ceil(V / size) rows; the last shard's rows past V are padding."""
        length = -(-vocab_size // self.size)
        return self.rank * length, length


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port nobody listens on now (for a single-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_env(world_size: int) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT from the environment, or localhost and a free port."""
    return {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port())),
            "WORLD_SIZE": str(world_size)}


def init_group(rank: int, world_size: int, backend: str, timeout_s: float,
               env: dict[str, str] | None = None) -> TPInfo:
    """Join the default process group through env://. Every collective after this fails
    after `timeout_s` instead of waiting forever on a dead peer."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one "
                           "tensor-parallel engine per process")
    for key, value in (env or {}).items():
        os.environ[key] = value
    dist.init_process_group(backend, init_method="env://", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TPInfo(rank, world_size)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension: [..., n] -> [..., size * n]."""
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
