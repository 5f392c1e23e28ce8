"""What a quantized linear runs on the CPU: our batch-invariant kernel over tiles of int4
planes or of dense bfloat16 weights (kernels/cpu_linear.h), or, where that kernel cannot be
built (no C++ compiler), torch's CPU int4 kernel.

Integer formats are held as planes: 4-bit codes as one plane, 5- to 8-bit codes as two (the
low nibble, and the bits above it; see gguf_blocks), the plane sum being W = sum_p (q_p - 8) *
scale_p + zero_p per group of 16-256 inputs. Our kernel stores a high plane in the bits its
codes need (1 for 5-bit formats, 2 for 6-bit) and derives its scales (16 times the low
plane's) and a symmetric format's zeros (a factor per channel times the scales): the bytes a
step reads shrink, the sums do not change.

FP8 has no fast CPU matmul (`_scaled_mm` on CPU takes milliseconds per linear): it runs as
bfloat16 weights, half the bytes of float32. Activations are cast to bfloat16 for the matmul
and back to the model's dtype.

Our kernel computes each output with one fixed sequence of float32 multiply-adds whatever the
number of rows (docs/deterministic.md), and is ~2x faster than torch's int4 kernel at one row
(which also unpacks the weights again for every row). torch's kernel is the fallback: it
keeps the planes' scales in bfloat16 and its batched steps are slow.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import cpu_decode as cpu_kernel

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes torch's int4 kernel takes
LANES = 16  # output channels per tile of our kernel
# Where input k0 + m of a run of 8 goes in a tile's 32-bit code word: even inputs in the low
# half, odd ones in the high half (pairs for the bfloat16 dot-product instruction).
_NIBBLE_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)


class Plane(NamedTuple):
    """One 4-bit plane: codes [N, K] uint8 in [0, 15]; scale and zero [N, K / group] float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


def kernel_group(group_size: int, in_features: int) -> int | None:
    """The largest group torch's kernel takes that tiles both the format's groups and the
    input (scales are then repeated); None when there is none."""
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


def regrouped(plane: Plane, group: int) -> Plane:
    """The same weights with a scale and zero per `group` inputs (a divisor of its own)."""
    repeat = plane.codes.shape[1] // plane.scale.shape[1] // group
    if repeat == 1:
        return plane
    return Plane(plane.codes, plane.scale.repeat_interleave(repeat, dim=1),
                 plane.zero.repeat_interleave(repeat, dim=1))


def tile_planes(planes: list[Plane], compact: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our kernel's form of one or two planes (kernels/cpu_linear.h). The last plane is the
    kernel's low plane: codes int32 [tiles, 1, K / 8, 16]. With two, the first (the files'
    high codes, summed first) is its high plane, in as few bits as its codes need (1 for
    5-bit formats, 2 for 6-bit, else 4; `compact=False`: always 4). Scales [tiles, K / group,
    S, 16]: the low plane's, then the high one's (S = 2), or the low one's alone (S = 1) when
    the high plane's are 16 times them (every format's split of its codes; the kernel then
    derives them); float16 when every one is a float16 (the files' own scales, but
    K-quants'), else float32; zeros float32 [tiles, K / group, 16] (the planes' zeros
    summed), or [tiles, 16] when each channel's zeros are one factor times its low scales
    (symmetric formats: Q8_0's are 8 s, Q5_0's 120 s; `compact=False`: never). Channels
    past N (up to a whole tile) have scale and zero 0."""
    rows, columns = planes[0].codes.shape
    tiles = -(-rows // LANES)
    pad = tiles * LANES - rows
    *high, low = planes
    zero = sum(plane.zero.float() for plane in planes)
    factor = _zero_factor(zero, low.scale.float()) if compact else None
    zeros = (_lanes_last(zero, pad, tiles) if factor is None
             else F.pad(factor, (0, pad)).view(tiles, LANES))
    scales = [_lanes_last(low.scale, pad, tiles)]
    hi = torch.empty(0, dtype=torch.int32)
    if high:
        bits, first = 4, high[0]
        if compact:
            top = int(first.codes.max())
            fits = [b for b in (1, 2) if top < 1 << b and columns * b % 32 == 0]
            bits = fits[0] if fits else 4
        if not (compact and torch.equal(first.scale, 16 * low.scale)):
            scales.append(_lanes_last(first.scale, pad, tiles))
        hi = _words(first.codes, pad, tiles, bits)
    scales = torch.stack(scales, 2).contiguous()
    if compact and torch.equal(scales.half().float(), scales):
        scales = scales.half()  # the files' own float16 scales: half the bytes, same values
    return (_words(low.codes, pad, tiles, 4).unsqueeze(1).contiguous(), hi.contiguous(),
            scales, zeros.contiguous())


def _zero_factor(zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """f [N] with zero == f[:, None] * scale exactly (as float32 products: what the kernel
    computes), or None when some channel's zeros are not one factor times its scales."""
    nonzero = scale != 0
    first = nonzero.int().argmax(dim=1, keepdim=True)  # a group with a scale, where any is
    factor = (zero.gather(1, first) / scale.gather(1, first)).squeeze(1)
    factor = torch.where(nonzero.any(dim=1), factor, torch.zeros_like(factor))
    return factor if torch.equal(factor[:, None] * scale, zero) else None


