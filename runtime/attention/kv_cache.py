"""The KV tensors: one K and one V tensor per layer, allocated once, written by the attention
backends.

A *slot* holds one token's K and V for every layer; slots are grouped into pages of `page_size`
consecutive slots (slot = page * page_size + offset). Which pages belong to whom is
scheduling's business (`radixlm.runtime.scheduling.pages`); this module only holds the memory.

The cache may store K and V in a narrower type than the model computes in (`storage_dtype`:
float8 e4m3 or e5m2, half the bytes of bf16: twice the tokens in the same memory, half the KV
bytes read per decode step). A stored value is x / scale rounded to the float8 type, saturated
at its largest finite value (e4m3 has no infinity: an overflow would read back as NaN); the
attention kernels read it back as value * scale. Scales are per layer and per K/V (one
float each, fixed for the engine's life: a checkpoint's calibrated `k_scale` / `v_scale`, or
1.0), so a backend folds them into the softmax scale (K) and the output (V) instead of
touching every element.
"""

from __future__ import annotations

import torch

# What `kv_cache_dtype` may name besides "auto" (the model's dtype).
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = tuple(KV_CACHE_DTYPES.values())


def kv_storage_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The storage type `kv_cache_dtype` names for a model computing in `dtype`."""
    if name == "auto":
        return dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; available: auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the float8 storage type, saturated (round to nearest even, as the GPU's
    conversion does)."""
    limit = torch.finfo(dtype).max
    x = x.float() if scale == 1.0 else x.float() / scale
    return x.clamp(-limit, limit).to(dtype)  # not in place: x may be the caller's tensor


class KVCache:
    """K and V for every layer: [num_layers][num_slots, num_kv_heads, head_dim].

    `dtype` is what the model computes in; `storage_dtype` what the tensors hold (the same
    unless the cache is float8)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, page_size: int = 1,
                 storage_dtype: torch.dtype | None = None) -> None:
        if num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size")
        storage_dtype = storage_dtype or dtype
        if storage_dtype != dtype and storage_dtype not in FP8_DTYPES:
            raise ValueError(f"a KV cache stores the model's dtype or float8, not "
                             f"{storage_dtype}")
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.page_size = page_size
        self.dtype = dtype
        self.storage_dtype = storage_dtype
        self.k = torch.zeros(shape, dtype=storage_dtype, device=device)
        self.v = torch.zeros(shape, dtype=storage_dtype, device=device)
        self.num_slots = num_slots
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers

    @property
    def quantized(self) -> bool:
        return self.storage_dtype != self.dtype

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def layer_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_pages, page_size, num_kv_heads, head_dim] views."""
        k, v = self.layer(layer_id)
        shape = (-1, self.page_size, *k.shape[1:])
        return k.view(shape), v.view(shape)

    def scales(self, layer_id: int) -> tuple[float, float]:
        return self.k_scale[layer_id], self.v_scale[layer_id]

    def set_scales(self, k_scale: list[float], v_scale: list[float]) -> None:
        """Per-layer scales (a checkpoint's); only a float8 cache uses them."""
        if len(k_scale) != len(self.k_scale) or len(v_scale) != len(self.v_scale):
            raise ValueError("one K and one V scale per layer")
        if any(not s > 0 for s in (*k_scale, *v_scale)):
            raise ValueError("KV cache scales must be positive")
        self.k_scale, self.v_scale = [float(s) for s in k_scale], [float(s) for s in v_scale]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        k_cache, v_cache = self.layer(layer_id)
        if self.quantized:
            k = quantize_kv(k, self.k_scale[layer_id], self.storage_dtype)
            v = quantize_kv(v, self.v_scale[layer_id], self.storage_dtype)
            # index_copy_ has no float8 kernel on every device: copy the bytes.
            k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def dequantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """Stored values (any gathered subset) back in the model's dtype."""
        if not self.quantized:
            return x
        x = x.to(torch.float32)
        if scale != 1.0:
            x = x * scale
        return x.to(self.dtype)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).itemsize
