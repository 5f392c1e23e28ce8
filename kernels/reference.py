"""Plain-torch references that backends and kernels are tested against.

Written for clarity, not speed: one sequence and one query at a time, softmax in float32.
"""

from __future__ import annotations

import torch


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_table: torch.Tensor, q_lens: list[int], kv_lens: list[int],
                              scale: float) -> torch.Tensor:
    """Causal attention of a ragged batch over a paged KV cache.

    q: [T, H, D] with the sequences' new tokens back to back; k_cache/v_cache: [slots, Hkv, D]
    already holding every sequence's keys (new tokens included); slot_table[i, p] is the slot
    of position p of sequence i. Query j of sequence i is at position kv_len - q_len + j and
    sees positions 0 .. kv_len - q_len + j. Returns [T, H, D].
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        slots = slot_table[i, :kv_len]
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        for j in range(q_len):
            visible = kv_len - q_len + j + 1
            scores = torch.einsum("hd,lhd->hl", q[start + j].float(), keys[:visible]) * scale
            weights = torch.softmax(scores, dim=-1)
            out[start + j] = torch.einsum("hl,lhd->hd", weights, values[:visible]).to(q.dtype)
        start += q_len
    return out
