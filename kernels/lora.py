"""LoRA updates for a batch whose rows use different adapters: shrink (u = A x) and expand
(out += B u), each one launch over the whole batch (SGMV style).

The rows are grouped by adapter slot on the host (lora_rows.py): `rows` lists the batch's
row indices slot by slot, and `tiles` [num_tiles, 3] cuts that list into tiles of at most
BLOCK_M rows of one slot, as (slot, first, stop) into `rows`; a tile whose slot is -1 does
nothing, so a CUDA graph can be captured with as many tiles as its batch size could ever need
and replayed with fewer. Rows of the base model are in no tile and are not touched.

Weights, per linear (see runtime/models/lora/slots.py): A [slots, P * R, in] (part p's A in
rows p R .. p R + rank) and B transposed [slots, P * R, out]. `part_ranks[slot, p]` is the
rank of the slot's adapter on part p, so a rank-16 adapter in rank-64 slots reads a quarter of
the weights, and a part the adapter does not train (k of an adapter of q and v) none: an output
tile no trained part may write is not read or written at all.
`part_cols[p]` = (first, stop) output columns part p's B may write: expand reads part p's
rank block only for output tiles inside them, so a fused qkv or gate_up layer does not read
the zeros of its B outside each part.

Shrink splits `in` over SPLIT_K programs (a batch-1 GEMV needs the parallelism) that write
float32 partial sums [SPLIT_K, rows, P * R]; expand adds them in split order before rounding u
to the weights' dtype (as the unfused x @ A^T would) — no atomics, so the result does not
depend on which program ran first.

Launch shapes, from a sweep on an H100 (8B layer shapes, batch 256, 1 and 64 adapters, ranks
16 and 64; docs/lora.md): shrink is latency-bound, best with small programs (2 warps, 512
inputs each, three stages); expand streams B and the output, best with wide column blocks
(512) so that each program loads its tile's u once for many columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.lora_rows import BLOCK_M, BLOCK_R

SHRINK_INPUTS = 512  # inputs per shrink program (before the cap on programs)
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_N = 512


def split_k(in_features: int) -> int:
    """Programs `in` is split over in shrink: about SHRINK_INPUTS inputs each, at most 16.
    Fixed by the layer alone, so a row's sums do not depend on its batch."""
    return max(1, min(16, triton.cdiv(in_features, SHRINK_INPUTS)))


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, tiles_ptr, part_ranks_ptr, partial_ptr,
                   num_rows, in_features, stride_x, width, rank_stride, k_per_split,
                   NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    rank_block = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(tiles_ptr + tile * 3)
    if slot >= 0:
        part = rank_block * BLOCK_R // rank_stride
        rank = tl.load(part_ranks_ptr + slot * NUM_PARTS + part)
        if (rank_block * BLOCK_R) % rank_stride < rank:
            first = tl.load(tiles_ptr + tile * 3 + 1)
            stop = tl.load(tiles_ptr + tile * 3 + 2)
            m = first + tl.arange(0, BLOCK_M)
            m_ok = m < stop
            rows = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
            r = rank_block * BLOCK_R + tl.arange(0, BLOCK_R)
            a_base = a_ptr + slot.to(tl.int64) * width * in_features
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            k_first = split * k_per_split
            k_stop = tl.minimum(k_first + k_per_split, in_features)
            for k in range(k_first, k_stop, BLOCK_K):
                kk = k + tl.arange(0, BLOCK_K)
                k_ok = kk < k_stop
                xs = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                             mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_base + r[None, :] * in_features + kk[:, None],
                            mask=k_ok[:, None], other=0.0)
                acc = tl.dot(xs, a, acc, input_precision=DOT_PRECISION)
            out = partial_ptr + (split * num_rows + rows[:, None]) * width + r[None, :]
            tl.store(out, acc, mask=m_ok[:, None])


