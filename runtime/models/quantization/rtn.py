"""Group-wise integer quantization on a uniform grid, and RTN (round to nearest), the baseline.

Every INT method shares this grid. A group is `group_size` consecutive input channels of one
output row, w ~ (q - zero) * scale with q in [0, 2**bits). Asymmetric grids span
[min(w, 0), max(w, 0)]: including 0 keeps the zero point inside [0, 2**bits) even for a group of
all-positive weights, and lets a ragged last group (K not a multiple of the group size, e.g.
SmolLM2's 576 inputs at group 128) be padded with zeros without changing its range. Symmetric
grids span [-amax, amax] with the zero point in the middle.

Scales are rounded to the dtype the checkpoint stores them in *before* rounding the weights, so
the integers are the nearest for the scale a reader will actually use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class GroupQuantized(NamedTuple):
    """A [N, K] weight as integers and per-group grid parameters (G = ceil(K / group))."""
    q: torch.Tensor  # [N, K] int32 in [0, 2**bits)
    scales: torch.Tensor  # [N, G] in the stored dtype
    zeros: torch.Tensor  # [N, G] int32


def grid_params(w: torch.Tensor, bits: int, sym: bool,
                scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of groups: w [..., g] -> ([...] float32 scales rounded
    through scale_dtype, [...] int32 zero points)."""
    maxq = 2 ** bits - 1
    w = w.float()
    if sym:
        scale = 2 * w.abs().amax(-1) / maxq
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = (hi - lo) / maxq
    # A floor that float16 can hold: an all-zero group gets q == zero everywhere.
    scale = scale.clamp(min=1e-5).to(scale_dtype).float()
    if not sym:
        zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero.to(torch.int32)


def quantize_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     bits: int) -> torch.Tensor:
    """w [..., g] on the grid of scale/zero [...] -> int32 q in [0, 2**bits)."""
    q = torch.round(w.float() / scale.unsqueeze(-1)) + zero.unsqueeze(-1)
    return q.clamp(0, 2 ** bits - 1).to(torch.int32)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group], the ragged last group padded with zeros (see module doc)."""
    rows, cols = w.shape
    groups = -(-cols // group_size)
    if groups * group_size != cols:
        w = torch.nn.functional.pad(w, (0, groups * group_size - cols))
    return w.reshape(rows, groups, group_size)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False,
                 scale_dtype: torch.dtype = torch.float16) -> GroupQuantized:
    """Round a [N, K] weight to the nearest point of its groups' min/max grid."""
    cols = w.shape[1]
    group_size = cols if group_size <= 0 else group_size
    grouped = _grouped(w.float(), group_size)
    scale, zero = grid_params(grouped, bits, sym, scale_dtype)
    q = quantize_to_grid(grouped, scale, zero, bits).reshape(w.shape[0], -1)[:, :cols]
    return GroupQuantized(q, scale.to(scale_dtype), zero)


def dequantize_groups(quantized: GroupQuantized, group_size: int,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """GroupQuantized -> the [N, K] float32 weight it stands for. g_idx [K]: the group of each
    input column when groups are not runs of consecutive columns (GPTQ act-order)."""
    q, scales, zeros = quantized
    cols = q.shape[1]
    group_size = cols if group_size <= 0 else group_size
    index = (torch.arange(cols, device=q.device) // group_size if g_idx is None
             else g_idx.long())
    return (q - zeros[:, index]).float() * scales[:, index].float()


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool = False,
                  scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """RTN quantize then dequantize: the float weight a quantized model will compute with."""
    return dequantize_groups(rtn_quantize(w, bits, group_size, sym, scale_dtype), group_size)
