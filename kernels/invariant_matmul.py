"""A batch-invariant matmul in Triton: y = x @ W^T (W [N, K] as torch's Linear stores it),
where every output element is computed by the same float operations in the same order
whatever the number of rows M. Deterministic inference (EngineConfig.deterministic) runs the
decoder linears and the output head through it, so that a token's logits do not depend on how
many other tokens share its step.

The reduction over K is fixed by (N, K) and the device, never by M:

    K is cut into `num_segs` segments of seg_len (a whole number of BLOCK_K tiles);
    segment s is accumulated from zero over its BLOCK_K tiles by tl.dot, which on Hopper is
    one tensor-core instruction for every M (m64 x BLOCK_N x 16, x32 for fp8);
    y = (((0 + seg_0) + seg_1) + ...) in float32, then rounded (fp8: times the row and
    column scales first).

Only the distribution of that work changes with M (`InvariantConfig.tilings`). A few rows
(one 64-row tile, the decode steps, where there are too few tiles to keep the GPU's loads in
flight): one program per (tile, segment) writes its segment's float32 sum to a workspace, and
the last program of the tile to finish (a ticket, as in split_k.py) adds them in segment
order. More rows: one program per output tile walks every segment (short segments in one
pipelined loop over all of K that adds each segment's sum into the total as it ends); from a
few hundred rows on, a program covers 128 rows with two warpgroups. All give the same bits,
because all add the same float32 values in the same order.

Why segments at all: at batch 1 an 8B model's o and down projections have 32 column tiles,
which cannot stream their weights at the card's bandwidth; splitting K gives the GPU enough
programs. The segment count is chosen for the one-row case (`segments_for`) and then kept
for every M.

Why the instruction, not the tile, is what stays fixed: two tensor-core instructions of
different shapes need not add a dot's products in the same order, but one instruction adds
them one way whichever rows and warps issue it. Triton picks the instruction from the tile's
columns and how the warps split it: BLOCK_N stays 128, and each warpgroup (4 warps) gets whole
64-row slices (`InvariantConfig` refuses a tiling that would split the columns instead).
tests/test_batch_invariant.py checks the compiled PTX of every tiling for one instruction.

How the tiles reach shared memory is not part of the numerics either: a tiling may load them
through Hopper's copy engine (`Tiling.tma`: one tensor-memory-accelerator request per tile,
zeros past the edges as the masked loads give) and walk several output tiles per program
(`Tiling.persistent`); operands the copy engine cannot address (a start or row not 16-byte
aligned) take plain loads, with the same dots in the same order, so the same bits.
benchmarks/invariant_kernels.py --sweep times those variants beside the others. Nor is how
the kernel is launched: on Hopper it takes part in programmatic dependent launch
(kernels/pdl.py), set up while the kernel before it runs and waiting for it before any load.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from radixlm.kernels.pdl import pdl_options, pdl_prologue
from radixlm.kernels.shared_memory import launch_within_shared_memory
from radixlm.kernels.split_k import num_sms, split_k_buffers


@dataclass(frozen=True)
class Tiling:
    """How one launch spreads the work: rows per program, warps, pipeline depth, whether
    the K segments run as separate programs (`split`: for one row tile, M <= block_m), and
    how many K tiles one step of a program's loop loads (`unroll`: 2 keeps twice the bytes
    in flight per pipeline stage, as a 128-wide tile would, yet issues the same 64-wide dots
    in the same order), whether the tiles come through the copy engine (`tma`: Hopper's
    tensor memory accelerator, one thread's request per tile instead of every thread's
    addresses; where the GPU or the operands' alignment does not allow it, the same tiling
    runs with plain loads), and whether a program walks several output tiles (`persistent`:
    one grid of a few programs per SM, whose next tile's loads overlap this one's end). None
    of these changes an output element's float operations (see InvariantConfig)."""
    block_m: int
    num_warps: int
    num_stages: int
    split: bool = False
    unroll: int = 1
    tma: bool = False
    persistent: int = 0  # programs per SM; 0: one program per output tile


