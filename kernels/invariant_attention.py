"""Batch-invariant paged attention in Triton, for deterministic inference: a query's output is
the same bits whether it is computed in a prefill chunk of any size, as a decode step, alone or
in any batch.

One kernel serves decode and extend. A program owns BLOCK_R rows of one KV head: the GROUP
query heads sharing that head, for up to BLOCK_T = BLOCK_R // GROUP consecutive query tokens
of one sequence (a decode step has one token; an extend program takes its block of
BLOCK_TOKENS queries BLOCK_T at a time):

    row r = t * GROUP + g:  token q_row0 + t at position pos0 + t, query head kv_head*GROUP + g

so the score and value dots are [BLOCK_R, D] x [D, BLOCK_N] and [BLOCK_R, BLOCK_N] x
[BLOCK_N, D] in every case: one tile shape, one tensor-core instruction, and a row's result
never depends on the other rows.

Keys are reduced in fixed splits of SPLIT tokens, anchored at position 0 (not at the chunk
or the context length), and inside a split in BLOCK_N tiles anchored the same way:

    split s = keys [s * SPLIT, (s + 1) * SPLIT), as far as the query's own position
    partial_s = online softmax over the split's tiles, from an empty state
              -> (o_s = acc / l, lse_s = m + log2 l)
    out = fold(partial_0, partial_1, ...) in split order, then / L

The fold is the same arithmetic whether it runs in the attention program itself (extend, and
decode when the batch already fills the GPU) or in a merge kernel over partials written to a
float32 workspace (decode of few sequences, where one program per sequence would leave the
GPU idle: `workers` programs per sequence then take every workers-th split). A tile or a split
with no visible key for a row (a later key of the same chunk, or one outside a sliding window)
leaves that row's state exactly as it was, so an extend block may run tiles that only some of
its rows see. Multiply-adds are written as tl.fma so the compiler cannot contract them one
way here and another way there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.pdl import pdl_options, pdl_prologue
from radixlm.kernels.triton_attention import NO_WINDOW, _score_factors
from radixlm.kernels.triton_decode import scores

# Keys per split: a multiple of every BLOCK_N used with it. Fixed for the process, so that every
# engine computes a token the same way; at batch 1 it gives about as many splits as the default
# decode chooses at 1k-2k tokens of context.
SPLIT = 256
# Queries per extend block in the host's block table; a program takes them BLOCK_T at a time.
BLOCK_TOKENS = 16


@triton.jit
def _split_partial(q, k_cache_ptr, v_cache_ptr, table, kv_head, pos_r, lo, hi, window,
                   score_mul, cap_mul, stride_cs, stride_ch,
                   BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """The online softmax of rows at positions pos_r over keys [lo, hi), tile by tile from lo
    (a multiple of BLOCK_N), from an empty state: (m, l, acc)."""
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        slots = tl.load(table + offs_n, mask=in_range, other=0)
        kv_off = slots[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
        mask_nd = in_range[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=mask_nd, other=0.0).to(q.dtype)
        s = scores(q, k, score_mul, cap_mul, SOFTCAP, DOT_PRECISION)  # [R, N]
        visible = (offs_n[None, :] <= pos_r[:, None]) & in_range[None, :]
        if WINDOWED:
            visible &= offs_n[None, :] > pos_r[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet keeps m = -inf; subtracting 0 keeps alpha and p at 0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _normalize(m_i, l_i, acc):
    """A split's (o, lse): o = acc / l, lse = m + log2 l (-inf for a row that saw no key)."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def _fold(big_m, big_l, big_o, o, lse):
    """Add one split (o, lse) to the running (max, sum of weights, weighted sum)."""
    m_new = tl.maximum(big_m, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(big_m - m_use)
    b = tl.exp2(lse - m_use)
    big_l = tl.fma(big_l, a, b)
    big_o = tl.fma(big_o, a[:, None], b[:, None] * o)
    return m_new, big_l, big_o


@triton.jit
def invariant_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, slot_table_ptr,
    block_rows_ptr, block_m0_ptr, q_starts_ptr, q_lens_ptr, kv_lens_ptr,
    score_mul, cap_mul, out_mul, window, num_heads, max_splits,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, DECODE: tl.constexpr, PARTIALS: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (blocks, KV heads, workers).

    DECODE: block i is decode sequence i, at batch row block_rows_ptr[i] and token row
    q_starts_ptr[i], one query at the end of its context. PARTIALS (decode only): worker w
    writes the partials of splits w, w + workers, ... to part_o / part_lse ([blocks,
    num_heads, max_splits, D] and [.., .., max_splits]) for invariant_merge_kernel; without,
    the one worker folds every split itself.
    Extend: block i is BLOCK_TOKENS queries of batch row block_rows_ptr[i] from query
    block_m0_ptr[i] of its chunk (the host's block table does not depend on GROUP), taken
    BLOCK_T at a time."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(block_rows_ptr + pid)
    kv_len = tl.load(kv_lens_ptr + row)
    if DECODE:
        _attend_rows(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                     slot_table_ptr + row * stride_tb, pid, kv_head, tl.load(q_starts_ptr + pid),
                     kv_len - 1, 1, score_mul, cap_mul, out_mul, window, num_heads, max_splits,
                     stride_qt, stride_qh, stride_cs, stride_ch, stride_ot, stride_oh, GROUP,
                     HEAD_DIM, BLOCK_R, BLOCK_T, BLOCK_D, BLOCK_N, SPLIT_LEN, PARTIALS,
                     WINDOWED, SOFTCAP, DOT_PRECISION)
    else:
        m0 = tl.load(block_m0_ptr + pid)
        q_len = tl.load(q_lens_ptr + row)
        q_start = tl.load(q_starts_ptr + row)
        end = tl.minimum(q_len, m0 + BLOCK_TOKENS)
        for j in range(0, (BLOCK_TOKENS + BLOCK_T - 1) // BLOCK_T):
            sub = m0 + j * BLOCK_T
            if sub < end:
                _attend_rows(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr,
                             part_lse_ptr, slot_table_ptr + row * stride_tb, pid, kv_head,
                             q_start + sub, kv_len - q_len + sub,
                             tl.minimum(end - sub, BLOCK_T), score_mul, cap_mul, out_mul,
                             window, num_heads, max_splits, stride_qt, stride_qh, stride_cs,
                             stride_ch, stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_R,
                             BLOCK_T, BLOCK_D, BLOCK_N, SPLIT_LEN, False, WINDOWED, SOFTCAP,
                             DOT_PRECISION)


@triton.jit
def _attend_rows(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, table,
                 pid, kv_head, q_row0, pos0, n_q, score_mul, cap_mul, out_mul, window,
                 num_heads, max_splits, stride_qt, stride_qh, stride_cs, stride_ch, stride_ot,
                 stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_LEN: tl.constexpr, PARTIALS: tl.constexpr, WINDOWED: tl.constexpr,
                 SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One row tile: n_q query tokens (token rows q_row0.., positions pos0..) x GROUP heads."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    tok = offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    valid = (tok < n_q) & (tok < BLOCK_T)
    pos_r = pos0 + tok
    mask_rd = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_row0 + tok)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask_rd, other=0.0)  # [BLOCK_R, BLOCK_D]
    last = pos0 + n_q - 1  # the tile's last query sees keys up to here
    num_splits = last // SPLIT_LEN + 1
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(pos0 - window + 1, 0)
    first_split = first_key // SPLIT_LEN
    first_tile = first_key // BLOCK_N * BLOCK_N  # tiles before it are masked for every row
    if PARTIALS:
        for s in range(first_split + tl.program_id(2), num_splits, tl.num_programs(2)):
            lo = tl.maximum(s * SPLIT_LEN, first_tile)
            hi = tl.minimum((s + 1) * SPLIT_LEN, last + 1)
            m_i, l_i, acc = _split_partial(q, k_cache_ptr, v_cache_ptr, table, kv_head, pos_r,
                                           lo, hi, window, score_mul, cap_mul, stride_cs,
                                           stride_ch, BLOCK_R, HEAD_DIM, BLOCK_D, BLOCK_N,
                                           WINDOWED, SOFTCAP, DOT_PRECISION)
            o, lse = _normalize(m_i, l_i, acc)
            part = (pid * num_heads + heads) * max_splits + s  # [BLOCK_R]
            tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_rd)
            tl.store(part_lse_ptr + part, lse, mask=valid)
    else:
        big_m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        big_l = tl.zeros([BLOCK_R], tl.float32)
        big_o = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for s in range(first_split, num_splits):
            lo = tl.maximum(s * SPLIT_LEN, first_tile)
            hi = tl.minimum((s + 1) * SPLIT_LEN, last + 1)
            m_i, l_i, acc = _split_partial(q, k_cache_ptr, v_cache_ptr, table, kv_head, pos_r,
                                           lo, hi, window, score_mul, cap_mul, stride_cs,
                                           stride_ch, BLOCK_R, HEAD_DIM, BLOCK_D, BLOCK_N,
                                           WINDOWED, SOFTCAP, DOT_PRECISION)
            o, lse = _normalize(m_i, l_i, acc)
            big_m, big_l, big_o = _fold(big_m, big_l, big_o, o, lse)
        _store_out(out_ptr, big_l, big_o, out_mul, q_row0 + tok, heads, offs_d, mask_rd,
                   stride_ot, stride_oh)


@triton.jit
def _store_out(out_ptr, big_l, big_o, out_mul, tokens, heads, offs_d, mask_rd, stride_ot,
               stride_oh):
    inv = out_mul / tl.where(big_l > 0, big_l, 1.0)
    tl.store(out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], (big_o * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask_rd)


@triton.jit
def invariant_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, seq_rows_ptr, q_rows_ptr, kv_lens_ptr,
    out_mul, window, num_heads, max_splits, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr, WINDOWED: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (decode sequences, KV heads): fold the partials of one decode query's splits in
    split order, as invariant_attention_kernel folds them in registers."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + tl.load(seq_rows_ptr + pid))
    q_row = tl.load(q_rows_ptr + pid)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    valid = offs_r < GROUP
    heads = kv_head * GROUP + offs_r
    mask_rd = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    first_key = 0
    if WINDOWED:
        first_key = tl.maximum(kv_len - window, 0)
    num_splits = (kv_len - 1) // SPLIT_LEN + 1
    big_m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_R], tl.float32)
    big_o = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(first_key // SPLIT_LEN, num_splits):
        part = (pid * num_heads + heads) * max_splits + s
        o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_rd,
                    other=0.0)
        lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
        big_m, big_l, big_o = _fold(big_m, big_l, big_o, o, lse)
    _store_out(out_ptr, big_l, big_o, out_mul, q_row + offs_r * 0, heads, offs_d, mask_rd,
               stride_ot, stride_oh)


