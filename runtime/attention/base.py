"""The attention backend interface and the per-step batch description it consumes.

A step's batch is ragged: each sequence contributes `q_len` new tokens (a prefill chunk, or 1
for decode) and attends to `kv_len` tokens (everything computed before plus the new ones):

    flat tokens:  [ seq0: q0 tokens | seq1: q1 tokens | ... ]      (T = sum of q_len)
    seq i, query j (0 <= j < q_len) sits at position kv_len - q_len + j and sees keys
    0 .. kv_len - q_len + j (causal inside the chunk, everything before it).

Backends get the KV cache and the slot table; the model code never sees pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixlm.runtime.memory import KVCache


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
    """

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]."""


def create_backend(name: str, scale: float) -> AttentionBackend:
    if name == "torch":
        from radixlm.runtime.attention.torch_native import TorchNativeAttention

        return TorchNativeAttention(scale)
    if name == "triton":
        from radixlm.runtime.attention.triton_backend import TritonAttention

        return TritonAttention(scale)
    if name == "flashinfer":
        from radixlm.runtime.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(scale)
    raise ValueError(f"unknown attention_backend {name!r}; available: torch, triton, flashinfer")
