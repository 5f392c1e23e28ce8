"""Launchers for our Triton attention kernels over the paged KV cache.

Cache layout (one layer): k_cache / v_cache are [num_slots, num_kv_heads, head_dim]; a sequence
reaches its tokens through a slot table row ([max_len] int64, slot of each position), so the
kernels never see pages and work for any page size. Queries and outputs are the step's flat
ragged token rows [T, num_heads, head_dim]; q may be a strided view (the fused qkv output).

Nothing here reads device memory from the host: grid sizes come from host-side lengths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from radixlm.kernels.pdl import pdl_options
from radixlm.kernels.triton_decode import decode_merge_kernel, decode_split_kernel
from radixlm.kernels.triton_extend import extend_kernel

LOG2E = 1.4426950408889634


# Defaults from sweeps on an H200 (bf16, 32 q / 8 KV heads, head_dim 128; see
# benchmarks/attention_kernels.py): 128-token decode tiles with 4 warps were the flattest
# across split counts; a third pipeline stage made extend 1.3-1.7x faster and batch-256 decode
# 5% (bf16 cache) to 15% (float8) faster, and cost batch 1 nothing (2026-12-04).
@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # A float8 cache under a bfloat16 query: compute in float16 (see triton_decode).
    fp8_as_fp16: bool = True
    # A float8 V under a 16-bit query: read it as int16 pairs of head dims (see triton_decode).
    fp8_v_pairs: bool = True
    # ... and widen e4m3 pairs with the GPU's pairwise conversion rather than integer ops
    # (CUDA only: the Triton interpreter cannot run the instruction).
    fp8_v_cvt: bool = True
    # An e4m3 K under a 16-bit query with V read as pairs: multiply q.k in float8 on the tensor
    # cores (q rounded to e4m3 per head), no widening of K. Not batch-sensitive, but it changes
    # the scores (docs/quantization.md, "Float8 attention"), so it is asked for, never implied.
    fp8_qk: bool = False


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def decode_config(dtype: torch.dtype, head_dim: int) -> DecodeConfig:
    # fp32 (and wide heads) make tiles 2x the bytes: smaller ones keep the pipeline in
    # shared memory. A float8 cache keeps 128-key tiles: 64 ran 10% faster alone at batch 256
    # but 2-4% slower offline (H200, 2026-12-04; docs/performance.md).
    if dtype == torch.float32 or head_dim > 128:
        return DecodeConfig(block_n=32)
    return DecodeConfig()


def extend_config(dtype: torch.dtype, head_dim: int) -> ExtendConfig:
    if dtype == torch.float32 or head_dim > 128:
        return ExtendConfig(block_m=32, block_n=32, num_stages=2)
    return ExtendConfig()


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_kv_len: int, num_sms: int,
                      min_split_len: int = 256, max_splits: int = 64) -> int:
    """KV splits per sequence for decode: about four programs per SM (fewer left the card
    under-filled on the H200; more did not help), but no split shorter than min_split_len
    tokens, where the partials and the merge cost more than they save."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = triton.cdiv(4 * num_sms, programs)
    by_len = max(max_kv_len // min_split_len, 1)
    return max(1, min(want, by_len, max_splits))


def _dot_precision(dtype: torch.dtype) -> str:
    # tf32 would cost fp32 models their agreement with the torch backend; 16-bit ignores this.
    return "ieee" if dtype == torch.float32 else "tf32"


@cache
def _fp8_cvt_on(device_index: int) -> bool:
    return (os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device_index) >= (8, 9))


def _has_fp8_cvt(device: torch.device) -> bool:
    """Whether kernels on `device` can use the float8 conversion instructions in inline PTX
    (sm_89+; not the CPU or the Triton interpreter)."""
    return device.type == "cuda" and _fp8_cvt_on(
        device.index if device.index is not None else torch.cuda.current_device())


def _pow2(n: int, floor: int = 16) -> int:
    return max(triton.next_power_of_2(n), floor)


# The window passed when a layer has none: far longer than any context.
NO_WINDOW = 1 << 30


def _score_factors(scale: float, softcap: float | None) -> tuple[float, float]:
    """(score_mul, cap_mul) for the kernels: scores are q.k * score_mul, then, with a cap,
    tanh(.) * cap_mul; either way in base-2 log units (see triton_decode)."""
    if softcap is None:
        return scale * LOG2E, 1.0
    return scale / softcap, softcap * LOG2E


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("attention kernels need the head_dim axis to be contiguous")


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_inv_scale, v_inv_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]  # [H, D]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_inv_scale, k_cache_ptr, FP8_MAX), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_inv_scale, v_cache_ptr, FP8_MAX), mask=mask)


@triton.jit
def to_cache(x, inv_scale, cache_ptr, FP8_MAX: tl.constexpr):
    """x as the cache stores it: as is, or (FP8_MAX > 0) x / scale saturated to float8."""
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


