"""The attention backend interface and the per-step batch description it consumes.

A step's batch is ragged: each sequence contributes `q_len` new tokens (a prefill chunk, or 1
for decode) and attends to `kv_len` tokens (everything computed before plus the new ones):

    flat tokens:  [ seq0: q0 tokens | seq1: q1 tokens | ... ]      (T = sum of q_len)
    seq i, query j (0 <= j < q_len) sits at position kv_len - q_len + j and sees keys
    0 .. kv_len - q_len + j (causal inside the chunk, everything before it).

Backends get the KV cache and the slot table; the model code never sees pages.

A layer may attend differently from the backend's defaults (`LayerAttention`): its own softmax
scale (Gemma's query_pre_attn_scalar), a sliding window (query at position p sees keys
p - window + 1 .. p only; the older keys stay in the cache, where other layers may still read
them) and tanh soft-capping of the scores (Gemma 2). Each forward call says so itself, so one
backend serves models whose layers alternate between local and global attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixlm.runtime.attention.kv_cache import KVCache


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends, where it differs from plain causal attention at the backend's
    scale. Frozen and hashable: backends key per-step state (masks, planned wrappers) by it."""

    scale: float | None = None  # None: the backend's scale (head_dim ** -0.5)
    sliding_window: int | None = None  # keys within this many positions, the query's own included
    logit_softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0, got {self.logit_softcap}")


FULL_ATTENTION = LayerAttention()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    q_lens: list[int]  # per sequence
    kv_lens: list[int]  # per sequence, including this step's tokens
    out_slots: torch.Tensor  # [T] int64: KV slot each new token is written to
    slot_table: torch.Tensor  # [B, max(kv_lens)] int64: KV slot of each position of each seq
    kv_cache: KVCache

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


class AttentionBackend(ABC):
    """Paged attention over one ragged batch.

    `plan` runs once per step, before the forward, and may precompute metadata shared by all
    layers. `forward` writes this step's K/V into the cache, then attends.

    Backends that can be captured in a CUDA graph (decode steps only) also implement the
    three `*_cuda_graph` methods: their metadata then lives in buffers allocated once, which
    `plan_cuda_graph` refills in place before each capture and replay, so the captured kernels
    always read the current step's lengths and pages.
    """

    supports_cuda_graph = False
    # Whether plan_cuda_graph reads batch.kv_lens on the host (not only the device copy).
    graph_plan_reads_host_lens = False

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, layer: LayerAttention = FULL_ATTENTION,
                kv_stored: bool = False) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D], attending as `layer` says.
        kv_stored: the caller already wrote k/v to their slots (a fused rotary + store)."""

    def init_cuda_graph(self, batch_sizes: list[int], max_len: int, num_heads: int,
                        kv_cache: KVCache) -> None:
        """Allocate the fixed metadata buffers for decode batches of these (padded) sizes and
        contexts of up to max_len tokens over this cache."""
        raise NotImplementedError(f"{type(self).__name__} cannot run in a CUDA graph")

    def plan_cuda_graph(self, batch: ForwardBatch, kv_lens: torch.Tensor) -> None:
        """Plan a padded decode batch (len(batch.q_lens) is one of the init batch sizes) into
        the fixed buffers. kv_lens is the same lengths already on the device, in a buffer
        that stays put between capture and replay."""
        raise NotImplementedError(f"{type(self).__name__} cannot run in a CUDA graph")
