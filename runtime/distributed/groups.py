"""torch.distributed process groups for tensor parallelism: gloo on CPU, NCCL on CUDA.

Ranks meet through the standard env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), so a launch across machines needs only those variables. `TPInfo` is what a layer
needs to know to hold its shard: which rank it is on and how many ranks there are. Layers call
the collectives below only when `size > 1`; a model built without TPInfo never touches
torch.distributed.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PipelineInfo:
    """This process's place among the pipeline stages: `tp_size` ranks per stage, global
    rank = stage * tp_size + tensor-parallel rank. `control` is a gloo group of every rank
    that carries rank 0's step descriptions to the later stages point to point."""

    stage: int
    size: int
    tp_size: int
    control: Any = None

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1


def split_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's [first, end) layers: equal shares, the remainder on the last stages (the
    first also embeds and scores)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pp_size ({stages}) must be between 1 and the model's number of "
                         f"layers ({num_layers})")
    base, extra = divmod(num_layers, stages)
    bounds, start = [], 0
    for stage in range(stages):
        end = start + base + (1 if stage >= stages - extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class TPInfo:
    """This process's place in its tensor-parallel group (the default process group, or its
    pipeline stage's ranks), and the gloo group that carries host-side messages within it
    (the tensor-parallel group itself on CPU)."""

    rank: int
    size: int
    host_group: Any = None
    pipeline: PipelineInfo | None = None

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


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int,
                   limit: int = 16) -> list[int]:
    """The tensor-parallel sizes up to `limit` a model with these shapes can be split over:
    attention heads and MLP columns divide evenly, and KV heads divide or are replicated."""
    return [n for n in range(1, limit + 1)
            if num_heads % n == 0 and intermediate_size % n == 0
            and (num_kv_heads % n == 0 if num_kv_heads >= n else n % num_kv_heads == 0)]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port nobody listens on now (for a single-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_env(world_size: int, host: str = "127.0.0.1") -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT from the environment, or `host` (this machine's address where
    the other ranks reach it) and a free port. A launch on this machine alone keeps gloo on
    the loopback interface (unless GLOO_SOCKET_IFNAME says otherwise): the host name may
    resolve to an address the ranks cannot reach."""
    env = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", host),
           "MASTER_PORT": os.environ.get("MASTER_PORT", str(free_port())),
           "WORLD_SIZE": str(world_size)}
    if env["MASTER_ADDR"] in ("127.0.0.1", "localhost"):
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    elif "GLOO_SOCKET_IFNAME" in os.environ:
        env["GLOO_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"]
    return env


def init_group(rank: int, world_size: int, backend: str, timeout_s: float,
               env: dict[str, str] | None = None, pp_size: int = 1) -> TPInfo:
    """Join the default process group through env://. Every collective after this fails
    after `timeout_s` instead of waiting forever on a dead peer. With `pp_size` > 1 the
    world is pp_size stages of world_size / pp_size ranks: each stage's ranks get a group
    of their own for their layers' collectives (`tp_group`)."""
    global _tp_group
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one "
                           "tensor-parallel engine per process")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The variables hold only while the groups form: a later engine in this process must
    # not meet at this one's port (a store still alive there would hand it stale peers).
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=world_size, timeout=timeout)
        # Step descriptions travel host to host, so a rank can queue its GPU work without
        # waiting for its GPU to receive them first (see parallel.step_channel.StepChannel).
        host_group = (dist.group.WORLD if backend == "gloo"
                      else dist.new_group(backend="gloo", timeout=timeout))
        pipeline = None
        if pp_size > 1:
            tp_size = world_size // pp_size
            # Every rank creates every group, in the same order (torch.distributed's rule).
            stage_groups = []
            for stage in range(pp_size):
                ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
                device_group = dist.new_group(ranks, timeout=timeout)
                host = (device_group if backend == "gloo"
                        else dist.new_group(ranks, backend="gloo", timeout=timeout))
                stage_groups.append((device_group, host))
            control = dist.new_group(backend="gloo", timeout=timeout)
            stage = rank // tp_size
            _tp_group, host_group = stage_groups[stage]
            pipeline = PipelineInfo(stage, pp_size, tp_size, control)
            return TPInfo(rank % tp_size, tp_size, host_group, pipeline)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return TPInfo(rank, world_size, host_group)


def destroy_group() -> None:
    global _symmetric, _active, _tp_group
    _symmetric, _active, _tp_group = None, "none", None
    if dist.is_initialized():
        dist.destroy_process_group()


class SymmetricAllReduce:
    """Sum-all-reduce through PyTorch symmetric memory: a buffer every rank of the group can
    read over NVLink. Small tensors (decode steps) take the one-shot kernel (each rank reads
    all peers' copies and adds them in rank order, so every rank gets the same bits), larger
    ones the two-shot kernel (reduce-scatter, then all-gather). Both are plain kernels on the
    current stream with in-kernel barriers, so they are captured in CUDA graphs as is, and at
    decode sizes they take about half of NCCL's time (benchmarks/all_reduce.py)."""

    ONE_SHOT_MAX_BYTES = 64 * 1024  # measured crossover on H200 pairs

    def __init__(self, max_numel: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name
        self.dtype = dtype
        self.max_numel = max_numel
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group)  # collective: every rank calls it

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()].view_as(x)
        staged.copy_(x)
        if x.numel() * x.element_size() <= self.ONE_SHOT_MAX_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group, x)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group)
            x.copy_(staged)
        return x


