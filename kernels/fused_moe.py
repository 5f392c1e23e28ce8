"""Mixture-of-experts in Triton: grouped GEMMs over tokens sorted by expert.

A step routes T tokens to k experts each: P = T * k (token, expert) pairs, pair p being token
p // k's choice p % k. The pairs are sorted by expert and each expert's run is padded to whole
blocks of BLOCK_M rows, so a block belongs to one expert:

    ids [T, k] = [[2, 0], [2, 1], [0, 2]]          (P = 6 pairs, E = 3 experts, BLOCK_M = 4)
    sorted pairs: expert 0: 1 4 | expert 1: 3 | expert 2: 0 2 5
    padded:       [1 4 P P | 3 P P P | 0 2 5 P]      block_expert = [0, 1, 2] (-1: unused)

A program of the grouped GEMM owns one block and one tile of output columns: it multiplies
its rows (gathered from the input by pair or by token) by its expert's weight and writes each
row back to the row of its pair. Then:

    h   = x[token(p)] @ w13[e]^T        [P, 2I]   (gate | up)
    a   = silu(gate) * up               [P, I]
    y   = weight(p) * a @ w2[e]^T       [P, d]    float32
    out = sum over each token's k rows  [T, d]

Quantized experts (e4m3 or int8 weights, a float32 scale per output channel of each expert):
each weight tile is converted to the activations' dtype as it is loaded (exact: every e4m3 and
int8 value is a bfloat16), multiplied on the same tensor cores, and the scale, which belongs to
an output column, multiplies the accumulator once after the K loop. The weights are read at one
byte each; the activations are not quantized.

Everything is sized from T, k and E alone (the number of blocks from its upper bound
cdiv(P, BLOCK_M) + min(P, E), unused ones exiting at once), and no value is read back to the
host: a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.fused import silu_and_mul


def align_to_blocks(ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [B * block_m]: pair index per sorted row, P where padding;
    block_expert [B]: each block's expert, -1 past the last used block)."""
    flat = ids.flatten()  # [P]
    num_pairs = flat.numel()
    device = ids.device
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_pairs, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]; bincount would sync
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # end row of each expert's padded run
    order = torch.argsort(flat, stable=True)  # [P] pairs by expert
    experts = flat[order]
    # Rank of each sorted pair within its expert's run: its index minus the run's start.
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    pairs[(ends - padded)[experts] + rank] = order
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)  # first run ending later
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pairs, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    N, K, num_pairs, top_k,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    ROWS_ARE_TOKENS: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    tile_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the last expert's run
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)  # [BLOCK_M]; num_pairs marks padding
    valid = pairs < num_pairs
    rows = pairs // top_k if ROWS_ARE_TOKENS else pairs  # rows of a to multiply
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :],
                    mask=valid[:, None] & (ks < K)[None, :], other=0.0)  # [M, K]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + ks[:, None],
                    mask=(offs_n < N)[None, :] & (ks < K)[:, None], other=0.0)  # [K, N]
        if HAS_SCALE:  # e4m3 / int8 values, exact in the activations' dtype
            w = w.to(a_ptr.dtype.element_ty)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_SCALE:  # one scale per output column: applied once, to the sums
        scale = tl.load(scale_ptr + expert.to(tl.int64) * stride_se + offs_n, mask=offs_n < N,
                        other=0.0)
        acc *= scale[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < N)[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                  out: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
                  weights: torch.Tensor | None, top_k: int, rows_are_tokens: bool,
                  block_m: int) -> None:
    """out[p] = (weights[p] *) a[row(p)] @ (w[expert(p)] (* scale[expert(p)][:, None]))^T
    for every pair p."""
    num_pairs, n = out.shape
    k = w.shape[2]
    block_n = 64 if num_pairs <= 64 else 128  # small steps: more programs over the weights
    # One-byte weights: twice the K per tile, so each row's load stays 128 bytes.
    block_k = 32 if a.dtype == torch.float32 else 128 if w.element_size() == 1 else 64
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, scale if scale is not None else out, out, pairs, block_expert,
        weights if weights is not None else out, n, k, num_pairs, top_k,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0) if scale is not None else 0,
        out.stride(0),
        ROWS_ARE_TOKENS=rows_are_tokens, MUL_WEIGHT=weights is not None,
        HAS_SCALE=scale is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # tf32 would cost fp32 models their agreement with the torch path
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3 if a.dtype != torch.float32 else 2)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d] through experts ids [T, k] (routing weights [T, k]) -> [T, d] in x's dtype.
    w13 [E, 2I, d] is each expert's gate then up rows, w2 [E, d, I] its down projection; with
    scales ([E, 2I] and [E, d] float32), e4m3 or int8 weights scaled per output channel."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    if x.stride(-1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe needs contiguous weights and a contiguous last axis of x")
    if (w13_scale is None) != (w2_scale is None) or (w13_scale is None) != (
            w13.element_size() > 1):
        raise ValueError("fused_moe: float experts take no scales; e4m3/int8 experts take both")
    num_pairs = num_tokens * top_k
    block_m = 16 if num_pairs <= 256 else 64
    pairs, block_expert = align_to_blocks(ids, w13.shape[0], block_m)
    h = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)  # [P, 2I]
    _grouped_gemm(x, w13, _scales(w13_scale), h, pairs, block_expert, None, top_k, True,
                  block_m)
    act = silu_and_mul(h)  # [P, I]
    y = torch.empty(num_pairs, w2.shape[1], dtype=torch.float32, device=x.device)  # [P, d]
    _grouped_gemm(act, w2, _scales(w2_scale), y, pairs, block_expert,
                  weights.flatten().float().contiguous(), top_k, False, block_m)
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _scales(scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if scale is None else scale.float().contiguous()
