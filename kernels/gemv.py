"""The small-batch GEMV for float weights: y = x @ W^T with W [N, K] as torch's Linear stores
it (bfloat16 or float16), for the decode steps of a few rows, where a step reads every weight
once and the floor is their bytes over the memory bandwidth.

Two kernels, one launch each, every weight read once for all rows:

- "fma" (rows <= 4, on CUDA cores): a program owns BLOCK_N output columns (rows of W) and a
  range of K; each step loads a [BLOCK_N, BLOCK_K] tile of W (K contiguous: 16-byte loads) and
  the rows' x, and accumulates w * x elementwise into a [BLOCK_N, BLOCK_K] float32 tile per
  row, reduced over K once at the end. The next tile is loaded before the current one is used
  (two tiles in flight per program). K may be split over programs (grid axis 1), the partial
  sums added by the last program of each tile in the same launch (radixlm.kernels.split_k).
- "dot" (rows <= 16, tensor cores): a program owns BLOCK_N columns for all rows and walks K
  with tl.dot on [16, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles (x padded to 16 rows, which costs
  nothing here: the bytes are the weights'), letting Triton pipeline the loads NUM_STAGES
  deep.

Both accumulate in float32 and round once, like cuBLAS (its summation order differs, so the
results agree to float32 rounding before the final cast, not bit for bit).
`benchmarks/gemv.py` measures them against cuBLAS on the model's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.kernels.split_k import blocks_per_split, finish_split_k, split_k_buffers

FMA_MAX_ROWS = 4
DOT_MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    kernel: str = "fma"  # "fma" or "dot"
    block_n: int = 8
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3  # "dot" only


@triton.jit
def _load_w(w_ptr, block, offs_n, offs_k, stride_wn, k_limit, N, BLOCK_K: tl.constexpr,
            EVEN_N: tl.constexpr):
    """W's [BLOCK_N, BLOCK_K] tile of K block `block` (0 past k_limit)."""
    k = block * BLOCK_K + offs_k
    mask = (k < k_limit)[None, :]
    if not EVEN_N:
        mask = mask & (offs_n < N)[:, None]
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask, other=0.0)


@triton.jit
def _add_row(acc, w, x_row_ptr, k, k_limit):
    x = tl.load(x_row_ptr + k, mask=k < k_limit, other=0.0).to(tl.float32)
    return tl.fma(w, x[None, :], acc)


@triton.jit(do_not_specialize=["blocks_per_split"])
def _gemv_fma_kernel(x_ptr, w_ptr, out_ptr, partials_ptr, counters_ptr, N, K, blocks_per_split,
                     stride_xm, stride_wn, stride_om, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    first = pid_k * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(K, BLOCK_K))
    k_limit = tl.minimum(last * BLOCK_K, K)
    next_w = _load_w(w_ptr, first, offs_n, offs_k, stride_wn, k_limit, N, BLOCK_K, EVEN_N)
    for block in range(first, last):
        w = next_w.to(tl.float32)
        next_w = _load_w(w_ptr, block + 1, offs_n, offs_k, stride_wn, k_limit, N, BLOCK_K,
                         EVEN_N)
        k = block * BLOCK_K + offs_k
        acc0 = _add_row(acc0, w, x_ptr, k, k_limit)
        if ROWS > 1:
            acc1 = _add_row(acc1, w, x_ptr + stride_xm, k, k_limit)
        if ROWS > 2:
            acc2 = _add_row(acc2, w, x_ptr + 2 * stride_xm, k, k_limit)
        if ROWS > 3:
            acc3 = _add_row(acc3, w, x_ptr + 3 * stride_xm, k, k_limit)
    finish_split_k(out_ptr, stride_om, partials_ptr, counters_ptr, offs_n, offs_n < N,
                   tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1),
                   tl.sum(acc3, axis=1), ROWS, BLOCK_N)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
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
# at up to DOT_MAX_ROWS rows, with this tiling. On an H200 (benchmarks/gemv.py, 2026-12-03,
# Llama-3-8B shapes, 1-8 rows) it took o (4096 x 4096) from cuBLAS's 13.1-13.3 us to 11.5-11.7
# and down (4096 x 14336) from 32.1-32.7 to 30.6-31.2; on wider layers (qkv 6144, gate_up
# 28672) cuBLAS was as fast or faster, so they stay with it.
NARROW = GemvConfig(kernel="dot", block_n=32, block_k=256, num_stages=5)
NARROW_MAX_N = 4096


def narrow_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for the layers and row counts above (the caller checks them)."""
    return gemv(x, weight, NARROW)


def default_config(rows: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """A tiling for shapes nobody measured: CUDA cores for up to 4 rows, with K split until
    there are about four programs per SM; tensor cores above."""
    if rows > FMA_MAX_ROWS:
        return GemvConfig(kernel="dot", block_n=64, block_k=128, num_warps=4, num_stages=4)
    block_n, block_k = (8, 512) if rows <= 2 else (8, 256)
    tiles, blocks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 4 * num_sms and split * 2 <= blocks and split < 8:
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ weight[N, K]^T -> [M, N] in x's dtype, one launch."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("gemv needs the K axis of x and the weight to be contiguous")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config
    if cfg.kernel == "dot":
        if m > DOT_MAX_ROWS:
            raise ValueError(f"the dot GEMV takes at most {DOT_MAX_ROWS} rows, not {m}")
        _gemv_dot_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps)
        return out
    if m > FMA_MAX_ROWS:
        raise ValueError(f"the fma GEMV takes at most {FMA_MAX_ROWS} rows, not {m}")
    tiles = triton.cdiv(n, cfg.block_n)
    per_split, split = blocks_per_split(triton.cdiv(k, cfg.block_k), cfg.split_k)
    partials, counters = split_k_buffers(x.device, tiles, split, m, cfg.block_n)
    _gemv_fma_kernel[(tiles, split)](
        x, weight, out, partials, counters, n, k, per_split, x.stride(0), weight.stride(0),
        out.stride(0), ROWS=m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_N=n % cfg.block_n == 0, num_warps=cfg.num_warps)
    return out
