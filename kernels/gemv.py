"""The small-batch GEMV for float weights: y = x @ W^T with W [N, K] as torch's Linear stores
it (bfloat16 or float16), for the decode steps of a few rows, where a step reads every weight
once and the floor is their bytes over the memory bandwidth.

One launch, every weight read once for all rows (up to 16): a program owns BLOCK_N columns for
all rows and walks K with tl.dot on [16, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles (x padded to 16
rows, which costs nothing here: the bytes are the weights'), Triton pipelining the loads
NUM_STAGES deep. It accumulates in float32 and rounds once, like cuBLAS (whose summation order
differs, so the two agree to float32 rounding before the final cast, not bit for bit).
`benchmarks/gemv.py` measures tilings against cuBLAS on a model's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.pdl import pdl_options, pdl_prologue

MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 5


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=mask_m[:, None] & (k < K)[None, :], other=0.0)  # [16, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None],
                    mask=mask_n[None, :] & (k < K)[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# Where the model uses the GEMV (Linear.small_batch): layers of at most NARROW_MAX_N outputs,
# at up to MAX_ROWS rows, with this tiling. On an H200 (benchmarks/gemv.py, 2026-12-03,
# Llama-3-8B shapes, 1-8 rows) it took o (4096 x 4096) from cuBLAS's 13.1-13.3 us to 11.5-11.7
# and down (4096 x 14336) from 32.1-32.7 to 30.6-31.2; on wider layers (qkv 6144, gate_up
# 28672) cuBLAS was as fast or faster, so they stay with it.
NARROW = GemvConfig(block_n=32, block_k=256, num_stages=5)
NARROW_MAX_N = 4096


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig = NARROW) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows contiguous) @ weight[N, K]^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gemv needs the K axis of x and the weight to be contiguous")
    if m > MAX_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_ROWS} rows, not {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _gemv_dot_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        num_warps=config.num_warps, **pdl_options(x.device))
    return out
