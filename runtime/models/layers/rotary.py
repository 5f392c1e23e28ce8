"""Rotary position embeddings (half-split "neox" layout, as in Hugging Face Llama)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: linear, llama3")


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
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim / 2]; kept in float32 and cast per call, like the reference.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

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
