"""The small-batch (1 to 4 rows) INT4/INT8 weight-only GEMV: y = x @ W on CUDA cores, in one
launch, near the weights' streaming speed.

Layout (radixlm.runtime.models.quantization.int_weight): qweight [K / PACK, N] int32 with N
contiguous and PACK = 32 / BITS values of consecutive inputs per word, the first in the low
bits; scales [G, N] and zeros [G, N] uint8 per group of inputs. The function is the
reference's, sum_k x_k (q_kn - z_gn) s_gn, accumulated in float32.

A program owns BLOCK_N columns and a range of K blocks of BLOCK_W words (BLOCK_W * PACK
inputs, inside one group):

- Every tile is 2-D, [BLOCK_W, BLOCK_N], in the layout of the loaded words (N contiguous:
  coalesced vector loads). No 3-D tensors and no reductions or layout changes in the loop.
- sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k) over a block: per slot, one FMA per
  word into the block's partial p; per block, acc += s (p - z xsum) elementwise on the 2-D
  accumulator. The reduction over W happens once, at the end of the program.
- The group's scale and zero rows are loaded broadcast to [BLOCK_W, BLOCK_N]: a 1-D load
  would get a layout of its own and a trip through shared memory every block. The same-shape
  byte load (zeros) also leads Triton to give each thread 16 consecutive columns of a row, so
  each x value a thread loads and scales serves 16 weights.
- No shift and no int-to-float conversion per weight: slot s masked in place at bit P and read
  as a float32 is exactly q * 2**(P - 149) (every 24-bit pattern b reads as b * 2**-149:
  subnormal, or 2**-126 scale when bit 23 is set). x is scaled by 2**(X_EXP - P) (exact, a
  power of two), so each product is x q * 2**(X_EXP - 149) and one multiply at the end undoes
  that. Slots above bit 23 are masked from the word shifted right by 8 (the arithmetic
  shift's sign copies land above bit 23, outside the mask). Per weight: one AND, one FMA.
  Exact while |x| < 2**32 (the scaled x stays finite) and |x q| > 2**-73 (products stay
  normal); FMAs keep subnormal inputs (Triton does not flush fp32 subnormals on NVIDIA).
- The next block's words are loaded before the current block is used: two blocks of loads
  in flight per program (Triton does not pipeline loads that feed no dot).
- K is split over SPLIT_K programs per column tile and reduced in the same launch
  (radixlm.kernels.split_k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.split_k import blocks_per_split, finish_split_k, split_k_buffers

MAX_ROWS = 4  # one program serves up to this many rows of x, reading each weight once
X_EXP = tl.constexpr(96)  # products are x q * 2**(X_EXP - 149): see the module docstring


@triton.constexpr_function
def _slot_position(slot, bits):
    """Where slot `slot` sits in the word it is masked from: the word itself for bits 0-23,
    the word shifted right by 8 above that."""
    start = slot * bits
    return start if start + bits <= 24 else start - 8


@triton.constexpr_function
def _x_factor(slot, bits, x_exp):
    return 2.0 ** (x_exp - _slot_position(slot, bits))


@triton.jit
def _slot_values(words, SLOT: tl.constexpr, BITS: tl.constexpr):
    """Slot SLOT of every word as float32 q * 2**(P - 149), P = _slot_position(SLOT)."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if SLOT * BITS + BITS <= 24:
        bits = words & (MASK << _slot_position(SLOT, BITS))
    else:
        bits = (words >> 8) & (MASK << _slot_position(SLOT, BITS))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_x(x_row_ptr, k, K, EVEN_K: tl.constexpr):
    """x at the [BLOCK_W] inputs k of one slot, as float32 (0 past K)."""
    if EVEN_K:
        x = tl.load(x_row_ptr + k)
    else:
        x = tl.load(x_row_ptr + k, mask=k < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _add_slot(p, xsum, values, x_row_ptr, k, K, X_FACTOR: tl.constexpr,
              EVEN_K: tl.constexpr):
    """p += x_k * values for one row of x, xsum += x_k (k: the [BLOCK_W] inputs of one slot)."""
    x = _load_x(x_row_ptr, k, K, EVEN_K)
    # Explicit FMAs: Triton's default of fusing a * b + c is changing to off.
    return tl.fma((x * X_FACTOR)[:, None], values, p), xsum + x


@triton.jit
def _add_block(acc, p, xsum, scale, zero):
    """acc += s (p - z xsum), with xsum brought to p's scale: the group's scale and zero
    applied elementwise to the block's [BLOCK_W, BLOCK_N] partial sums."""
    to_p_scale: tl.constexpr = 2.0 ** (X_EXP - 149)
    return tl.fma(scale, tl.fma(-zero, (xsum * to_p_scale)[:, None], p), acc)


@triton.jit
def _load_words(qw_ptr, block, offs_w, offs_n, stride_qk, row_limit, N, BLOCK_W: tl.constexpr,
                EVEN_N: tl.constexpr):
    """The [BLOCK_W, BLOCK_N] words of K block `block`; rows from row_limit on read as 0
    (row_limit: the end of the split's rows, or of qweight's)."""
    rows = block * BLOCK_W + offs_w
    mask = (rows < row_limit)[:, None]
    if not EVEN_N:
        mask = mask & (offs_n < N)[None, :]
    return tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=mask, other=0)