_symmetric: SymmetricAllReduce | None = None
_active = "none"  # what setup_all_reduce chose, for logs and benchmarks
# The group the layers' collectives run in: None for the default group (tensor parallelism
# alone), this rank's pipeline stage's ranks otherwise.
_tp_group: Any = None


def tp_group() -> Any:
    """The group of this rank's tensor-parallel collectives (None: the default group)."""
    return _tp_group


def active_all_reduce() -> str:
    return _active


def setup_all_reduce(mode: str, max_numel: int, dtype: torch.dtype,
                     device: torch.device) -> str:
    """Set up this process's all-reduce (`mode`: "symmetric", "nccl" or "ordered", as rank 0
    chose) for tensors of up to max_numel elements; every rank calls it at the same point
    (the symmetric buffer's rendezvous is collective). Returns the one in use ("gloo" off the
    GPU, unless "ordered": ordered_all_reduce over the group's backend, for deterministic
    mode)."""
    global _symmetric, _active
    _symmetric = None
    if mode == "ordered":
        _active = "ordered"
    elif device.type != "cuda":
        _active = "gloo"
    elif mode == "nccl":
        _active = "nccl"
    else:
        _symmetric = SymmetricAllReduce(max_numel, dtype, device)
        _active = "symmetric"
    return _active


_symmetric_rendezvous_done = False  # PyTorch numbers rendezvous per process, never resets


def choose_all_reduce(configured: str, device: torch.device) -> str:
    """Rank 0's choice, sent to the other ranks so that none disagrees: "symmetric" where
    configured ("auto" too) and available, else "nccl". Symmetric memory is set up at most
    once per process: a later engine's fresh workers would count their rendezvous from zero
    while this process goes on from one, and wait for each other forever. A later
    tensor-parallel engine in the same process therefore uses NCCL."""
    global _symmetric_rendezvous_done
    if device.type != "cuda" or configured == "nccl":
        return "nccl"
    if _symmetric_rendezvous_done or not symmetric_memory_available():
        if configured == "symmetric":
            log.warning("symmetric-memory all-reduce unavailable (%s); using NCCL",
                        "set up once already in this process" if _symmetric_rendezvous_done
                        else "this PyTorch build lacks it")
        return "nccl"
    _symmetric_rendezvous_done = True
    return "symmetric"


_cuda_engine_built = False  # whether this process has begun building a CUDA engine


def check_nccl_in_graphs(mode: str, graphs: bool, device: torch.device) -> None:
    """Refuse a tensor-parallel engine whose decode graphs would capture NCCL all-reduces
    (`mode` "nccl") in a process that has built a CUDA engine before: on two H200s such an
    engine hung at its first steps, while the same engine in a fresh process, with
    symmetric memory, or run eagerly did not (the cause is not known yet). A clear error
    beats a hang. Call it once per engine, before its KV pool is allocated; it records that
    this process has begun building a CUDA engine (one that fails later counts too: it may
    have set up the same CUDA state)."""
    global _cuda_engine_built
    if device.type != "cuda":
        return
    built_before, _cuda_engine_built = _cuda_engine_built, True
    if mode in ("nccl", "ordered") and graphs and built_before:
        raise RuntimeError(
            "tensor parallelism with NCCL all-reduces in CUDA graphs after another CUDA "
            "engine in this process is refused: that combination hung on a 2-GPU machine. "
            "Start this engine in a fresh process (a second tensor-parallel engine in a "
            "process cannot use symmetric memory, so it falls back to NCCL), or pass "
            "disable_cuda_graph=True (eager decode steps, slower)")


def symmetric_memory_available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group, in place (returns x)."""
    if _active == "ordered":
        return x.copy_(ordered_all_reduce(x))
    if _symmetric is not None and _symmetric.fits(x):
        return _symmetric(x)
    dist.all_reduce(x, group=_tp_group)
    return x


def ordered_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group in rank order, accumulating in float32 and rounding once to x's
    dtype: every rank gets the same bits, and each element's sum does not depend on the
    tensor's size (a library all-reduce picks its algorithm, and with it the order of the
    additions, by message size). The deterministic CPU kernel reduces through this, and
    every layer in deterministic mode on CUDA (setup_all_reduce's "ordered": NCCL's
    all-gather only copies)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(_tp_group))]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    total = parts[0].float()
    for part in parts[1:]:
        total += part
    return total.to(x.dtype)


def all_gather_last(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension: [..., n] -> [..., size * n]."""
    return torch.cat(_gathered(x, tp), dim=-1)


def all_gather_rows(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Stack every rank's `x` along a new first dimension: [...] -> [size, ...]."""
    return torch.stack(_gathered(x, tp))


def _gathered(x: torch.Tensor, tp: TPInfo) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return parts