@dataclass(frozen=True)
class InvariantConfig:
    # block_n and block_k fix the tensor-core instruction (m64 x block_n x 16, x32 for fp8)
    # and the order of K; they are the same for every M.
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # tiles of GROUP_M row blocks share a column block in L2 (prefill)
    # Segments: as many as keep one row's programs (column tiles x segments) within one per
    # SM, at most max_segs, and none shorter than min_seg_blocks K tiles. Fewer, longer
    # programs measured faster than two per SM at one row (each keeps more loads in flight,
    # and fewer partial sums are added) and at many rows (fewer segment sums); the 8B model
    # on an H100: qkv 2 segments, o and down 4, gate_up and the head 1
    # (benchmarks/invariant_kernels.py --segments; docs/deterministic.md).
    max_segs: int = 16
    min_seg_blocks: int = 4
    # (most rows, tiling), by increasing rows; the last one serves any larger M. Chosen by
    # sweeps on an H100 at Llama-3-8B's shapes (docs/deterministic.md): from 65 rows the
    # copy engine's loads cut the five linears' time by 18% at 256 rows, 7% at 2048.
    tilings: tuple[tuple[int, Tiling], ...] = (
        (64, Tiling(64, 4, 5, split=True)),
        (256, Tiling(64, 4, 4, tma=True, persistent=2)),
        (1 << 62, Tiling(128, 8, 4, tma=True)),
    )
    # Segments of at most this many K tiles run in one loop over all of K (see
    # _sum_segments); longer ones in a loop per segment, which pipelines better without the
    # per-tile test for a segment's end (measured: the flat loop wins on o's 4-tile segments,
    # loses on gate_up's 32).
    flat_max_tiles: int = 8

    def __post_init__(self) -> None:
        for _, tiling in self.tilings:
            # Triton gives each warpgroup (4 warps) whole 64-row slices of the tile when there
            # is at least one per warpgroup; fewer rows per warp and it would split the tile's
            # columns instead, which changes the instruction (m64n64 for m64n128).
            if tiling.block_m % 64 or tiling.block_m < 16 * tiling.num_warps:
                raise ValueError(f"tiling {tiling}: block_m must be a multiple of 64 with at "
                                 f"least 64 rows per 4 warps")
            if tiling.unroll not in (1, 2):
                raise ValueError(f"tiling {tiling}: unroll must be 1 or 2")
            if tiling.split and tiling.block_m != self.tilings[0][1].block_m:
                raise ValueError("only the first tiling may split K")
            if tiling.split and tiling.persistent:
                raise ValueError(f"tiling {tiling}: a split tiling is not persistent")

    def tiling(self, m: int) -> Tiling:
        for most_rows, tiling in self.tilings:
            if m <= most_rows:
                return tiling
        return self.tilings[-1][1]


DEFAULT = InvariantConfig()


@triton.jit
def _dot_tile(acc, x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n, k0, K,
              TMA: tl.constexpr):
    """acc + x[:, k0:k0 + BLOCK_K] @ w[:, k0:k0 + BLOCK_K]^T: one K tile of the product.
    x_src, w_src: the operands' descriptors with TMA (tiles at rows off_m and off_n), else
    pointers to the tile's rows (masked by mask_m and mask_n). Both read zeros past the
    edges."""
    if TMA:
        x = x_src.load([off_m, k0])
        w = w_src.load([off_n, k0])
    else:
        k = k0 + offs_k
        in_k = k < K
        x = tl.load(x_src + k[None, :], mask=mask_m[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_src + k[None, :], mask=mask_n[:, None] & in_k[None, :], other=0.0)
    return tl.dot(x, tl.trans(w), acc)  # [M, K] x [K, N]: W read K-major, as stored


@triton.jit
def _sum_segments(x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n, K, seg_len,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UNROLL: tl.constexpr, TMA: tl.constexpr):
    """Every segment of K, each summed from zero over its K tiles and added in order:
    [BLOCK_M, BLOCK_N] float32. One loop over every tile, so the loads stay pipelined across
    segment boundaries. UNROLL tiles a step (seg_len is then a multiple of UNROLL tiles)."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K * UNROLL):
        acc = _dot_tile(acc, x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n, k0, K, TMA)
        if UNROLL == 2:
            acc = _dot_tile(acc, x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n,
                            k0 + BLOCK_K, K, TMA)
        k_next = k0 + BLOCK_K * UNROLL
        if (k_next % seg_len == 0) | (k_next >= K):  # a segment ends: add it, start anew
            total += acc
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return total


@triton.jit
def _segment(x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n, k_lo, k_hi, K,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             UNROLL: tl.constexpr, TMA: tl.constexpr):
    """sum over k in [k_lo, k_hi) of x[:, k] * w[:, k]^T, from zero: [BLOCK_M, BLOCK_N].
    With UNROLL 2 the segment is a whole number of tile pairs, except the last one of K,
    whose odd tile past K adds a dot of zeros (exact)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K * UNROLL):
        acc = _dot_tile(acc, x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n, k0, K, TMA)
        if UNROLL == 2:
            acc = _dot_tile(acc, x_src, w_src, mask_m, mask_n, offs_k, off_m, off_n,
                            k0 + BLOCK_K, K, TMA)
    return acc


