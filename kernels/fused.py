"""Fused elementwise kernels in Triton: RMSNorm (+ residual add), SiLU-and-mul, rotary (+ the
K/V cache store).

Each one reproduces the model's torch code rounding for rounding (see the references in
radixlm.kernels.reference): math in float32, rounded to the activation dtype exactly where the
torch ops round, so a fused model stays within an ulp of the unfused one (silu_and_mul was
bit-exact on an H200; RMSNorm differs in ~3e-6 of outputs, by the order of its sum) while
reading each activation once instead of once per op.

The Llama model uses them on CUDA (runtime/models/llama.py, `use_fused_kernels`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.pdl import pdl_options, pdl_prologue
from radixlm.kernels.triton_attention import fp8_max, to_cache


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, hidden,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # the model adds in the activation dtype: round the sum before normalising it
        x = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last axis of x ([N, hidden]). With a residual, first x + residual, and
    return (normed, x + residual): the sum is the next layer's residual stream."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs the hidden axis to be contiguous")
    rows, hidden = x.reshape(-1, x.shape[-1]).shape
    x2 = x.reshape(rows, hidden)
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res2 = residual.reshape(rows, hidden) if residual is not None else x2
    res_out = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out, res_out, eps, hidden,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16), **pdl_options(x.device))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2 * I] laid out [gate | up] (the merged gate_up projection) -> silu(gate) * up."""
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs the last axis to be contiguous")
    x2 = x.reshape(-1, x.shape[-1])
    rows, inter = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4,
            **pdl_options(x.device))
    return out.view(*x.shape[:-1], inter)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads,
                   stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
                   v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_q_heads, k_inv_scale,
                   v_inv_scale, stride_vt, stride_vh, stride_cs, stride_ch,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   STORE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr,
                   FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    token = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    # neox layout: element d pairs with d + D/2; [BLOCK_H, BLOCK_HALF] offsets of the low half
    x_lo = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * stride_st + offs_d, mask=offs_d < HALF, other=0.0)
    dt = out_ptr.dtype.element_ty
    # the model casts the tables to the activation dtype and rounds after every op
    cos = cos.to(dt).to(tl.float32)[None, :]
    sin = sin.to(dt).to(tl.float32)[None, :]
    lo = ((x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    hi = ((x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    o_lo = out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_lo, lo, mask=mask)
    tl.store(o_lo + HALF, hi, mask=mask)
    if STORE:  # heads from num_q_heads on are the keys: into the KV cache too, with V
        slot = tl.load(slots_ptr + token)
        is_key = mask & (offs_h >= num_q_heads)[:, None]
        k_dst = (k_cache_ptr + slot * stride_cs + (offs_h - num_q_heads)[:, None] * stride_ch
                 + offs_d[None, :])
        tl.store(k_dst, to_cache(lo, k_inv_scale, k_cache_ptr, FP8_MAX), mask=is_key)
        tl.store(k_dst + HALF, to_cache(hi, k_inv_scale, k_cache_ptr, FP8_MAX), mask=is_key)
        offs_kv = tl.arange(0, BLOCK_KV)
        offs_full = tl.arange(0, 2 * BLOCK_HALF)
        mask_v = (offs_kv < NUM_KV_HEADS)[:, None] & (offs_full < 2 * HALF)[None, :]
        v = tl.load(v_ptr + token * stride_vt + offs_kv[:, None] * stride_vh
                    + offs_full[None, :], mask=mask_v)
        v_dst = (v_cache_ptr + slot * stride_cs + offs_kv[:, None] * stride_ch
                 + offs_full[None, :])
        tl.store(v_dst, to_cache(v, v_inv_scale, v_cache_ptr, FP8_MAX), mask=mask_v)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate x ([T, heads, D], may be a strided view) by cos/sin ([T, D/2] or [T, 1, D/2],
    any float dtype). out=x rotates in place (each program reads its rows before writing)."""
    return _rotary(x, cos, sin, out)


def rotary_and_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_q_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Rotate q and k in place (qk: [T, Hq + Hkv, D], the queries' heads first) and write the
    rotated k and v ([T, Hkv, D]) to their slots of one layer's cache ([slots, Hkv, D]), in one
    launch: what rotary_embedding(qk, out=qk) then store_kv would do (a float8 cache gets the
    same saturated x / scale). The attention backend is then told the K/V are stored."""
    if v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("rotary_and_store needs the head_dim axes to be contiguous")
    num_kv_heads = v.shape[1]
    _rotary(qk, cos, sin, qk, store=dict(
        v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slots_ptr=slots,
        num_q_heads=num_q_heads, k_inv_scale=1.0 / k_scale, v_inv_scale=1.0 / v_scale,
        stride_vt=v.stride(0), stride_vh=v.stride(1), stride_cs=k_cache.stride(0),
        stride_ch=k_cache.stride(1), STORE=True, NUM_KV_HEADS=num_kv_heads,
        BLOCK_KV=triton.next_power_of_2(num_kv_heads), FP8_MAX=fp8_max(k_cache)))


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None,
            store: dict | None = None) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    cos2, sin2 = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
    if x.stride(-1) != 1 or cos2.stride(-1) != 1 or sin2.stride(-1) != 1:
        raise ValueError("rotary_embedding needs the head_dim axis to be contiguous")
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if store is None:  # no cache: the store arguments are never read
        store = dict(v_ptr=x, k_cache_ptr=x, v_cache_ptr=x, slots_ptr=x, num_q_heads=0,
                     k_inv_scale=1.0, v_inv_scale=1.0, stride_vt=0, stride_vh=0, stride_cs=0,
                     stride_ch=0, STORE=False, NUM_KV_HEADS=1, BLOCK_KV=1, FP8_MAX=0.0)
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, cos2, sin2, out, num_heads, x.stride(0), x.stride(1), cos2.stride(0),
            sin2.stride(0), out.stride(0), out.stride(1), **store, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_HALF=triton.next_power_of_2(half),
            # With fusion on, the compiler turns round(x1 * cos) - round(x2 * sin) into one
            # bf16 fma, skipping a rounding the torch ops do (1 ulp off in ~1/4 of outputs).
            num_warps=4, enable_fp_fusion=False, **pdl_options(x.device))
    return out
