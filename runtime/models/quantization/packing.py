"""Bit layouts of the quantized checkpoint formats, and our own runtime layout.

Integers of `bits` bits are packed `32 // bits` to an int32, the first value of a group of
`pack` in the lowest bits. Formats differ in which axis they pack and in the order inside a
word. With W the [in = K, out = N] matrix (the transpose of a torch Linear's weight):

    GPTQ qweight  [K / pack, N]  packed along K (the input), values in order
    GPTQ qzeros   [G, N / pack]  packed along N, in order; v1 ("gptq") stores zero - 1
    AWQ  qweight  [K, N / 8]     packed along N (the output); word slot i holds column
    AWQ  qzeros   [G, N / 8]     AWQ_ORDER[i] of its 8: 0 2 4 6 1 3 5 7 (4-bit only)
    scales        [G, N]         G = number of groups along K, in both formats

Our runtime layout (`int_weight.py`, the Triton kernel) is GPTQ's qweight with zero points
unpacked to uint8 [G, N]: one byte per group and column is ~1.6% of the 4-bit weight bytes at
group 128, and a byte holds v1 GPTQ zero points of 16 (stored 15, read back + 1) that a nibble
cannot.
"""

from __future__ import annotations

from typing import Sequence

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(values: torch.Tensor, bits: int, dim: int,
         order: Sequence[int] | None = None) -> torch.Tensor:
    """Pack unsigned `bits`-bit integers along `dim` into int32 words. Word slot i (bits
    i*bits .. (i+1)*bits - 1) holds element order[i] of its group (element i by default)."""
    per_word = 32 // bits
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"cannot pack {moved.shape[-1]} values {per_word} to a word")
    groups = moved.reshape(*moved.shape[:-1], -1, per_word)  # [..., n / pack, pack]
    if order is not None:
        groups = groups[..., list(order)]
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    words = (groups << shifts).sum(-1)  # the slots do not overlap: sum == bitwise or
    # Two's complement wrap of the unsigned 32-bit word into int32.
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int,
           order: Sequence[int] | None = None) -> torch.Tensor:
    """The inverse of `pack`: int32 words -> int32 values in [0, 2**bits), `dim` grown by
    32 // bits."""
    per_word = 32 // bits
    moved = words.movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32)
    # >> on int32 sign-extends the top slot; the mask drops the extension.
    slots = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., n / pack, pack]
    if order is not None:
        inverse = [0] * per_word
        for slot, element in enumerate(order):
            inverse[element] = slot
        slots = slots[..., inverse]
    values = slots.reshape(*moved.shape[:-1], -1)
    return values.movedim(-1, dim).contiguous()


# -- AWQ (AutoAWQ GEMM) -----------------------------------------------------------------------


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, N] 4-bit values (qweight rows are input channels, qzeros rows are groups) ->
    [rows, N / 8] int32 in AWQ's interleaved word order."""
    return pack(values, 4, dim=1, order=AWQ_ORDER)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    return unpack(words, 4, dim=1, order=AWQ_ORDER)


# -- GPTQ (AutoGPTQ / GPTQModel) --------------------------------------------------------------


def pack_gptq_weight(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] values -> [K / pack, N] int32 qweight."""
    return pack(values, bits, dim=0)


def unpack_gptq_weight(words: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack(words, bits, dim=0)


def pack_gptq_zeros(zeros: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    """[G, N] zero points -> [G, N / pack] int32 qzeros. v1 stores zero - 1 (wrapping a zero
    point of 0 to 2**bits - 1, which every v1 reader reads back as 2**bits)."""
    stored = (zeros.to(torch.int64) - 1) & ((1 << bits) - 1) if v1 else zeros
    return pack(stored, bits, dim=1)


def unpack_gptq_zeros(words: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    zeros = unpack(words, bits, dim=1)
    return zeros + 1 if v1 else zeros
