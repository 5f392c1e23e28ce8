"""Attention in plain torch over the paged KV cache. Runs on CPU and CUDA.

Decode tokens (q_len == 1) of all sequences are attended in one padded SDPA call over their
pages (gathered page by page: whole pages are contiguous, so this copies large blocks rather
than single tokens); prefill chunks go one sequence at a time, each with its own causal
offset mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.runtime.attention.base import AttentionBackend, ForwardBatch


class TorchNativeAttention(AttentionBackend):
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def plan(self, batch: ForwardBatch) -> None:
        q_starts = [0]
        for q_len in batch.q_lens:
            q_starts.append(q_starts[-1] + q_len)
        decode = [i for i, q_len in enumerate(batch.q_lens) if q_len == 1]
        self.prefill = [i for i, q_len in enumerate(batch.q_lens) if q_len > 1]
        self.q_starts = q_starts
        self.decode_pages = None
        if decode:
            device = batch.slot_table.device
            rows = torch.tensor(decode, device=device)
            kv_lens = torch.tensor([batch.kv_lens[i] for i in decode], device=device)
            page_size = batch.kv_cache.page_size
            num_pages = -(-int(max(batch.kv_lens[i] for i in decode)) // page_size)
            width = num_pages * page_size
            self.decode_tokens = torch.tensor([q_starts[i] for i in decode], device=device)
            # A pure decode step has one token per sequence, in order: no gather needed.
            self.all_decode = len(decode) == batch.num_tokens
            first_slots = batch.slot_table[rows, : width : page_size]  # [Bd, pages]
            self.decode_pages = first_slots // page_size
            # [Bd, 1, 1, L]: True where the key position exists for that sequence
            valid = torch.arange(width, device=device)[None, :] < kv_lens[:, None]
            self.decode_mask = valid[:, None, None, :]
        # Causal offset masks depend only on (q_len, kv_len): build them once per step.
        self.prefill_masks = {}
        for i in self.prefill:
            q_len, kv_len = batch.q_lens[i], batch.kv_lens[i]
            if q_len != kv_len and (q_len, kv_len) not in self.prefill_masks:
                q_pos = torch.arange(kv_len - q_len, kv_len, device=batch.slot_table.device)
                k_pos = torch.arange(kv_len, device=batch.slot_table.device)
                self.prefill_masks[(q_len, kv_len)] = k_pos[None, :] <= q_pos[:, None]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = batch.kv_cache.layer(layer_id)
        batch.kv_cache.store(layer_id, batch.out_slots, k, v)
        out = torch.empty_like(q)
        if self.decode_pages is not None:
            k_pages, v_pages = batch.kv_cache.layer_pages(layer_id)
            bd, pages = self.decode_pages.shape
            qd = q if self.all_decode else q.index_select(0, self.decode_tokens)
            # index_select copies whole rows with memcpy: several times faster than
            # advanced indexing on CPU. [Bd * pages, page_size, Hkv, D] -> [Bd, Hkv, L, D]
            flat = self.decode_pages.flatten()
            kd = k_pages.index_select(0, flat).view(bd, -1, *k.shape[1:])
            vd = v_pages.index_select(0, flat).view(bd, -1, *v.shape[1:])
            od = _decode_attention(qd, kd, vd, self.decode_mask, self.scale)
            if self.all_decode:
                return od
            out.index_copy_(0, self.decode_tokens, od)
        for i in self.prefill:
            start, end = self.q_starts[i], self.q_starts[i + 1]
            q_len, kv_len = end - start, batch.kv_lens[i]
            slots = batch.slot_table[i, :kv_len]
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if q_len == kv_len:  # whole sequence in this chunk: keys are the new tokens
                ki, vi = k[start:end], v[start:end]
            else:
                ki, vi = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            ki = ki.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vi = vi.transpose(0, 1).unsqueeze(0)
            mask = self.prefill_masks.get((q_len, kv_len))
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                is_causal=mask is None, scale=self.scale,
                                                enable_gqa=True)
            out[start:end] = oi.squeeze(0).transpose(0, 1)
        return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, H, D], k/v [B, L, Hkv, D], valid [B, 1, 1, L]
    -> [B, H, D] in q's dtype.

    Three small batched products in float32 rather than SDPA: with one query row, the fused
    CPU kernel spends milliseconds per call on tiling it cannot use, while these read each key
    and value once. The query heads sharing a KV head (GQA) are one matrix of rows.
    """
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    q4 = q.float().view(b, kv_heads, heads // kv_heads, d)  # [B, Hkv, G, D]
    keys = k.float().permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    values = v.float().transpose(1, 2)  # [B, Hkv, L, D]
    scores = torch.matmul(q4, keys).mul_(scale)  # [B, Hkv, G, L]
    scores.masked_fill_(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).view(b, heads, d).to(q.dtype)
