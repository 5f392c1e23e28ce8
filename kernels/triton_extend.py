"""Extend (prefill) attention over the paged KV cache in Triton.

Each sequence brings a chunk of q_len new tokens and attends to kv_len keys: its cached prefix
plus the chunk itself (already written into the cache). A program owns BLOCK_M consecutive
queries of one sequence and one query head. With prefix = kv_len - q_len, query m sits at
position prefix + m and sees keys 0 .. prefix + m:

    keys    0 ........................ full_end ..... prefix+m0 ... prefix+m0+BLOCK_M-1
            |  visible to every query  |  causal tile(s): per-row mask n <= prefix + m   |
    full_end = (prefix + m0) rounded down to BLOCK_N

so only the last one or two key tiles of a block pay for the mask. With a sliding window
(WINDOWED), query m sees keys prefix + m - window + 1 .. prefix + m only: the block starts at
the tile holding its first query's oldest key, and every tile pays for the mask (rows of a
block see different ranges). A float8 cache is widened to the query's dtype as it is loaded
(its K scale is part of score_mul, its V scale is out_mul). Programs are laid out by a
per-step block table (block -> sequence, first query) built on the host from q_lens, which the
scheduler already knows: no device sync is needed to size the grid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from radixlm.kernels.triton_decode import scores


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table, n0, kv_head, pos_m, kv_len, m_i, l_i, acc,
                 score_mul, cap_mul, window, stride_cs, stride_ch,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if CAUSAL:
        mask_n = offs_n < kv_len
        slots = tl.load(table + offs_n, mask=mask_n, other=0)
    else:
        mask_n = offs_n >= 0
        slots = tl.load(table + offs_n)
    kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]  # [N, D]
    mask_nd = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(q.dtype)  # float8: widened
    s = scores(q, k, score_mul, cap_mul, SOFTCAP, DOT_PRECISION)  # [M, N]
    if CAUSAL:
        visible = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
        if WINDOWED:
            visible &= offs_n[None, :] > pos_m[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet (all -inf so far, possible with a window) keeps
    # m = -inf; subtracting 0 instead keeps its alpha and p at 0 rather than NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, slot_table_ptr,
    block_rows_ptr, block_m0_ptr, q_starts_ptr, q_lens_ptr, kv_lens_ptr,
    score_mul, cap_mul, out_mul, window,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(block_rows_ptr + block)  # the sequence's row in the batch / slot table
    m0 = tl.load(block_m0_ptr + block)  # first query of this block, within the chunk
    q_start = tl.load(q_starts_ptr + row)
    q_len = tl.load(q_lens_ptr + row)
    kv_len = tl.load(kv_lens_ptr + row)
    prefix = kv_len - q_len
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_md = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                + offs_d[None, :], mask=mask_md, other=0.0)  # [BLOCK_M, BLOCK_D]
    pos_m = prefix + offs_m  # absolute positions of the block's queries

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = slot_table_ptr + row * stride_tb
    full_end = (prefix + m0) // BLOCK_N * BLOCK_N
    causal_end = tl.minimum(prefix + m0 + BLOCK_M, kv_len)
    if WINDOWED:
        # From the tile of the first query's oldest visible key, all masked.
        first = tl.maximum(prefix + m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(first, causal_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, n0, kv_head,
                                         pos_m, kv_len, m_i, l_i, acc, score_mul, cap_mul,
                                         window, stride_cs, stride_ch, HEAD_DIM, BLOCK_D,
                                         BLOCK_N, True, True, SOFTCAP, DOT_PRECISION)
    else:
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, n0, kv_head,
                                         pos_m, kv_len, m_i, l_i, acc, score_mul, cap_mul,
                                         window, stride_cs, stride_ch, HEAD_DIM, BLOCK_D,
                                         BLOCK_N, False, False, SOFTCAP, DOT_PRECISION)
        # Every row sees key full_end (<= its own position), so no row ends all -inf.
        for n0 in range(full_end, causal_end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, n0, kv_head,
                                         pos_m, kv_len, m_i, l_i, acc, score_mul, cap_mul,
                                         window, stride_cs, stride_ch, HEAD_DIM, BLOCK_D,
                                         BLOCK_N, True, False, SOFTCAP, DOT_PRECISION)
    out = acc * (out_mul / l_i[:, None])  # out_mul: a float8 cache's V scale
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_md)
