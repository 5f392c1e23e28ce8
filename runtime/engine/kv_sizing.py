"""How big the KV pool is, and how long a sequence may get in it."""

from __future__ import annotations

import os
from typing import Any

import torch

from radixlm.runtime.attention.kv_cache import KVCache, kv_storage_dtype
from radixlm.runtime.config.engine_config import EngineConfig


def pool_pages(config: EngineConfig, models: list[Any], dtype: torch.dtype,
                device: torch.device) -> int:
    """Pages in the KV pool. A slot holds the KV of every model given (the target, and a
    draft model that shares its slots)."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens // config.page_size
    storage = kv_storage_dtype(config.kv_cache_dtype, dtype)
    # With pipeline stages each rank holds its own layers' KV: the pool is sized for the
    # stage with the most (every stage holds the same slots).
    per_slot = sum(KVCache.bytes_per_slot(-(-mc.num_layers // config.pp_size), mc.num_kv_heads,
                                          mc.head_dim, storage)
                   for mc in models)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    budget = int(free * config.kv_cache_memory_fraction)
    # On CPU the pool shares memory with everything else on the machine: cap it at 1 GiB
    # unless max_total_tokens asks for more.
    if device.type != "cuda":
        budget = min(budget, 1 << 30)
    return max(1, budget // per_slot // config.page_size)


def max_model_len(config: EngineConfig, mc: Any, pool_tokens: int) -> int:
    limit = mc.max_position_embeddings
    # A family that ignores its configured window (layer_windows None) is exact only inside it.
    if mc.sliding_window and mc.layer_windows is None:
        limit = min(limit, mc.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"limit ({limit})")
        limit = config.max_model_len
    return min(limit, pool_tokens)
