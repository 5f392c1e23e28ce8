"""Dynamic per-token FP8 (e4m3) quantization of activations in one Triton kernel.

For each row: scale = max(max|x| / 448, 1e-12), q = e4m3(clamp(x / scale, -448, 448)), the
rule of radixlm.runtime.quantization.fp8.quantize_fp8_rows. In torch that rule is five or six
elementwise and reduction kernels per linear layer; at batch 1 their launches cost more than
the fp8 matmul saves, so on CUDA the whole rule is one kernel, one program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest value; a constexpr, so kernels may read it


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, 1e-12)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> ([M, K] float8_e4m3fn, [M, 1] float32 scales)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    if m:
        _per_token_fp8_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), BLOCK=block,
                                    num_warps=min(max(block // 512, 1), 16))
    return q, scales
