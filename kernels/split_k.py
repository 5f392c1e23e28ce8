"""Split-K in one launch: the programs that share an output tile add their partial sums
through a workspace, and the last of them to finish writes the tile.

A GEMV at batch 1 splits K over several programs per output tile (grid axis 1, a runtime
count: one compiled kernel serves every split) so that the GPU holds enough loads in flight.
Each program writes its float32 partial rows to the workspace, then takes a ticket from the
tile's counter (an atomic add). The program that draws the last ticket adds the partials in
split order (so the result does not depend on which program finished last: deterministic)
and writes the tile in the output dtype, then sets the counter back to 0. No second kernel,
no float atomics. The Triton interpreter runs this path as is (its programs run one after
another, so there the last split is always the last to finish).

Ordering: every thread's partial stores happen before the program's ticket (a CTA barrier,
then an acq_rel atomic at GPU scope, which releases them); the last program acquires through
its own ticket, and its loads bypass L1 (`.cg`), so they see every other program's partials.

Buffers: the workspace and the counters are allocated once per (device, shape) and kept for
the life of the process: a CUDA graph replays the addresses it captured, so they are never
freed or reallocated. Counters start at zero and every launch leaves them at zero, so the
kernels are re-entrant and can be replayed in graphs. Calls of one shape share the buffers, so
they must be ordered, as launches on one stream are; two streams running linears of the same
shape at the same time would race.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class SplitKBuffers(NamedTuple):
    partials: torch.Tensor  # [tiles * split * rows * block_n] float32, written before read
    counters: torch.Tensor  # [tiles] int32, zero between launches


_BUFFERS: dict[tuple, SplitKBuffers] = {}
# Buffers first allocated while a CUDA graph was being captured: their zeroing is a node of
# that graph, not yet executed. Until an eager call zeroes them, every call zeroes them again
# in its stream (in a graph: a memset node of that graph too), so no replay ever starts from
# counters that were never set.
_UNZEROED: set[tuple] = set()


def split_k_buffers(device: torch.device, tiles: int, split: int, rows: int,
                    block_n: int) -> SplitKBuffers:
    """The workspace and tile counters for one launch shape (allocated on first use)."""
    if split == 1:  # unused, but the same pointer types: one compiled kernel for every split
        key, workspace, counters = (device,), 1, 1
    else:
        key = (device, tiles, split, rows, block_n)
        workspace, counters = tiles * split * rows * block_n, tiles
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    buffers = _BUFFERS.get(key)
    if buffers is None:
        buffers = SplitKBuffers(torch.empty(workspace, dtype=torch.float32, device=device),
                                torch.zeros(counters, dtype=torch.int32, device=device))
        _BUFFERS[key] = buffers
        if capturing:
            _UNZEROED.add(key)
    elif key in _UNZEROED:
        buffers.counters.zero_()
        if not capturing:
            _UNZEROED.discard(key)
    return buffers


@triton.jit
def store_rows(out_ptr, stride_om, offs_n, mask_n, y0, y1, y2, y3, ROWS: tl.constexpr):
    """Rows 0..ROWS-1 of the output tile (the y beyond ROWS are ignored)."""
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs_n, y0.to(dtype), mask=mask_n)
    if ROWS > 1:
        tl.store(out_ptr + stride_om + offs_n, y1.to(dtype), mask=mask_n)
    if ROWS > 2:
        tl.store(out_ptr + 2 * stride_om + offs_n, y2.to(dtype), mask=mask_n)
    if ROWS > 3:
        tl.store(out_ptr + 3 * stride_om + offs_n, y3.to(dtype), mask=mask_n)


@triton.jit
def _split_sum(tile_ptr, offs, num_splits, ROW: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Row ROW of the tile: the partials of splits 0, 1, ... added in that order. Eight
    loads are issued at a time (a loop of single loads would wait out the L2 latency once per
    split); the ones past the last split read 0.0, which adds nothing."""
    total = tl.load(tile_ptr + ROW * BLOCK_N + offs, cache_modifier=".cg")
    for first in range(1, num_splits, 8):
        for i in tl.static_range(8):  # unrolled: the loads do not wait for the adds
            live = tl.where(first + i < num_splits, BLOCK_N, 0)  # a scalar test per split
            total += tl.load(tile_ptr + ((first + i) * ROWS + ROW) * BLOCK_N + offs,
                             mask=offs < live, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def finish_split_k(out_ptr, stride_om, partials_ptr, counters_ptr, offs_n, mask_n, y0, y1, y2,
                   y3, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write this program's float32 rows y0..y{ROWS-1} (its split's sums for the tile at
    offs_n) to the output, adding the other splits' first when K is split. Grid: (tiles,
    splits); the split count is read from the grid, so it is not a compile-time constant.

    out_ptr points at row 0 of the output; partials_ptr at a workspace of
    [tiles, splits, ROWS, BLOCK_N] float32; counters_ptr at [tiles] int32 zeros."""
    num_splits = tl.num_programs(1)
    if num_splits == 1:
        store_rows(out_ptr, stride_om, offs_n, mask_n, y0, y1, y2, y3, ROWS)
    else:
        tile = tl.program_id(0)
        offs = offs_n - tile * BLOCK_N  # 0 .. BLOCK_N-1, in offs_n's layout
        tile_ptr = partials_ptr + tile * (num_splits * ROWS * BLOCK_N)
        mine = tile_ptr + tl.program_id(1) * (ROWS * BLOCK_N) + offs
        tl.store(mine, y0)
        if ROWS > 1:
            tl.store(mine + BLOCK_N, y1)
        if ROWS > 2:
            tl.store(mine + 2 * BLOCK_N, y2)
        if ROWS > 3:
            tl.store(mine + 3 * BLOCK_N, y3)
        # All threads' stores before the ticket; the ticket releases them (and, for the last
        # program, acquires everyone else's).
        tl.debug_barrier()
        ticket = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == num_splits - 1:
            t0 = _split_sum(tile_ptr, offs, num_splits, 0, ROWS, BLOCK_N)
            t1 = t0
            t2 = t0
            t3 = t0
            if ROWS > 1:
                t1 = _split_sum(tile_ptr, offs, num_splits, 1, ROWS, BLOCK_N)
            if ROWS > 2:
                t2 = _split_sum(tile_ptr, offs, num_splits, 2, ROWS, BLOCK_N)
            if ROWS > 3:
                t3 = _split_sum(tile_ptr, offs, num_splits, 3, ROWS, BLOCK_N)
            store_rows(out_ptr, stride_om, offs_n, mask_n, t0, t1, t2, t3, ROWS)
            # Every program of this launch has drawn its ticket: back to 0 for the next one.
            tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any count works
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:  # a property query per matmul would cost host time
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_for(tiles: int, blocks: int, num_sms: int, programs_per_sm: int = 4,
              max_split: int = 16) -> int:
    """The smallest power-of-two K split that gives the GPU `programs_per_sm` programs per SM
    (a memory-bound kernel needs that many loads in flight), at most one K block per split
    and at most `max_split` (each split adds a partial row to write and read back)."""
    split = 1
    while tiles * split < programs_per_sm * num_sms and split < min(blocks, max_split):
        split *= 2
    return max(1, min(split, blocks))


def blocks_per_split(blocks: int, split: int) -> tuple[int, int]:
    """(K blocks per split, the split that leaves no split empty)."""
    per = triton.cdiv(blocks, split)
    return per, triton.cdiv(blocks, per)
