"""GGUF's quantized blocks, kept as they are, and their decoding into 4-bit planes.

A GGUF weight of type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K is stored row by row in
blocks: each block holds 32 (or 256) codes and the scales that turn them into weights. Every one
of these types has a scale (and an offset) per 16 or 32 consecutive inputs, so each can be
written exactly as one or two *planes* of the form our CPU kernel computes (cpu_weights),

    W[n, k] = sum over planes p of  (q_p[n, k] - 8) * scale_p[n, k // g] + zero_p[n, k // g]

with 4-bit codes q_p in [0, 15]: 4-bit types are one plane; 5-, 6- and 8-bit codes u are split
into u = 16 * hi + lo, a plane for hi (scale 16 * s) and one for lo (scale s), the constant
folded into the zeros. Q3_K and Q2_K are dequantized to float instead (see `NATIVE_TYPES`).

Layouts (ggml's, little-endian; d, m, dmin float16):
    Q4_0  [d | 16 bytes of nibbles]                 w = (q - 8) * d
    Q4_1  [d | m | 16 bytes of nibbles]             w = q * d + m
    Q5_0  [d | 4 bytes high bits | 16 bytes]        w = (q - 16) * d
    Q5_1  [d | m | 4 bytes high bits | 16 bytes]    w = q * d + m
    Q8_0  [d | 32 int8]                             w = q * d
    Q4_K  [d | dmin | 12 bytes of 6-bit scales, mins | 128 bytes]   w = d*sc*q - dmin*m (per 32)
    Q5_K  [d | dmin | 12 bytes | 32 bytes high bits | 128 bytes of nibbles]
    Q6_K  [128 bytes of low nibbles | 64 bytes of high 2 bits | 16 int8 scales | d]
                                                    w = d * sc * (q - 32) (per 16)
In the 32-blocks, byte j holds code j in its low nibble and code j + 16 in its high one. In
Q4_K/Q5_K, 64 codes at a time share 32 bytes: low nibbles are the first 32, high nibbles the
next. Q6_K is two halves of 128 codes: code 32 m + l of a half takes its low 4 bits from byte
l (m = 0, 2) or l + 32 (m = 1, 3) of the half's 64 (low nibble for m < 2, high for m >= 2) and
its top 2 bits from bits 2m, 2m + 1 of byte l of the half's 32.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from radixlm.runtime.models.quantization.cpu_weights import Plane, ScaleFactors

# ggml type id -> (name, codes per block, bytes per block)
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
               7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
               13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
NATIVE_TYPES = frozenset(name for name, _, _ in BLOCK_TYPES.values())
_TYPE_IDS = {name: type_id for type_id, (name, _, _) in BLOCK_TYPES.items()}


class GGUFBlocks(NamedTuple):
    """A quantized GGUF tensor as stored: `data` [rows, bytes per row] uint8, of `type_name`,
    holding `shape` = (rows, columns) weights."""

    type_name: str
    data: torch.Tensor
    shape: tuple[int, int]

    @staticmethod
    def from_rows(type_name: str, data: torch.Tensor) -> "GGUFBlocks":
        """Blocks [rows, bytes per row] of a GGUF type; the weight shape follows from it."""
        if type_name not in NATIVE_TYPES:
            raise ValueError(f"GGUF block type {type_name!r} is not one of "
                             f"{', '.join(sorted(NATIVE_TYPES))}")
        _, per_block, size = BLOCK_TYPES[_TYPE_IDS[type_name]]
        if data.dim() != 2 or data.dtype != torch.uint8 or data.shape[1] % size:
            raise ValueError(f"{type_name} blocks must be uint8 [rows, k * {size}] bytes; got "
                             f"{data.dtype} {tuple(data.shape)}")
        return GGUFBlocks(type_name, data, (data.shape[0], data.shape[1] // size * per_block))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights, decoded by the gguf package (the reference decoder) to float32 and
        rounded to `dtype`, a block of rows at a time (the decoder's float32 temporaries of a
        vocabulary-sized table would take several times its size)."""
        import gguf

        kind = gguf.GGMLQuantizationType[self.type_name]
        out = torch.empty(self.shape, dtype=dtype)
        data = self.data.numpy()
        for start in range(0, self.shape[0], _DEQUANTIZE_ROWS):
            rows = gguf.quants.dequantize(data[start:start + _DEQUANTIZE_ROWS], kind)
            out[start:start + len(rows)] = torch.from_numpy(
                np.ascontiguousarray(rows, dtype=np.float32))
        return out

    def narrow_rows(self, start: int, length: int) -> "GGUFBlocks":
        return GGUFBlocks(self.type_name, self.data[start:start + length],
                          (length, self.shape[1]))

    def planes(self) -> list[Plane]:
        """The weights as 4-bit planes (module docstring), exactly up to float32 rounding."""
        return _DECODERS[self.type_name](self.data, self.shape[1])

    def planes_by_rows(self, rows: int = 16384) -> Iterator[list[Plane]]:
        """The planes of `rows` rows at a time (a vocabulary-sized table's decoding
        temporaries would take several times its packed size)."""
        for start in range(0, self.shape[0], rows):
            yield self.narrow_rows(start, min(rows, self.shape[0] - start)).planes()


_DEQUANTIZE_ROWS = 4096  # rows decoded at a time by GGUFBlocks.dequantize


def type_id(name: str) -> int:
    return _TYPE_IDS[name]


