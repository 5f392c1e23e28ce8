"""Quantized expert weights: FP8 (e4m3) or INT8, one scale per output channel of each expert.

    w13 [E, 2I, d] e4m3 or int8   w13_scale [E, 2I] float32  W13[e] = w13[e] * w13_scale[e, :, None]
    w2  [E, d, I]  e4m3 or int8   w2_scale  [E, d]  float32  W2[e] = w2[e] * w2_scale[e, :, None]

A scale belongs to an output channel, so x @ W[e].T = (x @ w[e].T) * scale[e]: the product runs
on the stored values (every e4m3 and int8 value is exact in bfloat16 and float32) and the scale
multiplies its result. Activations stay in float for both formats (weight-only). That is what
the experts of an "fp8" model run even on the GPU, where the model's other linears are FP8
W8A8: the fused kernel (radixlm.kernels.fused_moe) converts each weight tile in its inner loop
and reads one byte per weight, which is what a memory-bound decode step pays for.

Weights come from a float checkpoint, quantized after loading (`quantize_experts`, the rules of
the dense methods: int8 symmetric with max|w_row| / 127, the scale rounded to the model's dtype
first; fp8 with max|w_row| / 448), or from an FP8 checkpoint whose experts hold e4m3 `weight`s
and per-tensor or per-channel `weight_scale`s. A block-wise FP8 checkpoint's experts arrive as
float weights (dequantized at load, block_fp8.py): float experts, or quantized as above.

On the CPU, int8 experts run through torch's int8 weight-only kernel while an expert has few
rows (it reads one byte per weight; measured 2.5-3x faster than bfloat16 at one row), and as a
bfloat16 product of the cast weights beyond. FP8 experts of a bfloat16 model are dequantized
once into bfloat16 weights, as the dense FP8 linears are: the CPU has no fast fp8 product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.runtime.models.quantization.fp8 import FP8, quantize_fp8_rows
from radixlm.runtime.models.quantization.quant_config import QuantConfig

EXPERT_METHODS = ("fp8", "int8")
# Up to this many rows an int8 expert on the CPU runs torch's int8 weight-only kernel; beyond,
# a bfloat16 GEMM of the cast weights is faster (2 cores, 2026-12-03: the kernel is 2.5x faster
# than bfloat16 at 1 row, even at 8-16, slower from ~20: its time grows with every row).
INT8_KERNEL_ROWS = 16


def expert_quant(quant: QuantConfig | None, architecture: str) -> QuantConfig | None:
    """The quantization a MoE model's experts are stored in: the model's for fp8, int8 and
    gguf (the file's blocks, gguf_experts). Formats whose expert layouts we do not read are
    refused (with what to do instead)."""
    if quant is None or quant.method in (*EXPERT_METHODS, "gguf"):
        return quant
    raise ValueError(
        f"{architecture}: quantization {quant.method!r} is not supported for mixture-of-experts "
        f"models (AWQ/GPTQ expert layouts are not read); use a float checkpoint with "
        f"quantization='fp8' or 'int8', an FP8 checkpoint, a GGUF file, or run it unquantized")


def stored_dtype(quant: QuantConfig) -> torch.dtype:
    return FP8 if quant.method == "fp8" else torch.int8


def quantize_experts(w: torch.Tensor, method: str,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float weights -> ([E, N, K] e4m3 or int8, [E, N] float32 scales), one expert
    at a time (the float32 temporaries stay one expert's size). `dtype`: the model's, to which
    int8 scales are rounded before the weights are rounded to the grid (as Int8LinearMethod)."""
    q = torch.empty(w.shape, dtype=FP8 if method == "fp8" else torch.int8, device=w.device)
    scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        if method == "fp8":
            q8, scale = quantize_fp8_rows(w[e])
            q[e], scales[e] = q8, scale.view(-1)
        else:
            we = w[e].float()
            scale = (we.abs().amax(1, keepdim=True) / 127).to(dtype).float()
            scale = scale.clamp(min=torch.finfo(dtype).tiny)  # an all-zero row
            q[e] = torch.round(we / scale).clamp(-127, 127).to(torch.int8)
            scales[e] = scale.view(-1)
    return q, scales


def dequantize_experts(q: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """The [E, N, K] weights in `dtype`, one expert at a time."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for e in range(q.shape[0]):
        out[e] = q[e].float() * scales[e].view(-1, 1)
    return out


def expert_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [n, K] @ (w * scale[:, None]).T -> [n, N] in x's dtype, for one expert's w [N, K]
    (float, or e4m3/int8 with per-channel `scale` [N] float32)."""
    if scale is None:
        return F.linear(x, w)
    if w.dtype == torch.int8 and x.device.type == "cpu" and x.shape[0] <= INT8_KERNEL_ROWS:
        # Scales that int8 quantization rounded to the model's dtype: exact in x's dtype.
        return torch._weight_int8pack_mm(x.contiguous(), w, scale.to(x.dtype))
    return (F.linear(x, w.to(x.dtype)).float() * scale).to(x.dtype)