def block_rows(group: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_T): rows of a program's tiles (at least 16, the smallest MMA tile), and
    the query tokens of an extend block that fill them."""
    rows = max(16, triton.next_power_of_2(group))
    return rows, rows // group


def block_n_for(head_dim: int, dtype_size: int) -> int:
    """Key tile: 128 like the default decode kernel, 32 for fp32 or wide heads (shared
    memory); SPLIT is a multiple of both."""
    return 32 if dtype_size > 2 or head_dim > 128 else 128


def decode_workers(num_decode: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> int:
    """Programs per decode sequence and KV head: about four programs per SM, no more than the
    longest context has splits. 1 means no partials and no merge kernel."""
    programs = max(num_decode * num_kv_heads, 1)
    want = triton.cdiv(4 * num_sms, programs)
    return max(1, min(want, triton.cdiv(max(max_kv_len, 1), SPLIT)))


def _meta(q: torch.Tensor, k_cache: torch.Tensor) -> dict[str, int]:
    """The constexprs decode and extend share: the same tiles for both."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[1]
    rows, tokens = block_rows(group)
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_R=rows, BLOCK_T=tokens,
                BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
                BLOCK_N=block_n_for(head_dim, q.element_size()), SPLIT_LEN=SPLIT,
                BLOCK_TOKENS=BLOCK_TOKENS)




