"""Plain-torch references that backends and kernels are tested against.

Written for clarity, not speed. Attention goes one sequence at a time with an explicit mask,
softmax in float32; the elementwise references round where the model's torch code rounds.
"""

from __future__ import annotations

import torch


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_table: torch.Tensor, q_lens: list[int], kv_lens: list[int],
                              scale: float, sliding_window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """Causal attention of a ragged batch over a paged KV cache.

    q: [T, H, D] with the sequences' new tokens back to back; k_cache/v_cache: [slots, Hkv, D]
    already holding every sequence's keys (new tokens included); slot_table[i, p] is the slot
    of position p of sequence i. Query j of sequence i is at position kv_len - q_len + j and
    sees positions 0 .. kv_len - q_len + j (only the last `sliding_window` of them, if set).
    With `softcap`, scores become softcap * tanh(scores / softcap). Returns [T, H, D].
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        slots = slot_table[i, :kv_len]
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        queries = q[start:start + q_len].float()  # [q, H, D]
        scores = torch.einsum("qhd,lhd->hql", queries, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # query j sits at position kv_len - q_len + j and sees keys up to there
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q, L]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + q_len] = torch.einsum("hql,lhd->qhd", weights, values).to(q.dtype)
        start += q_len
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The model's RMSNorm (normalise in float32, round, then scale by the weight); with a
    residual, normalise x + residual and also return that sum."""
    summed = x if residual is None else x + residual
    var = summed.float().pow(2).mean(-1, keepdim=True)
    normed = (summed.float() * torch.rsqrt(var + eps)).to(x.dtype)
    out = weight * normed
    return out if residual is None else (out, summed)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] laid out [gate | up] -> silu(gate) * up, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x ([T, heads, D]) by cos/sin ([T, D/2]), in x's dtype: element d
    pairs with d + D/2."""
    cos = cos.reshape(x.shape[0], 1, -1).to(x.dtype)
    sin = sin.reshape(x.shape[0], 1, -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def dequantize_int_reference(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                             group_size: int, bits: int) -> torch.Tensor:
    """Our runtime INT layout (qweight [K / pack, N] int32 packed along K, low bits first;
    scales/zeros [G, N]) -> W [K, N] in the scales' dtype, element by element:
    W[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n]."""
    pack = 32 // bits
    k = torch.arange(qweight.shape[0] * pack, device=qweight.device)
    word = qweight[k // pack]  # [K, N]
    q = (word >> ((k % pack) * bits)[:, None]) & ((1 << bits) - 1)
    group = k // group_size
    return (q - zeros[group].to(torch.int32)).to(scales.dtype) * scales[group]


def w4a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """x [M, K] @ the dequantized weight, accumulated in float32, rounded to x's dtype."""
    w = dequantize_int_reference(qweight, scales, zeros, group_size, bits)
    return (x.float() @ w.to(x.dtype).float()).to(x.dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor) -> torch.Tensor:
    """W8A8 FP8 with dynamic per-token activation scales, in float64: x [M, K] is scaled by
    max|row| / 448 and rounded to e4m3; the e4m3 weight [N, K] carries a scale per row."""
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    scale = (x.double().abs().amax(-1, keepdim=True) / fmax).clamp(min=1e-12)
    x8 = (x.double() / scale).clamp(-fmax, fmax).to(fp8)
    out = (x8.double() * scale) @ (weight.double() * weight_scale.double()[:, None]).t()
    return out.to(x.dtype)


def lora_add_reference(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: list[int]) -> torch.Tensor:
    """out plus the update of kernels/lora.py, row by row with float32 sums:
    u = x A^T rounded to the weights' dtype, then u B (a [S, W, in], b [S, W, out])."""
    result = out.float().clone()
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            u = (x[row].float() @ a[slot].float().T).to(a.dtype).float()
            result[row] += u @ b[slot].float()
    return result.to(out.dtype)
