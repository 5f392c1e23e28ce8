"""Paged decode attention (one query token per sequence) in Triton, flash-decoding style.

A program owns one (sequence, KV head, split): it loads the sequence's GROUP query heads that
share that KV head as one [BLOCK_H, D] tile, so each K/V tile is read once for the whole group,
and runs an online softmax over its share of the context. With one split it writes the output
directly; with several, each split writes a normalised partial output and its log-sum-exp, and
a second kernel merges the splits:

    context [0, kv_len) in tiles of BLOCK_N; split s takes tiles [s*tps, (s+1)*tps)
    tps = cdiv(cdiv(kv_len, BLOCK_N), num_splits)          (per sequence: long ones split wider)
    out = sum_s exp2(lse_s - max lse) * o_s / sum_s exp2(lse_s - max lse)

Keys are gathered token by token through the slot table, so any page size works.
Log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e)) so exp2 can be used.
A float8 cache (radixlm.runtime.attention.kv_cache) is widened as it is loaded, to the query's
dtype or (WIDEN_FP16) to float16 with the query cast to float16 too: e4m3 -> float16 is exact
and one instruction, where e4m3 -> bfloat16 goes through float32; a bfloat16 query loses
nothing in float16 unless |q| > 65504 or it is subnormal there (< 6e-5). Its K scale is part of
score_mul and its V scale is out_mul.

A float8 V under a 16-bit query (V_PAIRS) is read as int16 pairs of adjacent head dims and
widened with integer ops into two float16 tiles, the even and the odd dims, each multiplied by
p on its own. V is the transposed operand of p @ v, and shared memory has no transposing
matrix load for 8-bit data: read as float8, the tile came back from shared memory a byte at
a time (128 loads per thread per tile, profiled on an H200); as int16 it takes the 16-bit
transposing load. The widening is exact: e5m2 is the top byte of a float16, and e4m3 placed
below the sign bit is a float16 of the value * 2^-8 (the caller folds 2^8 into out_mul). On
CUDA (V_CVT) e4m3 pairs are widened by the GPU's pairwise conversion instead, one instruction
a pair against ~8 integer ops (128 registers a thread against 145, Triton 3.6, sm_90).

(Merging in the split kernel itself, the last split of each sequence and KV head taking a
ticket and merging, made batch-1 decode attention slower on an H200: 14 us a layer against 12
for split + merge + store kernels, Llama-3-8B shape at a ~1088-token context.)

A sliding window moves the start of the context: keys [max(kv_len - window, 0), kv_len) are
split as above, so out-of-window keys are never even loaded. Soft-capped scores (SOFTCAP) are
cap * tanh(q.k * scale / cap), computed as tanh(q.k * score_mul) * cap_mul with
score_mul = scale / cap and cap_mul = cap * log2(e); without a cap, score_mul = scale * log2(e).
"""

from __future__ import annotations

import triton
import triton.language as tl

from radixlm.kernels.pdl import pdl_prologue


@triton.jit
def tanh(x):
    # tanh through the sigmoid: exact enough in fp32 (|error| ~1e-7) and on every backend.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def scores(q, k, score_mul, cap_mul, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q.k^T in base-2 log units: [M, D] x [N, D] -> [M, N], capped when SOFTCAP."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * score_mul
    if SOFTCAP:
        s = tanh(s) * cap_mul
    return s