def _words(codes: torch.Tensor, pad: int, tiles: int, bits: int) -> torch.Tensor:
    """[N, K] codes as a plane's int32 words [tiles, K bits / 32, 16] (cpu_linear.h): 4 bits
    in the nibble layout of pairs, 1 or 2 bits in input order. Packed a block of tiles at a
    time: the int64 intermediates of a whole large-vocabulary head would take several times
    the model's size in memory."""
    columns = codes.shape[1]
    per_word = 32 // bits
    if bits == 4:
        shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int64)
    else:
        shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    out = torch.empty(tiles, columns // per_word, LANES, dtype=torch.int32)
    for first in range(0, tiles, _PACK_TILES):
        last = min(tiles, first + _PACK_TILES)
        c = codes[first * LANES:last * LANES].to(torch.int64)
        c = F.pad(c, (0, 0, 0, (last - first) * LANES - c.shape[0]),
                  value=8 if bits == 4 else 0)
        words = (c.view(last - first, LANES, columns // per_word, per_word) << shifts).sum(-1)
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        out[first:last] = words.transpose(1, 2)
    return out


_PACK_TILES = 256  # tiles (of 16 channels) packed at a time by _words


def tile_dense(weight: torch.Tensor) -> torch.Tensor:
    """Our kernel's form of a dense [N, K] weight: bfloat16 [tiles, K / 2, 32], lane j holding
    channel j's weights of inputs k and k + 1; float32 [tiles, K, 16]."""
    rows, columns = weight.shape
    tiles = -(-rows // LANES)
    w = F.pad(weight, (0, 0, 0, tiles * LANES - rows))
    if w.dtype == torch.float32:
        return w.view(tiles, LANES, columns).transpose(1, 2).contiguous()
    return (w.to(torch.bfloat16).view(tiles, LANES, columns // 2, 2).transpose(1, 2)
            .reshape(tiles, columns // 2, 2 * LANES).contiguous())


def _lanes_last(per_group: torch.Tensor, pad: int, tiles: int) -> torch.Tensor:
    """[N, G] -> [tiles, G, 16] float32, padded channels 0."""
    padded = F.pad(per_group.float(), (0, 0, 0, pad))
    return padded.view(tiles, LANES, -1).transpose(1, 2)


def linear_kernel() -> ModuleType | None:
    """Our compiled CPU kernels (built on first use), or None where they cannot be built."""
    return cpu_kernel.load()


class CpuWeights(nn.Module):
    """y = x @ W.T on the CPU for W as int4 planes or dense bfloat16 (`dense`; float32 with
    `float32=True`: then the activations stay float32), with an optional input permutation
    (GPTQ act-order: x[..., perm]). Held in our kernel's tiles where it builds (`tiled`), else
    in torch's layouts."""

    def __init__(self, planes: list[Plane] | None = None, dense: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None, float32: bool = False) -> None:
        super().__init__()
        self.kernel = linear_kernel()
        self.tiled = self.kernel is not None
        if planes and not self.tiled:
            group = planes[0].codes.shape[1] // planes[0].scale.shape[1]
            if kernel_group(group, planes[0].codes.shape[1]) != group:
                # torch's int4 kernel takes groups of 32 to 256 inputs only (not Q6_K's 16)
                planes, dense = None, dequantize_planes(planes)
        self.num_planes = len(planes or [])
        self.out_features = (planes[0].codes if planes else dense).shape[0]
        self.group = 0
        self.activations = torch.float32 if float32 else torch.bfloat16
        self.register_buffer("perm", perm)
        if dense is not None:
            dense = dense.to(self.activations)
            self.register_buffer("dense", tile_dense(dense) if self.tiled else dense)
            self._tensors = [self.dense]
            return
        self.dense = None
        self.group = planes[0].codes.shape[1] // planes[0].scale.shape[1]
        if self.tiled:
            for name, tensor in zip(("codes", "hi", "scales", "zeros"), tile_planes(planes)):
                self.register_buffer(name, tensor)
            self._tensors = [self.codes, self.hi, self.scales, self.zeros]
            return
        for index, (codes, scale, zero) in enumerate(planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), 1)
            scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16)
            self.register_buffer(f"qweight{index}", packed)
            self.register_buffer(f"scales_zeros{index}", scales_zeros.contiguous())
        self._tensors = [getattr(self, f"{name}{i}") for i in range(self.num_planes)
                         for name in ("qweight", "scales_zeros")]

    @staticmethod
    def stack(parts: list[list[Plane]], rows: list[int], columns: int) -> "CpuWeights":
        """Planes of several parts stacked along the rows (a merged layer's parts); a part
        with fewer planes gets planes that add nothing, and parts with coarser groups than
        the finest (Q4_K's 32 beside Q6_K's 16) repeat their scales over its groups."""
        count = max(len(planes) for planes in parts)
        group = min(columns // planes[0].scale.shape[1] for planes in parts)
        parts = [[regrouped(plane, group) for plane in planes] for planes in parts]
        return CpuWeights([
            Plane(*(torch.cat(t) for t in zip(*(
                planes[index] if index < len(planes) else empty_plane(n, columns, group)
                for planes, n in zip(parts, rows)))))
            for index in range(count)])

    def kernel_form(self) -> tuple[int, int, list[torch.Tensor]] | None:
        """(planes, N, tensors) as the C++ forward kernel reads a tiled linear: 0 planes and
        the dense tiles, or the planes' (codes, hi, scales, zeros); None without tiles or with a
        permutation."""
        if not self.tiled or self.perm is not None:
            return None
        return self.num_planes, self.out_features, self._tensors

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype, or float32 with `float_out` (logits: our
        kernel then does not round them to bfloat16)."""
        x2 = x.reshape(-1, x.shape[-1]).to(self.activations)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.tiled and self.dense is not None:
            out = self.kernel.dense_linear(x2, self.dense, self.out_features, float_out)
        elif self.tiled:
            out = self.kernel.planes_linear(x2, self.codes, self.hi, self.scales, self.zeros,
                                            self.out_features, float_out)
        elif self.dense is not None:
            out = F.linear(x2, self.dense)
        else:
            out = self._int4_matmul(x2)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out.float() if float_out else out.to(x.dtype)

    def _int4_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        pairs = list(zip(self._tensors[::2], self._tensors[1::2]))
        (first, first_sz), *rest = pairs
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, first, self.group, first_sz)
        for packed, scales_zeros in rest:
            out += torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.group,
                                                              scales_zeros)
        return out