@triton.jit
def _expand_kernel(partial_ptr, b_ptr, out_ptr, rows_ptr, tiles_ptr, part_ranks_ptr,
                   part_cols_ptr,
                   num_rows, out_features, stride_out, width, rank_stride,
                   NUM_PARTS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    slot = tl.load(tiles_ptr + tile * 3)
    if slot >= 0:
        first = tl.load(tiles_ptr + tile * 3 + 1)
        stop = tl.load(tiles_ptr + tile * 3 + 2)
        m = first + tl.arange(0, BLOCK_M)
        m_ok = m < stop
        rows = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
        n_first = col_block * BLOCK_N
        n = n_first + tl.arange(0, BLOCK_N)
        n_ok = n < out_features
        n_stop = tl.minimum(n_first + BLOCK_N, out_features)
        b_base = b_ptr + slot.to(tl.int64) * width * out_features
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        touched = False  # whether any part of the adapter may write these columns
        for p in tl.static_range(NUM_PARTS):
            cols_first = tl.load(part_cols_ptr + 2 * p)
            cols_stop = tl.load(part_cols_ptr + 2 * p + 1)
            rank = tl.load(part_ranks_ptr + slot * NUM_PARTS + p)
            writes = (cols_first < n_stop) & (cols_stop > n_first) & (rank > 0)
            touched = touched | writes
            if writes:
                for j in range(0, rank, BLOCK_R):
                    r = p * rank_stride + j + tl.arange(0, BLOCK_R)
                    u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for s in tl.static_range(SPLIT_K):
                        u += tl.load(partial_ptr + (s * num_rows + rows[:, None]) * width
                                     + r[None, :], mask=m_ok[:, None], other=0.0)
                    w = tl.load(b_base + r[:, None] * out_features + n[None, :],
                                mask=n_ok[None, :], other=0.0)
                    acc = tl.dot(u.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
        if touched:
            ptrs = out_ptr + rows[:, None] * stride_out + n[None, :]
            mask = m_ok[:, None] & n_ok[None, :]
            current = tl.load(ptrs, mask=mask, other=0.0)
            tl.store(ptrs, (current.to(tl.float32) + acc).to(current.dtype), mask=mask)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             rows: torch.Tensor, tiles: torch.Tensor, num_tiles: int, part_ranks: torch.Tensor,
             part_cols: torch.Tensor, rank_stride: int) -> torch.Tensor:
    """out[row] += B[slot] (A[slot] x[row]) for each row of the first `num_tiles` tiles, in
    place; returns out.

    x [T, in] and out [T, out] with contiguous columns; a [S, W, in] and b [S, W, out]
    contiguous (W = parts * rank_stride); rows and tiles [>= num_tiles, 3] int32 (as in the
    module docstring); part_ranks [S, parts] int32; part_cols [parts, 2] int32.
    """
    num_rows, in_features = x.shape
    out_features = out.shape[1]
    width = a.shape[1]
    if num_rows == 0 or num_tiles == 0:
        return out
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert rank_stride % BLOCK_R == 0 and width % rank_stride == 0
    assert part_ranks.shape[1] == part_cols.shape[0] == width // rank_stride
    block_k = min(SHRINK_BLOCK_K, max(16, triton.next_power_of_2(in_features)))
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k(in_features)), block_k) * block_k
    splits = triton.cdiv(in_features, k_per_split)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    partials = torch.empty((splits, num_rows, width), dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tiles, width // BLOCK_R, splits)](
        x, a, rows, tiles, part_ranks, partials, num_rows, in_features, x.stride(0), width,
        rank_stride, k_per_split, NUM_PARTS=part_cols.shape[0], BLOCK_M=BLOCK_M,
        BLOCK_R=BLOCK_R, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=2, num_stages=3)
    block_n = min(EXPAND_BLOCK_N, max(16, triton.next_power_of_2(out_features)))
    _expand_kernel[(num_tiles, triton.cdiv(out_features, block_n))](
        partials, b, out, rows, tiles, part_ranks, part_cols, num_rows, out_features,
        out.stride(0),
        width, rank_stride, NUM_PARTS=part_cols.shape[0], SPLIT_K=splits, BLOCK_M=BLOCK_M,
        BLOCK_R=BLOCK_R, BLOCK_N=block_n, DOT_PRECISION=precision, num_warps=4,
        num_stages=3 if rank_stride >= 64 else 2)
    return out