def fp8_max(cache: torch.Tensor) -> float:
    """The float8 cache's saturation bound (the kernels' FP8_MAX), 0.0 for a float cache."""
    return float(torch.finfo(cache.dtype).max) if cache.element_size() == 1 else 0.0


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write this step's K/V ([T, Hkv, D], may be strided views) to their slots ([T]); a float8
    cache gets them divided by their scales, saturated."""
    if k.shape[0] == 0:
        return
    _check_last_dim(k, v, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=fp8_max(k_cache), num_warps=1 if num_kv_heads * head_dim <= 1024 else 4)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, slot_table: torch.Tensor, kv_lens: torch.Tensor,
                     seq_rows: torch.Tensor, q_rows: torch.Tensor, scale: float,
                     num_splits: int, config: DecodeConfig | None = None,
                     window: int | None = None, softcap: float | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """One query per sequence. Decode sequence i is batch row seq_rows[i] (its slot table row
    and kv_lens entry) and its query is token row q_rows[i] of q and out. It sees the last
    `window` keys only, if set, with scores soft-capped at `softcap`, if set.
    k_scale / v_scale: a float8 cache's scales."""
    num_decode = seq_rows.shape[0]
    if num_decode == 0:
        return
    _check_last_dim(q, k_cache, v_cache, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    cfg = config or decode_config(q.dtype, head_dim)
    block_d = _pow2(head_dim)
    direct = num_splits == 1
    if direct:  # the kernel writes out itself; the partial pointers are never read
        part_o = part_lse = out
    else:
        part_o = torch.empty(num_decode, num_heads, num_splits, head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(num_decode, num_heads, num_splits, dtype=torch.float32,
                               device=q.device)
    score_mul, cap_mul = _score_factors(scale * k_scale, softcap)
    v_pairs = (cfg.fp8_v_pairs and v_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
               and head_dim % 2 == 0 and q.dtype in (torch.bfloat16, torch.float16))
    v_e4m3 = v_cache.dtype == torch.float8_e4m3fn
    v_cvt = v_pairs and v_e4m3 and cfg.fp8_v_cvt and _has_fp8_cvt(q.device)
    fp8_qk = cfg.fp8_qk and v_pairs and k_cache.dtype == torch.float8_e4m3fn
    if v_pairs:  # integer-widened e4m3 pairs are the values * 2^-8 (see triton_decode)
        v_cache = v_cache.view(torch.int16)
        v_scale = v_scale * (256.0 if v_e4m3 and not v_cvt else 1.0)
    decode_split_kernel[(num_decode, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, slot_table, kv_lens, seq_rows, q_rows,
        score_mul, cap_mul, v_scale, window or NO_WINDOW, num_splits, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), slot_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=_pow2(group), BLOCK_D=block_d,
        BLOCK_N=cfg.block_n, DIRECT=direct, SOFTCAP=softcap is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        WIDEN_FP16=cfg.fp8_as_fp16 and k_cache.element_size() == 1 and q.dtype == torch.bfloat16,
        V_PAIRS=v_pairs, V_E4M3=v_e4m3, V_CVT=v_cvt, FP8_QK=fp8_qk, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(q.device))
    if not direct:
        block_s = triton.next_power_of_2(num_splits)
        decode_merge_kernel[(num_decode, num_heads)](
            part_o, part_lse, out, q_rows, num_splits, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s,
            # ~32 fp32 partial values per thread: no register spills at 64+ splits
            num_warps=min(max(block_s * block_d // 1024, 1), 8), **pdl_options(q.device))


def extend_blocks(q_lens: list[int], rows: list[int], block_m: int) -> tuple[list[int],
                                                                           list[int]]:
    """The extend grid's block table: (batch row, first query) of each BLOCK_M query block."""
    block_rows, block_m0 = [], []
    for row in rows:
        for m0 in range(0, q_lens[row], block_m):
            block_rows.append(row)
            block_m0.append(m0)
    return block_rows, block_m0


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, slot_table: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, kv_lens: torch.Tensor, block_rows: torch.Tensor,
                     block_m0: torch.Tensor, scale: float,
                     config: ExtendConfig | None = None, window: int | None = None,
                     softcap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> None:
    """Chunks of new queries attending to their cached prefix and, causally, to themselves
    (within `window` keys and with scores capped at `softcap`, if set). q_starts/q_lens/kv_lens
    are per batch row; block_rows/block_m0 come from extend_blocks with the same config's
    block_m. k_scale / v_scale: a float8 cache's scales."""
    num_blocks = block_rows.shape[0]
    if num_blocks == 0:
        return
    _check_last_dim(q, k_cache, v_cache, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    cfg = config or extend_config(q.dtype, head_dim)
    score_mul, cap_mul = _score_factors(scale * k_scale, softcap)
    extend_kernel[(num_blocks, num_heads)](
        q, k_cache, v_cache, out, slot_table, block_rows, block_m0, q_starts, q_lens, kv_lens,
        score_mul, cap_mul, v_scale, window or NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), slot_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_D=_pow2(head_dim), WINDOWED=window is not None,
        SOFTCAP=softcap is not None, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
