"""Attention in plain torch over the paged KV cache. Runs on CPU and CUDA.

Decode tokens (q_len == 1) of all sequences are attended in one padded SDPA call over their
pages (gathered page by page: whole pages are contiguous, so this copies large blocks rather
than single tokens); prefill chunks go one sequence at a time, each with its own causal
offset mask.

A layer with a sliding window gets masks that also hide keys older than its window (built once
per step and window); a layer with soft-capped scores goes through `_capped_attention`, which
computes the scores itself since SDPA cannot cap them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.runtime.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    ForwardBatch,
    LayerAttention,
)


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
            self.decode_kv_lens = kv_lens
        # Causal offset masks depend only on (q_len, kv_len) (and a layer's window): build
        # them once per step, windowed ones on first use.
        self.prefill_masks: dict[tuple[int, int, int | None], torch.Tensor] = {}
        self.window_decode_masks: dict[int, torch.Tensor] = {}
        self.device = batch.slot_table.device
        for i in self.prefill:
            q_len, kv_len = batch.q_lens[i], batch.kv_lens[i]
            if q_len != kv_len:
                self._prefill_mask(q_len, kv_len, None)

    def _prefill_mask(self, q_len: int, kv_len: int, window: int | None) -> torch.Tensor:
        """[q_len, kv_len] bool: query j (at position kv_len - q_len + j) sees key p."""
        key = (q_len, kv_len, window)
        mask = self.prefill_masks.get(key)
        if mask is None:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=self.device)
            k_pos = torch.arange(kv_len, device=self.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
            self.prefill_masks[key] = mask
        return mask

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, L] bool: the keys each decode token sees (the last `window` only)."""
        if window is None:
            return self.decode_mask
        mask = self.window_decode_masks.get(window)
        if mask is None:
            width = self.decode_mask.shape[-1]
            k_pos = torch.arange(width, device=self.device)[None, :]
            recent = k_pos >= (self.decode_kv_lens - window)[:, None]  # [Bd, L]
            mask = self.decode_mask & recent[:, None, None, :]
            self.window_decode_masks[window] = mask
        return mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, layer: LayerAttention = FULL_ATTENTION,
                kv_stored: bool = False) -> torch.Tensor:
        scale = self.scale if layer.scale is None else layer.scale
        window, softcap = layer.sliding_window, layer.logit_softcap
        cache = batch.kv_cache
        k_cache, v_cache = cache.layer(layer_id)
        k_scale, v_scale = cache.scales(layer_id)
        if not kv_stored:
            cache.store(layer_id, batch.out_slots, k, v)
        out = torch.empty_like(q)
        if self.decode_pages is not None:
            k_pages, v_pages = batch.kv_cache.layer_pages(layer_id)
            bd, pages = self.decode_pages.shape
            qd = q if self.all_decode else q.index_select(0, self.decode_tokens)
            # index_select copies whole rows with memcpy: several times faster than
            # advanced indexing on CPU. [Bd * pages, page_size, Hkv, D] -> [Bd, Hkv, L, D]
            flat = self.decode_pages.flatten()
            kd = cache.dequantize(k_pages.index_select(0, flat), k_scale).view(
                bd, -1, *k.shape[1:])
            vd = cache.dequantize(v_pages.index_select(0, flat), v_scale).view(
                bd, -1, *v.shape[1:])
            mask = self._decode_mask(window)
            if softcap is None:
                od = _decode_attention(qd, kd, vd, mask, scale)
            else:  # [Bd, H, 1, D] against [Bd, Hkv, L, D]
                od = _capped_attention(qd.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2),
                                       mask, scale, softcap).squeeze(2)
            if self.all_decode:
                return od
            out.index_copy_(0, self.decode_tokens, od)
        for i in self.prefill:
            start, end = self.q_starts[i], self.q_starts[i + 1]
            q_len, kv_len = end - start, batch.kv_lens[i]
            slots = batch.slot_table[i, :kv_len]
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            # A whole sequence in this chunk attends to the new tokens as they are, unless
            # the cache rounds them: then to what later steps will read back.
            if q_len == kv_len and not cache.quantized:
                ki, vi = k[start:end], v[start:end]
            else:
                ki = cache.dequantize(k_cache.index_select(0, slots), k_scale)
                vi = cache.dequantize(v_cache.index_select(0, slots), v_scale)
            ki = ki.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vi = vi.transpose(0, 1).unsqueeze(0)
            # A whole unwindowed sequence is plain causal attention: no mask to build.
            mask = (None if q_len == kv_len and window is None
                    else self._prefill_mask(q_len, kv_len, window))
            if softcap is None:
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask,
                                                    is_causal=mask is None, scale=scale,
                                                    enable_gqa=True)
            else:
                if mask is None:
                    mask = self._prefill_mask(q_len, kv_len, None)
                oi = _capped_attention(qi, ki, vi, mask, scale, softcap)
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
    # One copy each, converted and transposed together; the products read them as they lie.
    keys = k.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    values = v.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    scores = torch.matmul(q4, keys.transpose(2, 3)).mul_(scale)  # [B, Hkv, G, L]
    scores.masked_fill_(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).view(b, heads, d).to(q.dtype)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      scale: float, softcap: float) -> torch.Tensor:
    """Attention with tanh-capped scores: q [B, H, Q, D], k/v [B, Hkv, L, D], visible
    broadcastable to [B, H, Q, L] -> [B, H, Q, D] in q's dtype. Scores and softmax in float32;
    the cap applies after the scale and before the mask, as Gemma 2 defines it."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # [B, H, L, D]
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale  # [B, H, Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).to(q.dtype)