def invariant_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, slot_table: torch.Tensor, kv_lens: torch.Tensor,
                     seq_rows: torch.Tensor, q_rows: torch.Tensor, scale: float, workers: int,
                     max_splits: int, window: int | None = None, softcap: float | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One query per decode sequence i: batch row seq_rows[i], token row q_rows[i] (the
    arguments of triton_attention.decode_attention). workers > 1 spreads each sequence's
    splits over that many programs through a [num_decode, H, max_splits, D] float32
    workspace (max_splits >= the longest context's splits)."""
    num_decode = seq_rows.shape[0]
    if num_decode == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    meta = _meta(q, k_cache)
    score_mul, cap_mul = _score_factors(scale * k_scale, softcap)
    partials = workers > 1
    if partials:
        part_o = torch.empty(num_decode, num_heads, max_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(num_decode, num_heads, max_splits, dtype=torch.float32,
                               device=q.device)
    else:
        part_o = part_lse = out  # never touched
    win = window or NO_WINDOW
    num_kv_heads = k_cache.shape[1]
    invariant_attention_kernel[(num_decode, num_kv_heads, workers)](
        q, k_cache, v_cache, out, part_o, part_lse, slot_table,
        seq_rows, seq_rows, q_rows, q_rows, kv_lens,
        score_mul, cap_mul, v_scale, win, num_heads, max_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), slot_table.stride(0),
        out.stride(0), out.stride(1), DECODE=True, PARTIALS=partials,
        WINDOWED=window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=3, **meta, **pdl_options(q.device))
    if partials:
        invariant_merge_kernel[(num_decode, num_kv_heads)](
            part_o, part_lse, out, seq_rows, q_rows, kv_lens, v_scale, win, num_heads,
            max_splits, out.stride(0), out.stride(1), GROUP=meta["GROUP"],
            HEAD_DIM=head_dim, BLOCK_R=meta["BLOCK_R"], BLOCK_D=meta["BLOCK_D"],
            SPLIT_LEN=SPLIT, WINDOWED=window is not None, num_warps=4,
            **pdl_options(q.device))


def invariant_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, slot_table: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, kv_lens: torch.Tensor, blocks: torch.Tensor,
                     block_m0: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """Chunks of new queries (the arguments of triton_attention.extend_attention), with the
    block table built by triton_attention.extend_blocks for BLOCK_TOKENS queries."""
    num_blocks = blocks.shape[0]
    if num_blocks == 0:
        return
    meta = _meta(q, k_cache)
    score_mul, cap_mul = _score_factors(scale * k_scale, softcap)
    invariant_attention_kernel[(num_blocks, k_cache.shape[1], 1)](
        q, k_cache, v_cache, out, out, out, slot_table,
        blocks, block_m0, q_starts, q_lens, kv_lens,
        score_mul, cap_mul, v_scale, window or NO_WINDOW, q.shape[1], 1,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), slot_table.stride(0),
        out.stride(0), out.stride(1), DECODE=False, PARTIALS=False,
        WINDOWED=window is not None, SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=3, **meta, **pdl_options(q.device))