def _blocks(data: torch.Tensor, columns: int, per_block: int, size: int) -> torch.Tensor:
    """[N, bytes] -> [N, blocks, bytes per block]."""
    rows = data.shape[0]
    if data.shape[1] * per_block != columns * size:
        raise ValueError(f"{data.shape[1]} bytes per row do not hold {columns} codes")
    return data.reshape(rows, columns // per_block, size)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of each block, as float32 [N, blocks]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] bytes -> [N, B, 32] codes: low nibbles are codes 0-15, high ones 16-31."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[N, B, 4] bytes of a little-endian uint32 -> [N, B, 32] bits, bit j for code j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], 32)


def _plane(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           factors: ScaleFactors | None = None) -> Plane:
    """codes [N, B, 32 * g], scale/zero [N, B * g] -> a Plane over N rows."""
    rows = codes.shape[0]
    return Plane(codes.reshape(rows, -1).to(torch.uint8).contiguous(), scale.reshape(rows, -1),
                 zero.reshape(rows, -1), factors)


def _split(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
           factors: ScaleFactors | None = None) -> list[Plane]:
    """Weights w = codes * scale + offset (codes up to 8 bits, per-group scale/offset) as two
    planes: codes = 16 * hi + lo, so w = 16s(hi - 8) + s(lo - 8) + (136 s + offset)."""
    group_shape = scale.shape
    hi, lo = codes >> 4, codes & 15
    return [_plane(hi, 16 * scale, (136 * scale + offset).reshape(group_shape)),
            _plane(lo, scale, torch.zeros(group_shape), factors)]


def _factors(sc: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
             dmin: torch.Tensor | None = None) -> ScaleFactors:
    """A K-quant's sub-block codes [N, B, S] under its blocks' d [N, B] (and mins under
    dmin), as per-group codes [N, B * S] and bases [N, B]."""
    rows = sc.shape[0]
    return ScaleFactors(sc.reshape(rows, -1).to(torch.int8), d,
                        None if m is None else m.reshape(rows, -1).to(torch.int8), dmin)


def _q4_0(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 32, 18)
    d = _f16(b, 0)
    return [_plane(_nibbles32(b[..., 2:]), d, torch.zeros_like(d))]


def _q4_1(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 32, 20)
    d, m = _f16(b, 0), _f16(b, 2)
    return [_plane(_nibbles32(b[..., 4:]), d, m + 8 * d)]


def _q5_0(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 32, 22)
    d = _f16(b, 0)
    codes = _nibbles32(b[..., 6:]) | (_bits32(b[..., 2:6]) << 4)  # [N, B, 32] in [0, 31]
    return _split(codes, d, -16 * d)


def _q5_1(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 32, 24)
    d, m = _f16(b, 0), _f16(b, 2)
    codes = _nibbles32(b[..., 8:]) | (_bits32(b[..., 4:8]) << 4)
    return _split(codes, d, m)


def _q8_0(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 32, 34)
    d = _f16(b, 0)
    codes = (b[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # q + 128
    return _split(codes, d, -128 * d)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ScaleFactors]:
    """The 8 sub-blocks' scales and mins of Q4_K/Q5_K blocks [N, B, >=16 bytes]:
    float32 [N, B, 8] each (d * sc and dmin * m), and those factors. 6-bit values in 12
    bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks
    4-7 in the nibbles of bytes 8-11, their top two bits in the top bits of bytes 0-3 and
    4-7."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[..., 4:16].to(torch.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    sc = torch.cat((low_sc, high_sc), dim=-1).float()
    m = torch.cat((low_m, high_m), dim=-1).float()
    return d[..., None] * sc, dmin[..., None] * m, _factors(sc, d, m, dmin)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 128] bytes -> [N, B, 256] codes: per 64 codes, 32 bytes' low nibbles then their
    high nibbles."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return torch.stack((chunks & 15, chunks >> 4), dim=-2).reshape(*qs.shape[:-1], 256)


def _q4_k(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 256, 144)
    scale, minimum, factors = _k_scales(b)
    return [_plane(_k_nibbles(b[..., 16:]), scale, 8 * scale - minimum, factors)]


def _q5_k(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 256, 176)
    scale, minimum, factors = _k_scales(b)
    # High bits: bit 2c of byte l is code l of sub-block 2c, bit 2c + 1 code l of 2c + 1.
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (b[..., 16:48, None] >> shifts) & 1  # [N, B, 32 bytes, 8 sub-blocks]
    high = bits.transpose(-1, -2).reshape(*b.shape[:-1], 256)
    codes = _k_nibbles(b[..., 48:]) | (high << 4)
    return _split(codes, scale, -minimum, factors)


def _q6_k(data: torch.Tensor, columns: int) -> list[Plane]:
    b = _blocks(data, columns, 256, 210)
    low = b[..., :128].reshape(*b.shape[:-1], 2, 2, 32)  # [N, B, half, byte l or l + 32, l]
    high = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    lo = torch.cat((low & 15, low >> 4), dim=-2)  # m = 0..3
    hi = (high >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3
    codes = (lo | (hi << 4)).reshape(*b.shape[:-1], 256)  # in [0, 63]
    d, sc = _f16(b, 208), b[..., 192:208].view(torch.int8)
    scale = d[..., None] * sc.float()  # [N, B, 16]
    return _split(codes, scale, -32 * scale, _factors(sc, d))


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