@triton.jit
def fp8_pairs_to_fp16(pairs, HIGH: tl.constexpr, E4M3: tl.constexpr):
    """int16 lanes each holding two float8 bytes -> float16 of the low or the HIGH byte:
    exactly the value for e5m2, the value * 2^-8 for e4m3 (sign kept, 7 bits shifted under
    float16's top exponent bit)."""
    if E4M3:
        if HIGH:
            bits = (pairs & -32768) | ((pairs >> 1) & 0x3F80)
        else:
            bits = ((pairs << 8) & -32768) | ((pairs << 7) & 0x3F80)
    else:
        bits = (pairs & -256) if HIGH else (pairs << 8)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def e4m3_pairs_to_fp16_cvt(pairs):
    """int16 lanes each holding two e4m3 bytes -> (float16 of the low byte, of the high byte),
    exact values, by the hardware's pairwise conversion: one instruction a lane (CUDA sm_89+)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 r; cvt.rn.f16x2.e4m3x2 r, $2; mov.b32 {$0, $1}, r; }",
        "=h,=h,h", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)


@triton.jit
def store_rows(ptrs, acc, acc_even, acc_odd, mul, mask_h, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, V_PAIRS: tl.constexpr):
    """Rows [BLOCK_H, HEAD_DIM] starting at ptrs ([BLOCK_H, 1]): acc * mul, or with V_PAIRS
    the even dims from acc_even and the odd ones from acc_odd."""
    if V_PAIRS:
        offs_j = tl.arange(0, BLOCK_D // 2)
        mask = mask_h[:, None] & (offs_j < HEAD_DIM // 2)[None, :]
        tl.store(ptrs + 2 * offs_j[None, :], (acc_even * mul).to(ptrs.dtype.element_ty),
                 mask=mask)
        tl.store(ptrs + 2 * offs_j[None, :] + 1, (acc_odd * mul).to(ptrs.dtype.element_ty),
                 mask=mask)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(ptrs + offs_d[None, :], (acc * mul).to(ptrs.dtype.element_ty),
                 mask=mask_h[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    slot_table_ptr, kv_lens_ptr, seq_rows_ptr, q_rows_ptr,
    score_mul, cap_mul, out_mul, window, num_splits, num_heads,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_vs, stride_vh, stride_tb, stride_ot,
    stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_FP16: tl.constexpr,
    V_PAIRS: tl.constexpr, V_E4M3: tl.constexpr, V_CVT: tl.constexpr, FP8_QK: tl.constexpr,
    PDL: tl.constexpr,
):
    # V_PAIRS: v_cache_ptr is the float8 V cache viewed as int16 (its strides stride_vs and
    # stride_vh in int16 units, read only then), V_E4M3 its format (else e5m2).
    pdl_prologue(PDL)
    pid = tl.program_id(0)  # index among the step's decode sequences
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(seq_rows_ptr + pid)  # the sequence's row in the batch / slot table
    q_row = tl.load(q_rows_ptr + pid)  # its token's row in q and out
    kv_len = tl.load(kv_lens_ptr + row)

    first = tl.maximum(kv_len - window, 0)  # the oldest key in the window
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len - first, BLOCK_N), num_splits)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, kv_len)

    offs_g = tl.arange(0, BLOCK_H)  # query heads of this KV head's group (padded to >= 16)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_D // 2)  # V_PAIRS: pairs of head dims (2j, 2j + 1)
    heads = kv_head * GROUP + offs_g
    mask_hd = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_hd, other=0.0)  # [BLOCK_H, BLOCK_D]
    if WIDEN_FP16:
        q = q.to(tl.float16)
    row_mul = score_mul
    if FP8_QK:  # q rounded to e4m3 per head, scaled by its max |q| / 448; keys stay e4m3
        q32 = q.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.abs(q32), 1), 1e-30) / 448.0  # [BLOCK_H]
        q = (q32 / q_scale[:, None]).to(k_cache_ptr.dtype.element_ty)
        row_mul = score_mul * q_scale[:, None]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc_even = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)  # V_PAIRS
    acc_odd = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
    table = slot_table_ptr + row * stride_tb
    for n0 in range(start, end, BLOCK_N):
        mask_n = (n0 + offs_n) < end
        slots = tl.load(table + n0 + offs_n, mask=mask_n, other=0)  # [BLOCK_N] int64
        # [BLOCK_N, BLOCK_D] offsets of this KV head's rows for the tile's tokens
        kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
        mask_nd = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
        # A float8 cache is widened to q's (compute) dtype; its scales are in score_mul and
        # out_mul.
        k = tl.load(k_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(q.dtype)
        # V is loaded before the softmax needs it, so that its latency overlaps K's: at
        # batch 1 a program sees one or two tiles and waits on memory, not on math.
        if V_PAIRS:
            pair_off = slots[:, None] * stride_vs + kv_head * stride_vh + offs_j[None, :]
            pairs = tl.load(v_cache_ptr + pair_off,
                            mask=mask_n[:, None] & (offs_j < HEAD_DIM // 2)[None, :], other=0)
        else:  # V's layout is K's: one set of offsets (separate ones cost ~50 registers)
            v = tl.load(v_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(q.dtype)
        if FP8_QK:  # keys x heads: 128 key rows make a warpgroup MMA, which takes float8
            s = tl.trans(tl.dot(k, tl.trans(q))) * row_mul
            if SOFTCAP:
                s = tanh(s) * cap_mul
        else:
            s = scores(q, k, score_mul, cap_mul, SOFTCAP, DOT_PRECISION)
        s = tl.where(mask_n[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_PAIRS:
            p16 = p.to(tl.float16)
            if V_CVT:
                v_even, v_odd = e4m3_pairs_to_fp16_cvt(pairs)
            else:
                v_even = fp8_pairs_to_fp16(pairs, False, V_E4M3)
                v_odd = fp8_pairs_to_fp16(pairs, True, V_E4M3)
            acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even,
                                                          input_precision=DOT_PRECISION)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd,
                                                        input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                input_precision=DOT_PRECISION)
        m_i = m_new

    if DIRECT:  # one split: the split's result is the answer
        store_rows(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh, acc, acc_even,
                   acc_odd, out_mul / l_i[:, None], offs_g < GROUP, HEAD_DIM, BLOCK_D, V_PAIRS)
    else:
        # A short sequence can leave trailing splits empty: they report lse = -inf, weight 0.
        has_keys = l_i > 0
        l_safe = tl.where(has_keys, l_i, 1.0)
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        # partials are [num_decode, num_heads, num_splits, HEAD_DIM] and [.., .., num_splits]
        part = (pid * num_heads + heads) * num_splits + split  # [BLOCK_H]
        store_rows(part_o_ptr + part[:, None] * HEAD_DIM, acc, acc_even, acc_odd,
                   out_mul / l_safe[:, None], offs_g < GROUP, HEAD_DIM, BLOCK_D, V_PAIRS)
        tl.store(part_lse_ptr + part, lse, mask=offs_g < GROUP)


@triton.jit
def decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, q_rows_ptr, num_splits, num_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(q_rows_ptr + pid)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    base = (pid * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    # Split 0 always holds keys (kv_len >= 1), so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]
    mask_sd = mask_s[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_sd, other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
