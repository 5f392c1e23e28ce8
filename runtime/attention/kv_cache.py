"""The KV tensors: one K and one V tensor per layer, allocated once, written by the attention
backends.

A *slot* holds one token's K and V for every layer; slots are grouped into pages of `page_size`
consecutive slots (slot = page * page_size + offset). Which pages belong to whom is
scheduling's business (`radixlm.runtime.scheduling.pages`); this module only holds the memory.
"""

from __future__ import annotations

import torch


class KVCache:
    """K and V for every layer: [num_layers][num_slots, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 1) -> None:
        if num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size")
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.page_size = page_size
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def layer_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_pages, page_size, num_kv_heads, head_dim] views."""
        k, v = self.layer(layer_id)
        shape = (-1, self.page_size, *k.shape[1:])
        return k.view(shape), v.view(shape)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        self.k[layer_id].index_copy_(0, slots, k)
        self.v[layer_id].index_copy_(0, slots, v)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).itemsize
