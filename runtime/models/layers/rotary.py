"""Rotary position embeddings (half-split "neox" layout, as in Hugging Face Llama).

Scalings: linear, llama3 (Llama 3.1) and longrope (Phi-3's "su"). LongRoPE has two sets of
per-frequency factors: the short set for contexts within the pretraining length and the long
set beyond it. Hugging Face switches sets per forward by the longest position in it, which
re-rotates nothing already cached; we pick one set for the whole engine from the longest
sequence it serves (max_positions): the long set as soon as that exceeds the pretraining
length. Every key and query then share one rotation, whatever the batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                             max_positions: int | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if kind in ("longrope", "su"):
        long = max_positions is not None and max_positions > scaling[
            "original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                               dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"longrope: {factors.numel()} factors for {inv_freq.numel()} "
                             f"frequencies (partial rotary is not supported)")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3, "
                     f"longrope")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by (LongRoPE keeps attention entropy in check on
    long contexts): the config's, or sqrt(1 + ln(s) / ln(original length)) for the extension
    ratio s = max_position_embeddings / original length."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_frequencies(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low frequencies by `factor`, and blends the
    # band between the two wavelength thresholds linearly in 1/wavelength.
    factor, original = s["factor"], s["original_max_position_embeddings"]
    low_wavelen = original / s["low_freq_factor"]
    high_wavelen = original / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - s["low_freq_factor"]) / (
        s["high_freq_factor"] - s["low_freq_factor"])
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, out)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling, max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        factor = rope_attention_factor(scaling)
        # [max_positions, head_dim / 2]; kept in float32 and cast per call, like the reference.
        self.register_buffer("cos", angles.cos() * factor, persistent=False)
        self.register_buffer("sin", angles.sin() * factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] tables for this step's positions; computed once, used by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by the angles in cos/sin ([T, 1, D/2]), in x's dtype (as the
    reference models do)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
