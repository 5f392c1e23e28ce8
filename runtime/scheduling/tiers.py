"""The prefix cache's lower tiers as an engine's options ask for them: the disk tier
(`disk_cache_dir`), the host-memory tier (`host_cache_gb`), or host memory above the disk.
Each tensor-parallel rank builds its own over its shard of the KV (parallel/sharded_tier.py
keeps them in step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.scheduling.disk_tier import DiskTier, model_key
from radixlm.runtime.scheduling.host_tier import HostTier


def make_tier(config: EngineConfig, model: torch.nn.Module, k: torch.Tensor, v: torch.Tensor,
              storage_dtype: torch.dtype, numerics: str) -> DiskTier | HostTier | None:
    """`k`, `v`: the KV cache's tensors; `numerics`: what else decides the KV's bits (see
    model_key), the tensor-parallel rank included, so each rank's files are its own."""
    tier: DiskTier | HostTier | None = None
    if config.disk_cache_dir is not None:
        tier = DiskTier(Path(config.disk_cache_dir).expanduser(),
                        model_key(model, storage_dtype, config.page_size, numerics),
                        k, v, config.page_size, int(config.disk_cache_gb * (1 << 30)))
    if config.host_cache_gb > 0:
        tier = HostTier(k, v, config.page_size, int(config.host_cache_gb * (1 << 30)),
                        below=tier)
    return tier


def tier_numerics(model_config: Any, device: torch.device, dtype: torch.dtype, attn: Any,
                  config: EngineConfig, tp_rank: int) -> str:
    """What decides the bits of the KV a rank computes, beside its weights (model_key)."""
    numerics = (f"{model_config!r}|{device.type}|{dtype}|{type(attn).__name__}|"
                f"{config.deterministic}|{config.disable_cpu_kernel}")
    if config.tp_size > 1:
        numerics += f"|tensor-parallel rank {tp_rank} of {config.tp_size}"
    return numerics
