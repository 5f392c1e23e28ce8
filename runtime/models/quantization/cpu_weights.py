"""What a quantized linear runs on the CPU: int4 planes through torch's CPU int4 kernel, or a
dense bfloat16 weight.

torch's CPU kernels for packed weights (`_weight_int4pack_mm_for_cpu`) are fast with bfloat16
activations and read 0.5 bytes per weight plus a (scale, zero) pair per group, so every integer
format is run through them: 4-bit codes as one plane, 5- to 8-bit codes as two (hi and lo
nibbles; see gguf_blocks), the plane sum being W = sum_p (q_p - 8) * scale_p + zero_p per group
of 32-256 inputs. FP8 has no fast CPU matmul (`_scaled_mm` on CPU takes milliseconds per
linear): it runs as bfloat16 weights, half the bytes of float32. Activations are cast to
bfloat16 for the matmul and back to the model's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes the int4 kernel takes
# The int4 kernel's time grows with every row (it unpacks the weights for each), while a
# bfloat16 GEMM reuses them: from this many rows on, a layer with a bfloat16 copy uses it.
DENSE_ROWS = 8


class Plane(NamedTuple):
    """One 4-bit plane: codes [N, K] uint8 in [0, 15]; scale and zero [N, K / group] float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def kernel_group(group_size: int, in_features: int) -> int | None:
    """The largest group the kernel takes that tiles both the format's groups and the input
    (scales are then repeated); None when there is none."""
    return next((g for g in KERNEL_GROUPS if group_size % g == 0 and in_features % g == 0),
                None)


def dequantize_planes(planes: list[Plane]) -> torch.Tensor:
    """The float32 [N, K] matrix the planes stand for."""
    total = None
    for codes, scale, zero in planes:
        group = codes.shape[1] // scale.shape[1]
        w = ((codes.float() - 8).unflatten(1, (-1, group)) * scale[..., None]
             + zero[..., None]).flatten(1)
        total = w if total is None else total + w
    return total


def empty_plane(rows: int, columns: int, group: int) -> Plane:
    """A plane that adds nothing: codes 8 (the kernel's zero point), scale and zero 0."""
    groups = (rows, columns // group)
    return Plane(torch.full((rows, columns), 8, dtype=torch.uint8), torch.zeros(groups),
                 torch.zeros(groups))


def integer_planes(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
                   ) -> list[Plane]:
    """Planes for W = (codes - zero_point) * scale, with codes [N, K] of up to 8 bits and
    per-group scale / zero_point [N, K / group]: one plane when the codes fit in 4 bits, else
    two (codes = 16 hi + lo: W = 16 s (hi - 8) + s (lo - 8) + (136 - z) s)."""
    if int(codes.max()) <= 15:
        return [Plane(codes.to(torch.uint8), scale, (8 - zero_point) * scale)]
    return [Plane((codes >> 4).to(torch.uint8), 16 * scale, (136 - zero_point) * scale),
            Plane((codes & 15).to(torch.uint8), scale, torch.zeros_like(scale))]


class CpuWeights(nn.Module):
    """y = x @ W.T on the CPU for W as int4 planes (`from_planes`) or dense bfloat16
    (`dense`), with an optional input permutation (GPTQ act-order: x[..., perm])."""

    def __init__(self, planes: list[Plane] | None = None, dense: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_planes = len(planes or [])
        self.group = 0
        self.register_buffer("perm", perm)
        self.register_buffer("dense", None if dense is None else dense.to(torch.bfloat16))
        self.register_buffer("batch_dense", None)  # add_batch_copy
        for index, (codes, scale, zero) in enumerate(planes or []):
            self.group = codes.shape[1] // scale.shape[1]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), 1)
            scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16)
            self.register_buffer(f"qweight{index}", packed)
            self.register_buffer(f"scales_zeros{index}", scales_zeros.contiguous())
        self._pairs = [(getattr(self, f"qweight{i}"), getattr(self, f"scales_zeros{i}"))
                       for i in range(self.num_planes)]

    @staticmethod
    def stack(parts: list[list[Plane]], rows: list[int], columns: int) -> "CpuWeights":
        """Planes of several parts stacked along the rows (a merged layer's parts); a part
        with fewer planes gets planes that add nothing. All parts share one group size."""
        count = max(len(planes) for planes in parts)
        group = columns // parts[0][0].scale.shape[1]
        return CpuWeights([
            Plane(*(torch.cat(t) for t in zip(*(
                planes[index] if index < len(planes) else empty_plane(n, columns, group)
                for planes, n in zip(parts, rows)))))
            for index in range(count)])

    def add_batch_copy(self) -> None:
        """Keep a bfloat16 copy of the planes' weights for steps of DENSE_ROWS rows or more
        (2 bytes per weight more memory; see `batch_copies_fit`). Built by multiplying the
        identity through the kernel, so it is the planes' weights rounded to bfloat16."""
        if self.num_planes == 0 or self.batch_dense is not None:
            return
        k = self._pairs[0][0].shape[1] * 2
        eye = torch.eye(k, dtype=torch.bfloat16)
        w_t = torch.cat([self._planes_matmul(eye[i:i + 256]) for i in range(0, k, 256)])
        self.batch_dense = w_t.t().contiguous()  # [N, K]

    def kernel_form(self, batched: bool = False) -> tuple[int, int, list[torch.Tensor]] | None:
        """(planes, group, tensors) as the C++ decode kernel reads them: 0 planes and the
        dense weight (`batched`: the batch copy, if any), or the (packed, scales_zeros)
        pairs; None with a permutation."""
        if self.perm is not None:
            return None
        if self.dense is not None:
            return 0, 0, [self.dense]
        if batched and self.batch_dense is not None:
            return 0, 0, [self.batch_dense]
        return self.num_planes, self.group, [t for pair in self._pairs for t in pair]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.dense is not None:
            out = F.linear(x2, self.dense)
        elif self.batch_dense is not None and x2.shape[0] >= DENSE_ROWS:
            out = F.linear(x2, self.batch_dense)
        else:
            out = self._planes_matmul(x2)
        return out.view(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    def _planes_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        (first, first_sz), *rest = self._pairs
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, first, self.group, first_sz)
        for packed, scales_zeros in rest:
            out += torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.group,
                                                              scales_zeros)
        return out


def batch_copies_fit(model: nn.Module) -> bool:
    """Whether bfloat16 copies of every int4-plane linear (for batched steps) fit in an
    eighth of this machine's memory: small models, whose batched steps are compute-bound,
    get them; a large model keeps its packed weights only."""
    import os

    extra = sum(2 * m.qweight0.numel() * 2 for m in model.modules()
                if isinstance(m, CpuWeights) and m.num_planes)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return extra <= memory // 8
