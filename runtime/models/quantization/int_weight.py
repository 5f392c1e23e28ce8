"""Integer weights in our runtime layout, and the matmul over them (INT4 AWQ/GPTQ, INT8).

    qweight [K / pack, N] int32   GPTQ's layout: packed along the input, values in order
    scales  [G, N]                activation dtype; G = ceil(K / group_size)
    zeros   [G, N] uint8          zero points
    perm    [K] int64 or None     act-order: input channel i of the packed weight reads
                                  x[..., perm[i]] (groups are contiguous after sorting)

W[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n] and y = x @ W. On CUDA the
Triton kernel (radixlm.kernels.w4a16) dequantizes tile by tile and never materialises W. On
CPU a bfloat16 model repacks the weight once into int4 planes for torch's CPU kernel
(`attach_cpu_weights`); a float32 model rebuilds W per call and multiplies, which computes the
same function exactly (the reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm.runtime.models.quantization.cpu_weights import (
    CpuWeights,
    integer_planes,
    kernel_group,
)
from radixlm.runtime.models.quantization.linear_method import replace_parameter
from radixlm.runtime.models.quantization.packing import pack_gptq_weight, unpack_gptq_weight
from radixlm.runtime.models.quantization.rtn import GroupQuantized


class IntWeight(NamedTuple):
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int  # never -1 here: the whole input is group_size == K


def from_group_quantized(quantized: GroupQuantized, bits: int, group_size: int,
                         dtype: torch.dtype) -> IntWeight:
    """Rows-are-outputs quantizer output ([N, K] q, [N, G] scales/zeros) -> runtime layout."""
    q, scales, zeros = quantized
    group = q.shape[1] if group_size <= 0 else group_size
    return IntWeight(pack_gptq_weight(q.t(), bits), scales.t().to(dtype).contiguous(),
                     zeros.t().to(torch.uint8).contiguous(), bits, group)


def dequantize(weight: IntWeight) -> torch.Tensor:
    """The [K, N] matrix in the scales' dtype."""
    q = unpack_gptq_weight(weight.qweight, weight.bits)  # [K, N]
    k = q.shape[0]
    # Rows k of a group share zero/scale; expand per row (the last group may be shorter).
    zeros = weight.zeros.repeat_interleave(weight.group_size, dim=0)[:k]
    scales = weight.scales.repeat_interleave(weight.group_size, dim=0)[:k]
    return (q - zeros.to(torch.int32)).to(scales.dtype) * scales


def attach_cpu_weights(layer: torch.nn.Module, weight: IntWeight, params_dtype: torch.dtype,
                       perm: torch.Tensor | None = None) -> bool:
    """On the CPU with bfloat16 activations: repack the weight into `layer.cpu_weights` (int4
    planes) and drop the GPTQ-layout tensors. False (nothing changed) elsewhere, or when the
    kernel's group sizes (32-256) cannot tile the format's groups."""
    k = weight.qweight.shape[0] * 32 // weight.bits
    group = kernel_group(weight.group_size, k)
    if weight.qweight.device.type != "cpu" or params_dtype != torch.bfloat16 or group is None:
        return False
    codes = unpack_gptq_weight(weight.qweight, weight.bits).t()  # [N, K]
    repeat = weight.group_size // group
    # [G, N] per format group -> [N, K / group] per kernel group (the last group may be short)
    scale = weight.scales.float().t().repeat_interleave(repeat, dim=1)[:, : k // group]
    zero = weight.zeros.float().t().repeat_interleave(repeat, dim=1)[:, : k // group]
    layer.cpu_weights = CpuWeights(integer_planes(codes.to(torch.int32), scale, zero),
                                   perm=perm)
    for name in ("qweight", "scales", "zeros"):
        replace_parameter(layer, name, None)
    return True


def int_weight_matmul(x: torch.Tensor, weight: IntWeight, perm: torch.Tensor | None = None,
                      invariant: bool = False) -> torch.Tensor:
    """x [..., K] @ W -> [..., N] in x's dtype. invariant (deterministic inference): the
    tensor-core kernel with one tiling and no K split for every row count."""
    if perm is not None:
        x = x.index_select(-1, perm)
    k, n = x.shape[-1], weight.scales.shape[1]
    x2 = x.reshape(-1, k)
    if x.is_cuda:
        from radixlm.kernels import w4a16

        if w4a16.supports(x2, weight.qweight, weight.group_size, weight.bits):
            config = w4a16.invariant_config(weight.group_size) if invariant else None
            out = w4a16.w4a16_matmul(x2, weight.qweight, weight.scales, weight.zeros,
                                     weight.group_size, weight.bits, config)
            return out.view(*x.shape[:-1], n)
    w = dequantize(weight)
    return (x2 @ w.to(x.dtype)).view(*x.shape[:-1], n)
