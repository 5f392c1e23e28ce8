"""What a quantized linear runs on the CPU: our batch-invariant kernel over tiles of int4
planes or of dense bfloat16 weights (kernels/cpu_linear.h), or, where that kernel cannot be
built (no C++ compiler), torch's CPU int4 kernel.

Integer formats are held as planes: 4-bit codes as one plane, 5- to 8-bit codes as two (the
low nibble, and the bits above it; see gguf_blocks), the plane sum being W = sum_p (q_p - 8) *
scale_p + zero_p per group of 16-256 inputs. Our kernel stores a high plane in the bits its
codes need (1 for 5-bit formats, 2 for 6-bit) and derives its scales (16 times the low
plane's) and a symmetric format's zeros (a factor per channel times the scales), and keeps
K-quants' scales and mins as the files do (a byte per sub-block times the block's float16 d,
multiplied back exactly): the bytes a step reads shrink, the sums do not change.

FP8 has no fast CPU matmul (`_scaled_mm` on CPU takes milliseconds per linear): it runs as
bfloat16 weights, half the bytes of float32. Activations are cast to bfloat16 for the matmul
and back to the model's dtype.

Our kernel computes each output with one fixed sequence of float32 multiply-adds whatever the
number of rows (docs/deterministic.md), and is ~2x faster than torch's int4 kernel at one row
(which also unpacks the weights again for every row). torch's kernel is the fallback: it
keeps the planes' scales in bfloat16 and its batched steps are slow.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import cpu_decode as cpu_kernel
from radixlm.runtime.models.quantization import host_memory

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes torch's int4 kernel takes
LANES = 16  # output channels per tile of our kernel


class ScaleFactors(NamedTuple):
    """A plane's scales as a K-quant file stores them: scale == codes * base per group, with
    int8 codes [N, G] (a sub-block's 6- or 8-bit scale) and a base [N, G / B] (its block's
    float16 d, as float32) shared by B consecutive groups; and, where the format has mins,
    the planes' zeros summed == f * scale - min_codes * min_base for one factor f per row
    (Q4_K: f = 8), min_codes and min_base shaped as codes and base."""

    codes: torch.Tensor
    base: torch.Tensor
    min_codes: torch.Tensor | None = None
    min_base: torch.Tensor | None = None


class Plane(NamedTuple):
    """One 4-bit plane: codes [N, K] uint8 in [0, 15]; scale and zero [N, K / group] float32;
    for the low plane of a K-quant, how the file factors its scales (our kernel then stores
    them in that form: a quarter of float32's bytes, the same values)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    factors: ScaleFactors | None = None


def kernel_group(group_size: int, in_features: int) -> int | None:
    """The largest group torch's kernel takes that tiles both the format's groups and the
    input (scales are then repeated); None when there is none."""
    return next((g for g in KERNEL_GROUPS if group_size % g == 0 and in_features % g == 0),
                None)


def dequantize_planes(planes: list[Plane]) -> torch.Tensor:
    """The float32 [N, K] matrix the planes stand for."""
    total = None
    for codes, scale, zero, _ in planes:
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


def _stacked(parts: list[list[Plane]], columns: int) -> list[Plane]:
    """Planes of several parts stacked along the rows: a part with fewer planes gets planes
    that add nothing, and parts with coarser groups than the finest (Q4_K's 32 beside Q6_K's
    16) repeat their scales over its groups. The low planes' factors stay where every part
    has them in one form."""
    count = max(len(planes) for planes in parts)
    group = min(columns // planes[0].scale.shape[1] for planes in parts)
    parts = [[regrouped(plane, group) for plane in planes]
             + [empty_plane(planes[0].codes.shape[0], columns, group)] * (count - len(planes))
             for planes in parts]
    if len(parts) == 1:
        return parts[0]
    stacked = [Plane(*(torch.cat(t) for t in zip(*(planes[index][:3] for planes in parts))))
               for index in range(count)]
    factors = [planes[-1].factors for planes in parts]
    if all(f is not None for f in factors) and len(
            {(f.base.shape[1], f.min_codes is None) for f in factors}) == 1:
        stacked[-1] = stacked[-1]._replace(factors=ScaleFactors(
            *(None if t[0] is None else torch.cat(t) for t in zip(*factors))))
    return stacked


def segments_of(parts: list[list[Plane]], rows: list[int], columns: int) -> list[list[Plane]]:
    """A merged layer's parts as our kernel's segments: runs of parts of one form (plane
    count and group) are stacked, each run a segment in its own form, where every part but
    the last is whole tiles: a Q4_K part beside a Q6_K one then reads Q4_K's bytes, not a
    6-bit form's. Otherwise all parts are one stack (`_stacked`)."""
    if any(n % LANES for n in rows[:-1]):
        return [_stacked(parts, columns)]
    runs: list[list[list[Plane]]] = []
    for planes in parts:
        form = (len(planes), planes[0].scale.shape[1])
        if runs and (len(runs[-1][0]), runs[-1][0][0].scale.shape[1]) == form:
            runs[-1].append(planes)
        else:
            runs.append([planes])
    return [_stacked(run, columns) for run in runs]


class TiledPlanes(NamedTuple):
    """Planes in our kernel's form (kernels/cpu_linear.h): one segment of planes_linear's
    tensors, in its order. Tensors a form does not use are empty."""

    codes: torch.Tensor
    hi: torch.Tensor
    scales: torch.Tensor
    scale_base: torch.Tensor
    zeros: torch.Tensor
    min_codes: torch.Tensor
    min_base: torch.Tensor


def tile_planes(planes: list[Plane], compact: bool = True, kept: bool = True) -> TiledPlanes:
    """Our kernel's form of one or two planes (kernels/cpu_linear.h). The last plane is the
    kernel's low plane: codes int32 [tiles, 1, K / 8, 16]. With two, the first (the files'
    high codes, summed first) is its high plane, in as few bits as its codes need where its
    scales are derived (1 for 5-bit formats, 2 for 6-bit: the kernel then reads each code
    whole; else 4; `compact=False`: always 4). Scales [tiles, K / group,
    S, 16]: the low plane's, then the high one's (S = 2), or the low one's alone (S = 1) when
    the high plane's are 16 times them (every format's split of its codes; the kernel then
    derives them); as the file factors them where the low plane says how (K-quants: int8
    codes and a float16 base per block), else float16 when every one is a float16 (the
    files' own scales), else float32. Zeros float32 [tiles, K / group, 16] (the planes' zeros
    summed), or [tiles, 16] when each channel's zeros are one factor times its low scales
    (symmetric formats: Q8_0's are 8 s, Q5_0's 120 s), less the K-quants' mins as int8 codes
    and a negated float16 base. `compact=False`: none of these savings. Channels past N (up
    to a whole tile) have scale and zero 0. `kept`: the tensors go where a CpuWeights keeps
    them (huge pages, host_memory); False for tiles that are copied on (a stack's part)."""
    rows, columns = planes[0].codes.shape
    empty = host_memory.empty if kept else _empty
    place = host_memory.copy_of if kept else torch.Tensor.contiguous
    tiles = -(-rows // LANES)
    pad = tiles * LANES - rows
    *high, low = planes
    hi = torch.empty(0, dtype=torch.int32)
    scales = [low.scale]
    if high:
        bits, first = 4, high[0]
        derived = compact and torch.equal(first.scale, 16 * low.scale)
        if derived:
            top = int(first.codes.max())
            fits = [b for b in (1, 2) if top < 1 << b and columns * b % 32 == 0]
            bits = fits[0] if fits else 4
        else:
            scales.append(first.scale)
        hi = _words(first.codes, pad, tiles, bits, empty)
    zero = sum(plane.zero.float() for plane in planes)
    none = torch.empty(0)
    factored = _factored(low, zero) if compact and len(scales) == 1 else None
    if factored is not None:
        factor, codes, base, min_codes, min_base = factored
        scales = _lanes_last(codes, pad, tiles, torch.int8).unsqueeze(2)
        scale_base = _lanes_last(base, pad, tiles, torch.float16)
        if min_codes is None:
            min_codes = min_base = none
        else:
            min_codes = _lanes_last(min_codes, pad, tiles, torch.int8)
            min_base = _lanes_last(-min_base, pad, tiles, torch.float16)
    else:
        factor = _zero_factor(zero, low.scale.float()) if compact else None
        scales = torch.stack([_lanes_last(s, pad, tiles) for s in scales], 2)
        if compact and torch.equal(scales.half().float(), scales):
            scales = scales.half()  # the files' own float16 scales: half the bytes, same values
        scale_base = min_codes = min_base = none
    zeros = (_lanes_last(zero, pad, tiles) if factor is None
             else F.pad(factor, (0, pad)).view(tiles, LANES))
    return TiledPlanes(_words(low.codes, pad, tiles, 4, empty).unsqueeze(1), hi,
                       *map(place, (scales, scale_base, zeros, min_codes, min_base)))


def _factored(low: Plane, zero: torch.Tensor) -> tuple | None:
    """(zero factor [N], scale codes, base, min codes, min base) where the low plane's
    factors hold exactly as our kernel computes with them, in float32: scale = code * base;
    zero = factor * scale + min code * (-min base), the last product exact (so one fused
    multiply-add rounds as the subtraction does); None where they do not (or are not given)."""
    f = low.factors
    if f is None:
        return None
    scale = low.scale.float()
    per_base = scale.shape[1] // f.base.shape[1]
    if not _float16_valued(f.base) or not torch.equal(
            f.codes.float() * f.base.repeat_interleave(per_base, 1), scale):
        return None
    minimum = None
    if f.min_codes is not None:
        if not _float16_valued(f.min_base):
            return None
        base = f.min_base.repeat_interleave(per_base, 1)
        minimum = f.min_codes.float() * base
        if not torch.equal(minimum.double(), f.min_codes.double() * base.double()):
            return None
    factor = _zero_factor(zero, scale, minimum)
    if factor is None:
        return None
    return factor, f.codes, f.base, f.min_codes, f.min_base


def _float16_valued(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) and torch.equal(t.half().float(), t.float())


def _zero_factor(zero: torch.Tensor, scale: torch.Tensor,
                 minimum: torch.Tensor | None = None) -> torch.Tensor | None:
    """f [N] with zero == f[:, None] * scale - minimum exactly (as float32 operations: what
    the kernel computes), or None when some channel's zeros are not one factor times its
    scales (less the minimum)."""
    nonzero = scale != 0
    first = nonzero.int().argmax(dim=1, keepdim=True)  # a group with a scale, where any is
    shifted = zero if minimum is None else zero.double() + minimum.double()
    factor = (shifted.gather(1, first).double() / scale.gather(1, first).double()).squeeze(1)
    integral = factor.round()
    factor = torch.where((factor - integral).abs() < 1e-3, integral, factor).float()
    factor = torch.where(nonzero.any(dim=1), factor, torch.zeros_like(factor))
    got = factor[:, None] * scale
    if minimum is not None:
        got = got - minimum
    return factor if torch.equal(got, zero) else None


def _words(codes: torch.Tensor, pad: int, tiles: int, bits: int,
           empty: Callable[..., torch.Tensor]) -> torch.Tensor:
    """[N, K] codes as a plane's int32 words [tiles, K bits / 32, 16] (cpu_linear.h): 4 bits
    in the nibble layout of pairs; 1 or 2 bits with a word's even inputs in its low half and
    odd ones in its high half, each half in input order. In every form a word's input m sits
    at bit 16 (m % 2) + bits (m // 2), so byte b of the word holds the inputs
    2 (b % 2 * per_byte + i) + b // 2 at bits i * bits: the words are built as their bytes,
    in uint8, a block of tiles at a time (wider intermediates of a whole large-vocabulary
    head would take several times the model's size in memory). `empty(shape, dtype)` gives
    the output's memory."""
    columns = codes.shape[1]
    per_word, per_byte = 32 // bits, 8 // bits
    out = empty((tiles, columns // per_word, LANES), torch.int32)
    for first in range(0, tiles, _PACK_TILES):
        last = min(tiles, first + _PACK_TILES)
        c = codes[first * LANES:last * LANES].to(torch.uint8)
        if c.shape[0] < (last - first) * LANES:  # the last tile's channels past N
            c = F.pad(c, (0, 0, 0, (last - first) * LANES - c.shape[0]),
                      value=8 if bits == 4 else 0)
        # [..., word, input m] -> [..., word, m % 2, m // 2 as (byte half, i)]: byte
        # b = 2 (m % 2) + (m // 2) // per_byte, its i-th code m // 2 % per_byte
        c = c.view(last - first, LANES, columns // per_word, per_word // 2, 2).transpose(-1, -2)
        c = c.reshape(last - first, LANES, columns // per_word, 4, per_byte)
        word_bytes = c[..., 0].clone()
        for i in range(1, per_byte):
            word_bytes |= c[..., i] << (bits * i)
        if sys.byteorder == "big":  # byte 0 is the word's lowest bits wherever it is stored
            word_bytes = word_bytes.flip(-1)
        out[first:last] = word_bytes.contiguous().view(torch.int32).squeeze(-1).transpose(1, 2)
    return out


_PACK_TILES = 256  # tiles (of 16 channels) packed at a time by _words


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def tile_dense(weight: torch.Tensor, kept: bool = False) -> torch.Tensor:
    """Our kernel's form of a dense [N, K] weight: bfloat16 [tiles, K / 2, 32], lane j holding
    channel j's weights of inputs k and k + 1; float32 [tiles, K, 16]. `kept`: in the memory
    a CpuWeights keeps (huge pages, host_memory)."""
    rows, columns = weight.shape
    tiles = -(-rows // LANES)
    w = F.pad(weight, (0, 0, 0, tiles * LANES - rows))
    if w.dtype == torch.float32:
        tiled = w.view(tiles, LANES, columns).transpose(1, 2)
    else:
        tiled = w.to(torch.bfloat16).view(tiles, LANES, columns // 2, 2).transpose(1, 2)
    out = host_memory.copy_of(tiled) if kept else tiled.contiguous()
    return out if w.dtype == torch.float32 else out.view(tiles, columns // 2, 2 * LANES)


def _lanes_last(per_group: torch.Tensor, pad: int, tiles: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, G] -> [tiles, G, 16] of dtype (float32 by default), padded channels 0."""
    padded = F.pad(per_group.to(dtype), (0, 0, 0, pad))
    return padded.view(tiles, LANES, -1).transpose(1, 2)


def linear_kernel() -> ModuleType | None:
    """Our compiled CPU kernels (built on first use), or None where they cannot be built."""
    return cpu_kernel.load()


class CpuWeights(nn.Module):
    """y = x @ W.T on the CPU for W as int4 planes or dense bfloat16 (`dense`; float32 with
    `float32=True`: then the activations stay float32), with an optional input permutation
    (GPTQ act-order: x[..., perm]). Held in our kernel's tiles where it builds (`tiled`), else
    in torch's layouts. `segments`: planes of consecutive ranges of the outputs, each tiled
    in its own form (`stack`; our kernel only). `tiles`: segments already tiled, in the
    memory they are to stay in (`from_row_blocks`). Tiles are held in huge pages where the
    system gives them (host_memory)."""

    def __init__(self, planes: list[Plane] | None = None, dense: torch.Tensor | None = None,
                 perm: torch.Tensor | None = None, float32: bool = False,
                 segments: list[list[Plane]] | None = None,
                 tiles: list[tuple[int, int, TiledPlanes]] | None = None) -> None:
        super().__init__()
        self.kernel = linear_kernel()
        self.tiled = self.kernel is not None
        if planes:
            segments = [planes]
        if segments and self.tiled:  # (rows, planes, their tiles) per segment
            tiles = [(planes[0].codes.shape[0], len(planes), tile_planes(planes))
                     for planes in segments]
        if segments and not self.tiled:
            planes = _stacked(segments, segments[0][0].codes.shape[1])
            group = planes[0].codes.shape[1] // planes[0].scale.shape[1]
            if (kernel_group(group, planes[0].codes.shape[1]) != group
                    or planes[0].codes.shape[0] % LANES):
                # torch's int4 kernel takes groups of 32 to 256 inputs only (not Q6_K's 16),
                # and whole tiles of 16 outputs
                segments, dense = None, dequantize_planes(planes)
        if tiles:
            self.segments = len(tiles)
            self.plane_counts = [count for _, count, _ in tiles]  # planes per segment
            self.out_features = sum(rows for rows, _, _ in tiles)
        else:
            self.segments, self.plane_counts = 0, []
            self.out_features = (planes[0].codes if planes else dense).shape[0]
        self.group = 0
        self.activations = torch.float32 if float32 else torch.bfloat16
        self.register_buffer("perm", perm)
        if dense is not None:
            dense = dense.to(self.activations)
            self.register_buffer("dense", tile_dense(dense, kept=True) if self.tiled else dense)
            self._tensors = [self.dense]
            return
        self.dense = None
        if self.tiled:
            self._tensors = []
            for index, (_, _, tiled) in enumerate(tiles):
                for name, tensor in tiled._asdict().items():
                    self.register_buffer(f"{name}{index}", tensor)
                    self._tensors.append(getattr(self, f"{name}{index}"))
            return
        self.group = planes[0].codes.shape[1] // planes[0].scale.shape[1]
        self.plane_counts = [len(planes)]
        for index, (codes, scale, zero, _) in enumerate(planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), 1)
            scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16)
            self.register_buffer(f"qweight{index}", packed)
            self.register_buffer(f"scales_zeros{index}", scales_zeros.contiguous())
        self._tensors = [getattr(self, f"{name}{i}") for i in range(len(planes))
                         for name in ("qweight", "scales_zeros")]

    @staticmethod
    def stack(parts: list[list[Plane]], rows: list[int], columns: int) -> "CpuWeights":
        """Planes of several parts stacked along the rows (a merged layer's parts), as
        `segments_of` groups them for our kernel; one stack for torch's."""
        if linear_kernel() is None:
            return CpuWeights(_stacked(parts, columns))
        return CpuWeights(segments=segments_of(parts, rows, columns))

    @staticmethod
    def from_row_blocks(blocks: Iterable[list[Plane]]) -> "CpuWeights":
        """Planes given a block of rows at a time (each but the last whole tiles), for a
        vocabulary-sized head: decoding all of its rows at once takes several times its
        packed size. Our kernel tiles each block as it comes, and joins consecutive blocks in
        one form into one segment: the same tensors as tiling all the rows at once."""
        if linear_kernel() is None:  # torch's kernel: one stack of all the rows
            return CpuWeights(segments=list(blocks))
        runs: list[list] = []  # [form, rows, tiles of its blocks]
        for planes in blocks:
            tiled = tile_planes(planes, kept=False)
            form = (len(planes), [(t.dtype, t.shape[1:]) for t in tiled])
            if runs and runs[-1][0] == form:
                runs[-1][1] += planes[0].codes.shape[0]
                runs[-1][2].append(tiled)
            else:
                runs.append([form, planes[0].codes.shape[0], [tiled]])
        return CpuWeights(tiles=[
            (rows, form[0], TiledPlanes(*map(host_memory.cat, zip(*parts))))
            for form, rows, parts in runs])

    def kernel_form(self) -> tuple[int, int, list[torch.Tensor]] | None:
        """(segments, N, tensors) as the C++ forward kernel reads a tiled linear: 0 and the
        dense tiles, or the planes' segments (TiledPlanes each); None without tiles or with
        a permutation."""
        if not self.tiled or self.perm is not None:
            return None
        return self.segments, self.out_features, self._tensors

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype, or float32 with `float_out` (logits: our
        kernel then does not round them to bfloat16)."""
        x2 = x.reshape(-1, x.shape[-1]).to(self.activations)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.tiled and self.dense is not None:
            out = self.kernel.dense_linear(x2, self.dense, self.out_features, float_out)
        elif self.tiled:
            out = self.kernel.planes_linear(x2, self._tensors, self.out_features, float_out)
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
