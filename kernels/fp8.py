"""FP8 (e4m3) W8A8 kernels: per-token quantization of activations, and the small-batch GEMV.

per_token_fp8: for each row, scale = max(max|x| / 448, 1e-12), q = e4m3(clamp(x / scale,
-448, 448)), the rule of radixlm.runtime.models.quantization.fp8.quantize_fp8_rows. In torch that
rule is five or six elementwise and reduction kernels per linear layer; at batch 1 their
launches cost more than the fp8 matmul saves, so on CUDA the whole rule is one kernel, one
program per row.

fp8_gemv: y = x_scale * w_scale * (x8 @ w8.T) for 1 to 4 rows on CUDA cores. At batch 1
`torch._scaled_mm` (a GEMM on tensor cores) streams the weight slower than a bf16 GEMV; this
kernel reads each weight byte once for all rows, with [BLOCK_N, BLOCK_K] tiles summed in
registers (K contiguous: 16-byte loads), one reduction over K per program and K split over
programs in the same launch (radixlm.kernels.split_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.split_k import (
    blocks_per_split,
    finish_split_k,
    num_sms,
    split_for,
    split_k_buffers,
)

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


GEMV_MAX_ROWS = 4  # up to this many rows: fp8_gemv (one read of the weight for all rows)


@triton.jit
def _load_w(w_ptr, block, offs_n, offs_k, stride_wn, block_limit, N, K, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] e4m3 weights of K block `block` as float32 (0 from block_limit
    on, and past N or K). With K a multiple of 16 the mask is constant over each 16-byte
    vector, so the loads stay vectorized."""
    k = block * BLOCK_K + offs_k
    # Past the split: no rows. (A scalar test & a tensor would work too, but the interpreter
    # makes that mask int32, which its fp8 loads reject.)
    rows = tl.where(block < block_limit, N, 0)
    mask = (offs_n < rows)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask, other=0.0)
    return w.to(tl.float32)


@triton.jit
def _add_row(acc, w, x_row_ptr, offs_n, k, K, EVEN_K: tl.constexpr):
    """acc += w * x_k for one row of x (e4m3 values, unscaled). x is loaded broadcast to the
    weights' [BLOCK_N, BLOCK_K] shape: in their layout, with no shared-memory round trip (the
    copies a thread holds for its rows are one load)."""
    ks = k[None, :] + 0 * offs_n[:, None]
    if EVEN_K:
        x = tl.load(x_row_ptr + ks)
    else:
        x = tl.load(x_row_ptr + ks, mask=ks < K, other=0.0)
    return tl.fma(w, x.to(tl.float32), acc)


@triton.jit(do_not_specialize=["blocks_per_split"])  # one kernel for every K split
def _fp8_gemv_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, out_ptr, partials_ptr,
                     counters_ptr, N, K, blocks_per_split, stride_xm, stride_wn, stride_om,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr):
    """Grid (row tiles of W, K splits). Each program sums [BLOCK_N, BLOCK_K] products in
    registers over its K blocks (2-D, in the layout of the loaded weights: K contiguous),
    reduces over K once, then applies both scales."""
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
    # The next block is loaded before this one is used: two blocks of loads in flight.
    next_w = _load_w(w_ptr, first, offs_n, offs_k, stride_wn, last, N, K, BLOCK_K)
    for block in range(first, last):
        w = next_w
        next_w = _load_w(w_ptr, block + 1, offs_n, offs_k, stride_wn, last, N, K, BLOCK_K)
        k = block * BLOCK_K + offs_k
        acc0 = _add_row(acc0, w, x_ptr, offs_n, k, K, EVEN_K)
        if ROWS > 1:
            acc1 = _add_row(acc1, w, x_ptr + stride_xm, offs_n, k, K, EVEN_K)
        if ROWS > 2:
            acc2 = _add_row(acc2, w, x_ptr + 2 * stride_xm, offs_n, k, K, EVEN_K)
        if ROWS > 3:
            acc3 = _add_row(acc3, w, x_ptr + 3 * stride_xm, offs_n, k, K, EVEN_K)
    mask_n = offs_n < N
    w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0)
    y0 = tl.sum(acc0, axis=1) * w_scale * tl.load(x_scale_ptr)
    y1 = y0
    y2 = y0
    y3 = y0
    if ROWS > 1:
        y1 = tl.sum(acc1, axis=1) * w_scale * tl.load(x_scale_ptr + 1)
    if ROWS > 2:
        y2 = tl.sum(acc2, axis=1) * w_scale * tl.load(x_scale_ptr + 2)
    if ROWS > 3:
        y3 = tl.sum(acc3, axis=1) * w_scale * tl.load(x_scale_ptr + 3)
    finish_split_k(out_ptr, stride_om, partials_ptr, counters_ptr, offs_n, mask_n, y0, y1, y2,
                   y3, ROWS, BLOCK_N)


def fp8_gemv_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """Tiles for fp8_gemv: measured ones if the table has them (radixlm.kernels.w4a16_tuned),
    else `fp8_gemv_rule`'s."""
    from radixlm.kernels.w4a16 import rows_key, tuned_entry

    tuned = tuned_entry(device, f"fp8:{n}:{k}:{rows_key(m)}")
    return dict(tuned) if tuned is not None else fp8_gemv_rule(n, k, device)


def fp8_gemv_rule(n: int, k: int, device: torch.device) -> dict:
    """[8, 512] weight tiles over 4 warps, K split only while the GPU holds fewer than ~2
    programs per SM. On an H200 (benchmarks/quant_speed.py --sweep) this was the best tiling
    or within 7% of it on the 8B linears at 1 and 2 rows (down_proj at 1 row: not timed
    unsplit), where [16, 256] tiles split for 4 programs per SM were up to 26% slower. Each
    thread loads 16 contiguous bytes of a row."""
    block_n, block_k = 8, 512
    split = split_for(triton.cdiv(n, block_n), triton.cdiv(k, block_k), num_sms(device),
                      programs_per_sm=2)
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)


def fp8_gemv(x8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor, out_dtype: torch.dtype,
             config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x_scale[m] * w_scale[n] * sum_k float(x8[m, k]) * float(w8[n, k]) for
    M <= GEMV_MAX_ROWS, in one launch: the function of `torch._scaled_mm` with row-wise scales
    (x8 [M, K] e4m3 with x_scale [M, 1] float32 from per_token_fp8, weight [N, K] e4m3 with
    K contiguous, weight_scale [N] float32), float32 accumulation, up to the order in which
    the products are added. Output in out_dtype."""
    m, k = x8.shape
    n = weight.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, not {m}")
    cfg = dict(config or fp8_gemv_config(m, n, k, x8.device))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    out = torch.empty((m, n), dtype=out_dtype, device=x8.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, block_n)
    per_split, split = blocks_per_split(triton.cdiv(k, block_k), cfg.pop("SPLIT_K"))
    partials, counters = split_k_buffers(x8.device, tiles, split, m, block_n)
    _fp8_gemv_kernel[(tiles, split)](
        x8, x_scale.reshape(m), weight, weight_scale, out, partials, counters, n, k, per_split,
        x8.stride(0), weight.stride(0), out.stride(0), ROWS=m, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, **cfg)
    return out
