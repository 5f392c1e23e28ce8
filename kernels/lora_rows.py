"""How a batch's rows reach the LoRA kernels (kernels/lora.py), computed on the host: the rows
grouped by adapter slot and cut into tiles. No Triton here, so the engine imports it on
machines without Triton (the CPU, where the C++ kernel runs the updates)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

BLOCK_M = 16  # rows per tile (tl.dot's smallest M)
BLOCK_R = 16  # ranks per program: the slots' rank R is a multiple of it
TILE_FIELDS = 3  # (slot, first, stop)


def group_rows(token_slots: Sequence[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """(rows, tiles) for a batch whose row i uses slot token_slots[i] (-1: no adapter): the
    adapted rows slot by slot (in row order within a slot), and tiles (slot, first, stop) into
    them of at most BLOCK_M rows of one slot."""
    slots = np.asarray(token_slots, dtype=np.int64)
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    used, firsts, counts = np.unique(slots[order], return_index=True, return_counts=True)
    tiles = [(int(slot), start, min(start + BLOCK_M, int(first + count)))
             for slot, first, count in zip(used, firsts, counts)
             for start in range(int(first), int(first + count), BLOCK_M)]
    return order.tolist(), tiles


def max_tiles(num_rows: int, num_slots: int) -> int:
    """The most tiles `group_rows` gives for num_rows rows over num_slots slots."""
    return min(num_rows, -(-num_rows // BLOCK_M) + num_slots)