@triton.jit
def _store_tile(out_ptr, x_scale_ptr, w_scale_ptr, total, offs_m, offs_n, mask_m, mask_n,
                stride_om, SCALED: tl.constexpr):
    if SCALED:  # fp8: row scale, then column scale (one order for both paths)
        xs = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=1.0)
        ws = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=1.0)
        total = total * xs[:, None]
        total = total * ws[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             total.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _tile_of(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile number `tile`, grouped so that neighbours
    share W tiles in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit(do_not_specialize=["M"])
def _invariant_mm_kernel(x_src, w_src, out_ptr, x_scale_ptr, w_scale_ptr, partials_ptr,
                         counters_ptr, M, N, K, seg_len, num_segs,
                         stride_xm, stride_wn, stride_om,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SPLIT: tl.constexpr, SCALED: tl.constexpr,
                         FLAT: tl.constexpr, UNROLL: tl.constexpr, TMA: tl.constexpr,
                         PERSISTENT: tl.constexpr, PDL: tl.constexpr):
    # M is not specialized: a separate compile for M == 1 would be a second kernel, and the
    # point of this one is that every M runs the same code.
    # x_src, w_src: tensor descriptors with TMA, else the operands' first elements.
    # FLAT: one loop over every K tile (short segments); else a loop per segment.
    # PERSISTENT: each program walks the output tiles pid, pid + programs, ...
    pdl_prologue(PDL)
    offs_k = tl.arange(0, BLOCK_K)
    if SPLIT:  # grid (column tiles, segments); one row tile
        pid_n = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        if TMA:
            x_tile = x_src
            w_tile = w_src
        else:
            x_tile = x_src + offs_m[:, None] * stride_xm
            w_tile = w_src + offs_n[:, None] * stride_wn
        seg = tl.program_id(1)
        k_lo = seg * seg_len
        acc = _segment(x_tile, w_tile, mask_m, mask_n, offs_k, 0, pid_n * BLOCK_N, k_lo,
                       tl.minimum(k_lo + seg_len, K), K, BLOCK_M, BLOCK_N, BLOCK_K, UNROLL,
                       TMA)
        # workspace [column tiles, segments, M, BLOCK_N] float32
        cols = tl.arange(0, BLOCK_N)
        tile_ptr = partials_ptr + pid_n * num_segs * M * BLOCK_N
        tl.store(tile_ptr + (seg * M + offs_m[:, None]) * BLOCK_N + cols[None, :], acc,
                 mask=mask_m[:, None])
        # Every thread's partial before the ticket; the ticket releases them, and the last
        # program acquires everyone's through its own (see split_k.py).
        tl.debug_barrier()
        ticket = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == num_segs - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, num_segs):
                total += tl.load(tile_ptr + (s * M + offs_m[:, None]) * BLOCK_N + cols[None, :],
                                 mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
            _store_tile(out_ptr, x_scale_ptr, w_scale_ptr, total, offs_m, offs_n, mask_m,
                        mask_n, stride_om, SCALED)
            tl.atomic_xchg(counters_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    elif PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _output_tile(x_src, w_src, out_ptr, x_scale_ptr, w_scale_ptr, tile, M, N, K,
                         seg_len, num_segs, stride_xm, stride_wn, stride_om, BLOCK_M, BLOCK_N,
                         BLOCK_K, GROUP_M, SCALED, FLAT, UNROLL, TMA)
    else:
        _output_tile(x_src, w_src, out_ptr, x_scale_ptr, w_scale_ptr, tl.program_id(0), M, N,
                     K, seg_len, num_segs, stride_xm, stride_wn, stride_om, BLOCK_M, BLOCK_N,
                     BLOCK_K, GROUP_M, SCALED, FLAT, UNROLL, TMA)


@triton.jit
def _output_tile(x_src, w_src, out_ptr, x_scale_ptr, w_scale_ptr, tile, M, N, K, seg_len,
                 num_segs, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SCALED: tl.constexpr, FLAT: tl.constexpr, UNROLL: tl.constexpr,
                 TMA: tl.constexpr):
    """Output tile number `tile`, every segment of K summed and added in order."""
    pid_m, pid_n = _tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if TMA:
        x_tile = x_src
        w_tile = w_src
    else:
        x_tile = x_src + offs_m[:, None] * stride_xm
        w_tile = w_src + offs_n[:, None] * stride_wn
    if FLAT:
        total = _sum_segments(x_tile, w_tile, mask_m, mask_n, offs_k, pid_m * BLOCK_M,
                              pid_n * BLOCK_N, K, seg_len, BLOCK_M, BLOCK_N, BLOCK_K, UNROLL,
                              TMA)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for seg in range(0, num_segs):
            k_lo = seg * seg_len
            total += _segment(x_tile, w_tile, mask_m, mask_n, offs_k, pid_m * BLOCK_M,
                              pid_n * BLOCK_N, k_lo, tl.minimum(k_lo + seg_len, K), K, BLOCK_M,
                              BLOCK_N, BLOCK_K, UNROLL, TMA)
    _store_tile(out_ptr, x_scale_ptr, w_scale_ptr, total, offs_m, offs_n, mask_m, mask_n,
                stride_om, SCALED)


def segments_for(n: int, k: int, device: torch.device,
                 config: InvariantConfig = DEFAULT) -> tuple[int, int]:
    """(seg_len, num_segs) for a [N, K] weight: a function of the shape and the device only."""
    return _segments(n, k, num_sms(device), config)


@functools.lru_cache(maxsize=None)
def _segments(n: int, k: int, sms: int, config: InvariantConfig) -> tuple[int, int]:
    tiles = triton.cdiv(n, config.block_n)
    blocks = triton.cdiv(k, config.block_k)
    segs = 1
    while (tiles * 2 * segs <= sms and segs < config.max_segs
           and blocks // (2 * segs) >= config.min_seg_blocks):
        segs *= 2
    seg_len = triton.cdiv(blocks, segs) * config.block_k
    return seg_len, triton.cdiv(k, seg_len)


def tma_usable(*operands: torch.Tensor) -> bool:
    """Whether the copy engine can load these 2-D operands' tiles: a Hopper or newer GPU,
    16-byte aligned starts and rows, and the last axis contiguous."""
    first = operands[0]
    if first.device.type != "cuda" or torch.cuda.get_device_capability(first.device)[0] < 9:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.stride(-1) == 1 for t in operands)


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor,
                     out_dtype: torch.dtype | None = None,
                     x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                     config: InvariantConfig = DEFAULT) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] in out_dtype (default x's dtype). With float8
    operands, x_scale ([M] or [M, 1] float32, one per row) and w_scale ([N] float32) scale
    the float32 product before rounding (W8A8); out_dtype is then required."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("invariant_matmul needs the weight's K axis to be contiguous")
    scaled = x_scale is not None
    if scaled != (w_scale is not None):
        raise ValueError("x_scale and w_scale go together")
    if out_dtype is None:
        if scaled:
            raise ValueError("float8 operands need an out_dtype")
        out_dtype = x.dtype
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    seg_len, num_segs = segments_for(n, k, x.device, config)
    tiles_n = triton.cdiv(n, config.block_n)
    tiling = config.tiling(m)
    split = tiling.split and num_segs > 1
    if split:
        # Sized for a full row tile, whatever m: one workspace per weight shape for every
        # decode batch (CUDA graphs keep its address), not one per row count.
        partials, counters = split_k_buffers(x.device, tiles_n, num_segs, tiling.block_m,
                                             config.block_n)
        grid: tuple[int, ...] = (tiles_n, num_segs)
    else:
        partials = counters = out  # never read: SPLIT is off
        tiles = triton.cdiv(m, tiling.block_m) * tiles_n
        persistent = tiling.persistent * num_sms(x.device)
        grid = (min(tiles, persistent) if persistent else tiles,)
    # Two tiles a step only where every segment is whole pairs of tiles (the same dots).
    unroll = tiling.unroll if (seg_len // config.block_k) % tiling.unroll == 0 else 1
    xs = x_scale.reshape(-1) if scaled else out
    ws = w_scale.reshape(-1) if scaled else out
    tma = tiling.tma and tma_usable(x2, weight)
    if tma:
        x_src = TensorDescriptor.from_tensor(x2, [tiling.block_m, config.block_k])
        w_src = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    else:
        x_src, w_src = x2, weight

    def launch(num_stages: int) -> None:
        _invariant_mm_kernel[grid](
            x_src, w_src, out, xs, ws, partials, counters, m, n, k, seg_len, num_segs,
            x2.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=tiling.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, SPLIT=split, SCALED=scaled,
            FLAT=seg_len // config.block_k <= config.flat_max_tiles, UNROLL=unroll, TMA=tma,
            PERSISTENT=bool(tiling.persistent) and not split,
            num_warps=tiling.num_warps, num_stages=num_stages, **pdl_options(x.device))

    launch_within_shared_memory(launch, tiling.num_stages,
                                (tiling, unroll, tma, x2.dtype, x.device))
    return out.view(*x.shape[:-1], n)
