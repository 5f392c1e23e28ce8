"""Weight-only quantized matmul in Triton: y = x @ W with W stored as 4-bit (or 8-bit) integers,
a scale and a zero point per group of input channels (W4A16: 4-bit weights, 16-bit activations).

Weights use our runtime INT layout (radixlm.runtime.models.quantization.int_weight):

    qweight [K / pack, N] int32    pack = 32 / BITS values along K, the first in the low bits
    scales  [G, N]                 G = ceil(K / group_size), the activation dtype
    zeros   [G, N] uint8

Kernels, chosen by the number of rows M (`pick_config`; `config` overrides):

- KERNEL "gemv", M <= 4, decode: the one-launch GEMV on CUDA cores of w4a16_gemv.py. Small
  batches are memory-bound: the floor is the packed bytes (K * N / 2 at 4 bits) at the card's
  bandwidth, so each word is loaded once for all rows and split in registers, K is split over
  SPLIT_K programs per column tile for loads in flight, and the last program of a tile adds
  the partial sums (radixlm.kernels.split_k). Tilings measured best on a GPU live in
  w4a16_tuned.py (`benchmarks/quant_speed.py --sweep --write-tuned`), per shape and batch
  size 1, 2 or 4 (and may name any kernel); other shapes use `gemv_config`'s rule.
- KERNEL "gemv_split": the earlier GEMV (`_w4a16_gemv_kernel`, one row per program, split-K
  partials added by a second launch), kept as a fallback and for comparison.
- KERNEL "dot", larger M: tensor-core tiles (`_w4a16_kernel`): each program owns a BLOCK_M x
  BLOCK_N tile, dequantizes a [BLOCK_K, BLOCK_N] block of W per step with the block's one
  group row of scale/zero (BLOCK_K divides the group size), rounds it to the activation dtype
  exactly as the torch reference rounds `(q - z) * s`, and accumulates with tl.dot in float32.

The GEMVs compute in float32 from the exact dequantized weights (no rounding of (q - z) * s
to the activation dtype): the reference's function up to that rounding and the order of the
float32 additions.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from radixlm.kernels.shared_memory import launch_within_shared_memory
from radixlm.kernels.split_k import num_sms, split_for
from radixlm.kernels.w4a16_gemv import MAX_ROWS, int_gemv


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, group_size, k_per_split,
                  stride_xm, stride_qk, stride_sg, stride_zg, stride_os, stride_om,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N]: row k reads word k // PACK, slot k % PACK of it.
        words = tl.load(qw_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :],
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
        q = (words >> ((offs_k % PACK) * BITS)[:, None]) & MASK  # the mask drops sign bits
        group = k0 // group_size
        scale = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n, other=0.0)
        zero = tl.load(z_ptr + group * stride_zg + offs_n, mask=mask_n, other=0).to(tl.int32)
        w = ((q - zero[None, :]).to(tl.float32) * scale[None, :].to(tl.float32)).to(x.dtype)
        if IEEE:  # float32 activations: no TF32 rounding of the inputs
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _as_float(q):
    """Small non-negative int32 -> float32 without the (slow) int-to-float conversion: OR-ing
    q into the mantissa of 2**23 gives the float 2**23 + q exactly."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, K, group_size, k_per_split,
                       stride_xm, stride_qk, stride_sg, stride_zg, stride_os, stride_om,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       MODE: tl.constexpr = 2):
    """One row of x times W on CUDA cores: batch 1 is memory-bound, so tensor cores (and the
    16-row padding tl.dot needs) buy nothing. Each packed word is loaded once and split in
    registers into its PACK values: a [BLOCK_W, PACK, BLOCK_N] tile of weights.

    MODE 2 (a K block inside one group): sum_k x_k (q_kn - z_n) s_n = s_n (sum_k x_k q_kn -
    z_n sum_k x_k), so a weight costs a shift, a mask, a conversion and an FMA, and scale and
    zero are applied once per group and column. MODE 0/1 dequantize every weight (any block
    size), reducing over K inside the loop (0) or once after it (1)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_W)
    slots = tl.arange(0, PACK)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_W, PACK, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_W * PACK):
        words_row = k0 // PACK + offs_w  # [BLOCK_W] word rows of qweight
        mask = ((words_row * PACK < k_end)[:, None]) & mask_n[None, :]
        words = tl.load(qw_ptr + words_row[:, None] * stride_qk + offs_n[None, :], mask=mask,
                        other=0)
        q = _as_float((words[:, None, :] >> (slots * BITS)[None, :, None]) & MASK)
        k = words_row[:, None] * PACK + slots[None, :]  # [W, PACK] input index
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < k_end, other=0.0).to(tl.float32)
        if MODE == 2:
            group = k0 // group_size
            scale = tl.load(s_ptr + group * stride_sg + offs_n, mask=mask_n,
                            other=0.0).to(tl.float32)
            zero = _as_float(tl.load(z_ptr + group * stride_zg + offs_n, mask=mask_n,
                                     other=0).to(tl.int32))
            dot = tl.sum(tl.sum(x[:, :, None] * q, axis=1), axis=0)
            acc += scale * (dot - zero * tl.sum(tl.sum(x, axis=1), axis=0))
        else:
            # The group of each word row (PACK divides the group size).
            group = (words_row * PACK) // group_size
            scale = tl.load(s_ptr + group[:, None] * stride_sg + offs_n[None, :], mask=mask,
                            other=0.0).to(tl.float32)
            zero = _as_float(tl.load(z_ptr + group[:, None] * stride_zg + offs_n[None, :],
                                     mask=mask, other=0).to(tl.int32))
            w = (q - zero[:, None, :]) * scale[:, None, :]
            if MODE == 1:
                acc3 += x[:, :, None] * w
            else:
                acc += tl.sum(tl.sum(x[:, :, None] * w, axis=1), axis=0)
    if MODE == 1:
        acc = tl.sum(tl.sum(acc3, axis=1), axis=0)
    tl.store(out_ptr + pid_k * stride_os + row * stride_om + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _sum_splits_kernel(parts_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum of the SPLIT float32 partial results, rounded once to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT):
        acc += tl.load(parts_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_k_for(group_size: int) -> int:
    """The K step: a power of two (16 to 128) dividing the group size, or 0 if none does."""
    block = math.gcd(group_size, 128)
    return block if block >= 16 and block & (block - 1) == 0 else 0


def supports(x: torch.Tensor, qweight: torch.Tensor, group_size: int, bits: int) -> bool:
    return (bits in (4, 8) and block_k_for(group_size) > 0 and x.dtype in
            (torch.float16, torch.bfloat16, torch.float32) and x.stride(-1) == 1
            and qweight.is_contiguous())


def tuned_config(device: torch.device, m: int, n: int, k: int, group_size: int,
                 bits: int) -> dict | None:
    """The configuration measured best for this GPU, shape and batch size, if one was recorded
    (`benchmarks/quant_speed.py --sweep --write-tuned` writes radixlm/kernels/w4a16_tuned.py)."""
    if m > GEMV_MAX_ROWS:
        return None
    return tuned_entry(device, f"{bits}:{group_size}:{n}:{k}:{rows_key(m)}")


def rows_key(m: int) -> str:
    """Batch sizes 1, 2 and 4 are measured; 3 runs as 4 would."""
    return f"m{m if m <= 2 else 4}"


def tuned_entry(device: torch.device, key: str) -> dict | None:
    """An entry of the measured table for this GPU (also holds the fp8 GEMV's, "fp8:N:K:m1")."""
    if device.type != "cuda":
        return None
    return _tuned_table().get(_device_name(device), {}).get(key)


@functools.lru_cache(maxsize=None)
def _tuned_table() -> dict:
    try:
        from radixlm.kernels.w4a16_tuned import TUNED
    except ImportError:  # a build without the table: the rules alone
        return {}
    return TUNED


@functools.lru_cache(maxsize=None)
def _cached_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name(device: torch.device) -> str:
    return _cached_name(device.index if device.index is not None
                        else torch.cuda.current_device())


GEMV_MAX_ROWS = MAX_ROWS  # up to this many rows: the GEMV, each weight read once for all rows


def gemv_config(m: int, n: int, k: int, group_size: int, bits: int,
                device: torch.device) -> dict:
    """The GEMV's tiling by rule, for shapes without a measured entry: what the H200 sweep
    (benchmarks/quant_speed.py --sweep) found best on every 8B linear at 1, 2 and 4 rows.

    64 threads per program on [BLOCK_W=16, BLOCK_N=64] word tiles (K blocks of 128 inputs at
    4 bits, fewer when the group is smaller). K is split (in powers of two, at most 16 ways)
    until there are ~8 programs per SM at one row, fewer with more rows (each program then
    does more arithmetic per weight it loads): within 10% of the best tiling measured on each
    shape, where the previous rule (128 columns, 4 warps, 4 programs per SM) lost up to 1.8x
    at 4 rows."""
    pack = 32 // bits
    words = math.gcd(group_size // pack, 16)  # K blocks inside one group
    tiles, blocks = triton.cdiv(n, 64), triton.cdiv(k, words * pack)
    per_sm = max(1, 8 // max(1, m))
    return dict(KERNEL="gemv", BLOCK_N=64, BLOCK_W=words, num_warps=2,
                SPLIT_K=split_for(tiles, blocks, num_sms(device), programs_per_sm=per_sm))


def pick_config(m: int, n: int, k: int, group_size: int, bits: int,
                device: torch.device) -> dict:
    """Kernel, tiles and K split by batch size. Small batches are memory-bound: the GEMV
    (a measured entry if there is one, else `gemv_config`). Large batches are compute-bound:
    tensor-core tiles, K split only when the tiles alone would leave SMs idle."""
    if m <= GEMV_MAX_ROWS:
        tuned = tuned_config(device, m, n, k, group_size, bits)
        return (dict(tuned) if tuned is not None
                else gemv_config(m, n, k, group_size, bits, device))
    block_k = block_k_for(group_size)
    if m <= 64:
        cfg = dict(KERNEL="dot", BLOCK_M=64 if m > 16 else 16, BLOCK_N=64, num_warps=4,
                   num_stages=4)
    else:
        cfg = dict(KERNEL="dot", BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
        block_k = min(block_k, 64)
    cfg["BLOCK_K"] = block_k
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    split = max(1, min(triton.cdiv(k, block_k), triton.cdiv(4 * num_sms(device), tiles)))
    return dict(cfg, SPLIT_K=split)


def invariant_config(group_size: int) -> dict:
    """Deterministic inference: the tensor-core kernel with one tiling for every row count and
    K never split, so an output's sum over K runs in the same order whatever M is (slower
    than the GEMVs at a few rows)."""
    return dict(KERNEL="dot", BLOCK_M=64, BLOCK_N=64, BLOCK_K=min(block_k_for(group_size), 64),
                num_warps=4, num_stages=4, SPLIT_K=1)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group_size: int, bits: int = 4,
                 config: dict | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ W -> [M, N] in x's dtype. `config` overrides the choice
    of kernel and tiling: KERNEL "gemv" (M <= 4; BLOCK_N, BLOCK_W words along K inside one
    group), "gemv_split" (BLOCK_N, BLOCK_W, MODE) or "dot" (BLOCK_M/N/K, BLOCK_K dividing
    group_size), and SPLIT_K, num_warps, num_stages."""
    m, k = x.shape
    n = qweight.shape[1]
    cfg = dict(config or pick_config(m, n, k, group_size, bits, x.device))
    kernel = cfg.pop("KERNEL")
    if kernel == "gemv":
        return int_gemv(x, qweight, scales, zeros, group_size, bits, **cfg)
    if kernel not in ("gemv_split", "dot"):
        raise ValueError(f"unknown W4A16 kernel {kernel!r}")
    split = cfg.pop("SPLIT_K")
    pack = 32 // bits
    if kernel == "gemv_split":
        block_k = cfg["BLOCK_W"] * pack
        if group_size % pack:
            raise ValueError(f"the group size {group_size} must be a multiple of {pack}")
        if cfg.get("MODE", 2) == 2 and group_size % block_k:
            raise ValueError(f"GEMV MODE 2 needs K blocks ({block_k}) inside one group "
                             f"({group_size})")
    else:
        block_k = cfg.pop("BLOCK_K")
        if group_size % block_k:
            raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size}")
    # Each split gets a whole number of K blocks, so no block straddles two splits.
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32,
                      device=x.device)
    if m == 0:
        return out.sum(0).to(x.dtype)
    args = (x, qweight, scales, zeros, out)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0),
               out.stride(0), out.stride(1))
    if kernel == "gemv_split":
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), split, m)
        _w4a16_gemv_kernel[grid](*args, n, k, group_size, k_per_split, *strides, BITS=bits,
                                 **cfg)
    else:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
        stages = cfg.pop("num_stages", 3)

        def launch(num_stages: int) -> None:
            _w4a16_kernel[grid](*args, m, n, k, group_size, k_per_split, *strides, BITS=bits,
                                BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                                num_stages=num_stages, **cfg)

        # The tiles of 17-64 rows (BLOCK_K 128, 4 stages) take 119-132 KB of shared memory:
        # more than consumer cards' 99 KB.
        launch_within_shared_memory(launch, stages, ("w4a16", tuple(sorted(cfg.items())),
                                                     block_k, bits, x.dtype, x.device))
    if split == 1:
        return out[0]
    result = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](out, result, m * n, SPLIT=split,
                                                    BLOCK=1024)
    return result
