"""Attention: the KV tensors (`kv_cache`) and the paged attention backends (torch, Triton,
FlashInfer) behind one interface (`backend`), with the per-step batch description they
consume; this file is the registry that picks a backend by name.

The model layers call it; it imports only kernels.
"""

from __future__ import annotations

import importlib

import torch

from radixlm.runtime.attention.backend import AttentionBackend

# name -> (module, class), imported when chosen: the Triton backend loads Triton, which a CPU
# engine (or anything that only needs the KV tensors) has no use for.
BACKENDS = {
    "torch": ("radixlm.runtime.attention.torch_native", "TorchNativeAttention"),
    "triton": ("radixlm.runtime.attention.triton_backend", "TritonAttention"),
    "flashinfer": ("radixlm.runtime.attention.flashinfer_backend", "FlashInferAttention"),
}


def resolve_backend(name: str, device: torch.device | None = None,
                    dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """Turn "auto" into a backend: torch on CPU, our Triton kernels on CUDA. Measured on the
    8B shape (docs/performance.md), Triton's decode is faster than FlashInfer's at every batch
    size and end-to-end throughput is higher, with no minutes-long JIT compile on first use;
    FlashInfer stays one `attention_backend="flashinfer"` away for prefill-heavy work."""
    if name != "auto":
        return name
    if device is None or device.type != "cuda":
        return "torch"
    return "triton" if _importable("triton") else "torch"


def _importable(module: str) -> bool:
    # A real import, not just find_spec: FlashInfer can be installed but miss a dependency.
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def create_backend(name: str, scale: float, device: torch.device | None = None,
                   dtype: torch.dtype | None = None, head_dim: int | None = None,
                   deterministic: bool = False, fp8_attention: bool = False) -> AttentionBackend:
    """deterministic: batch-invariant attention (EngineConfig.deterministic, CUDA): only
    the Triton backend has it; asking another is a ValueError naming attention_backend.
    fp8_attention: float8 q.k in decode (EngineConfig.fp8_attention), Triton only too."""
    name = resolve_backend(name, device, dtype, head_dim)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; available: auto, "
                         f"{', '.join(BACKENDS)}")
    if deterministic and name != "triton":
        raise ValueError(
            f"deterministic=True on CUDA needs attention_backend 'triton' (or 'auto'), not "
            f"{name!r}: only our Triton kernels reduce a query's keys the same way in every "
            "batch, chunk and decode step")
    if fp8_attention and name != "triton":
        raise ValueError(f"fp8_attention needs attention_backend 'triton' on CUDA; this engine "
                         f"resolved {name!r}")
    module, cls = BACKENDS[name]
    backend_cls = getattr(importlib.import_module(module), cls)
    # Only the Triton backend takes these options (checked above).
    options = ({"deterministic": True} if deterministic else {}) | (
        {"fp8_qk": True} if fp8_attention else {})
    backend: AttentionBackend = backend_cls(scale, **options)
    return backend