@triton.jit
def _load_group_row(ptr, offs_w, offs_n, N, EVEN_N: tl.constexpr):
    """One group's row of scales or zeros, broadcast to [BLOCK_W, BLOCK_N] in the load."""
    offs = offs_n[None, :] + 0 * offs_w[:, None]
    if EVEN_N:
        row = tl.load(ptr + offs)
    else:
        row = tl.load(ptr + offs, mask=offs < N, other=0)
    return row.to(tl.float32)


# blocks_per_split is not specialized (on == 1 or divisibility): one compiled kernel serves
# every K split of a tiling.
@triton.jit(do_not_specialize=["blocks_per_split"])
def _int_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, counters_ptr,
                     N, K, blocks_per_split, stride_xm, stride_qk, stride_sg, stride_zg,
                     stride_om, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_W: tl.constexpr, GROUP_BLOCKS: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """Grid (column tiles, K splits). ROWS rows of x (1..4), each with its own accumulator.
    GROUP_BLOCKS K blocks per group; EVEN_K/EVEN_N: no partial K block / column tile."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PACK: tl.constexpr = 32 // BITS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    words_in_k = tl.cdiv(K, PACK)
    acc0 = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    first = pid_k * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(K, BLOCK_W * PACK))
    row_limit = tl.minimum(last * BLOCK_W, words_in_k)
    next_words = _load_words(qw_ptr, first, offs_w, offs_n, stride_qk, row_limit, N, BLOCK_W,
                             EVEN_N)
    for block in range(first, last):
        words = next_words
        next_words = _load_words(qw_ptr, block + 1, offs_w, offs_n, stride_qk, row_limit, N,
                                 BLOCK_W, EVEN_N)
        group = block // GROUP_BLOCKS
        scale = _load_group_row(s_ptr + group * stride_sg, offs_w, offs_n, N, EVEN_N)
        zero = _load_group_row(z_ptr + group * stride_zg, offs_w, offs_n, N, EVEN_N)
        p0 = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
        p1 = p0
        p2 = p0
        p3 = p0
        xsum0 = tl.zeros((BLOCK_W,), dtype=tl.float32)
        xsum1 = xsum0
        xsum2 = xsum0
        xsum3 = xsum0
        for slot in tl.static_range(PACK):
            values = _slot_values(words, slot, BITS)
            k = (block * BLOCK_W + offs_w) * PACK + slot  # the input of each word's slot
            factor = _x_factor(slot, BITS, X_EXP)
            p0, xsum0 = _add_slot(p0, xsum0, values, x_ptr, k, K, factor, EVEN_K)
            if ROWS > 1:
                p1, xsum1 = _add_slot(p1, xsum1, values, x_ptr + stride_xm, k, K, factor,
                                      EVEN_K)
            if ROWS > 2:
                p2, xsum2 = _add_slot(p2, xsum2, values, x_ptr + 2 * stride_xm, k, K, factor,
                                      EVEN_K)
            if ROWS > 3:
                p3, xsum3 = _add_slot(p3, xsum3, values, x_ptr + 3 * stride_xm, k, K, factor,
                                      EVEN_K)
        acc0 = _add_block(acc0, p0, xsum0, scale, zero)
        if ROWS > 1:
            acc1 = _add_block(acc1, p1, xsum1, scale, zero)
        if ROWS > 2:
            acc2 = _add_block(acc2, p2, xsum2, scale, zero)
        if ROWS > 3:
            acc3 = _add_block(acc3, p3, xsum3, scale, zero)
    to_real: tl.constexpr = 2.0 ** (149 - X_EXP)  # the one reduction over W, then the scale
    finish_split_k(out_ptr, stride_om, partials_ptr, counters_ptr, offs_n, offs_n < N,
                   tl.sum(acc0, axis=0) * to_real, tl.sum(acc1, axis=0) * to_real,
                   tl.sum(acc2, axis=0) * to_real, tl.sum(acc3, axis=0) * to_real,
                   ROWS, BLOCK_N)


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor, group_size: int, bits: int, BLOCK_N: int, BLOCK_W: int,
             SPLIT_K: int, num_warps: int = 4, num_stages: int = 1) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, rows contiguous) @ W -> [M, N] in x's dtype, one launch.
    A K block (BLOCK_W words, BLOCK_W * 32 / bits inputs) must lie inside one group."""
    m, k = x.shape
    n = qweight.shape[1]
    block_k = BLOCK_W * (32 // bits)
    if group_size % block_k:
        raise ValueError(f"the GEMV's K blocks ({block_k} inputs) must lie inside one group "
                         f"({group_size})")
    if m > MAX_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_ROWS} rows, not {m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tiles = triton.cdiv(n, BLOCK_N)
    per_split, split = blocks_per_split(triton.cdiv(k, block_k), SPLIT_K)
    partials, counters = split_k_buffers(x.device, tiles, split, m, BLOCK_N)
    _int_gemv_kernel[(tiles, split)](
        x, qweight, scales, zeros, out, partials, counters, n, k, per_split, x.stride(0),
        qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(0), BITS=bits, ROWS=m,
        BLOCK_N=BLOCK_N, BLOCK_W=BLOCK_W, GROUP_BLOCKS=group_size // block_k,
        EVEN_K=k % block_k == 0, EVEN_N=n % BLOCK_N == 0, num_warps=num_warps,
        num_stages=num_stages)
    return out
