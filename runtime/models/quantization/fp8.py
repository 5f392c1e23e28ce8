"""FP8 W8A8: e4m3 weights with a scale per output channel, e4m3 activations with a scale per
token computed on the fly.

    weight [N, K] float8_e4m3fn, weight_scale [N] float32:   W = weight * weight_scale[:, None]
    x_scale = max|x_row| / 448 (448 is e4m3's largest value), x8 = e4m3(x / x_scale)
    y = (x8 * x_scale) @ W.T

On Hopper (and Ada), 1-2 rows (decode) go through our fp8 GEMV (radixlm.kernels.fp8:
one read of the weight at the card's bandwidth, where `_scaled_mm`, a GEMM, is slower than
bf16 at batch 1); more rows through one `torch._scaled_mm` with row-wise scales: fp8 tensor
cores, fp32 accumulation. Both compute the same function up to the order of the float32
additions. Elsewhere (CPU, older GPUs) the fallback dequantizes both operands and multiplies
in float32: the same function, up to accumulation order and the output rounding.

Weights come from a float checkpoint (quantized after loading) or from an FP8 checkpoint
(`quant_method: fp8`): per-tensor `weight_scale`s (one per q/k/v part of a merged layer) are
spread over the part's channels; a static `input_scale` is read past, since a per-token scale
is never coarser. A block-wise FP8 checkpoint (`weight_block_size`) does not come here: its
weights are dequantized into float ones at load (block_fp8.py), which this method may then
quantize per channel like any float checkpoint's.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from radixlm.runtime.models.quantization.cpu_weights import CpuWeights
from radixlm.runtime.models.quantization.linear_method import (
    LinearMethod,
    ParamSpec,
    RandomWeights,
    replace_parameter,
)
from radixlm.runtime.models.weights.loading import copy_weight

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: [M, K] -> ([M, K] e4m3, [M, 1] float32 scales)."""
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               use_scaled_mm: bool | None = None, invariant: bool = False) -> torch.Tensor:
    """x [..., K] (float) times an e4m3 weight [N, K] with per-channel scales [N] -> [..., N]
    in x's dtype. use_scaled_mm None: on a device with fp8 tensor cores, the fp8 GEMV for up
    to GEMV_ROWS rows and `_scaled_mm` beyond; True or False forces `_scaled_mm` or the
    fallback. invariant (deterministic inference, CUDA): one batch-invariant kernel for every
    row count instead (radixlm.kernels.invariant_matmul), the activations quantized per row
    as always."""
    k, n = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x.is_cuda and x2.stride(-1) == 1 and k <= 65536:
        from radixlm.kernels.fp8 import per_token_fp8

        x8, x_scale = per_token_fp8(x2)  # one kernel instead of six
    else:
        x8, x_scale = quantize_fp8_rows(x2)
    if invariant and x.is_cuda:
        from radixlm.kernels.invariant_matmul import invariant_matmul

        out = invariant_matmul(x8, weight, x.dtype, x_scale, weight_scale.float())
        return out.view(*x.shape[:-1], n)
    if use_scaled_mm is None:
        if _use_gemv(x8, weight):
            from radixlm.kernels.fp8 import fp8_gemv

            out = fp8_gemv(x8, x_scale, weight, weight_scale.float(), x.dtype)
            return out.view(*x.shape[:-1], n)
        use_scaled_mm = scaled_mm_available(x.device) and k % 16 == 0 and n % 16 == 0
    if use_scaled_mm:
        # Row-wise scaling wants a row-major A, a column-major B and a bf16 output.
        out = torch._scaled_mm(x8, weight.t(), scale_a=x_scale,
                               scale_b=weight_scale.view(1, n).float(),
                               out_dtype=torch.bfloat16)
    else:
        out = (x8.float() * x_scale) @ (weight.float() * weight_scale.view(n, 1).float()).t()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def scaled_mm_available(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:  # a query per linear would cost host time
    return torch.cuda.get_device_capability(index)


# Up to this many rows fp8_linear takes the GEMV (which serves up to 4). Measured on an H200
# (benchmarks/quant_speed.py --sweep): at 1-2 rows it beats _scaled_mm by up to 1.7x on the 8B
# linears; at 4 rows _scaled_mm wins on most of them (gate_up: 45 against 87 µs).
GEMV_ROWS = 2


def _use_gemv(x8: torch.Tensor, weight: torch.Tensor) -> bool:
    """Decode-sized batches on a GPU with native e4m3 conversions (the GEMV's fp8 loads)."""
    return (x8.shape[0] <= GEMV_ROWS and scaled_mm_available(x8.device)
            and weight.stride(-1) == 1)


class Fp8LinearMethod(LinearMethod):
    on_cpu = False  # True once its weights are bfloat16 on the CPU (cpu_weights)

    ignored_checkpoint_names = ("input_scale",)

    def checkpoint_params(self) -> dict[str, ParamSpec]:
        shape = (self.out_features, self.in_features)
        if not self.config.prequantized:
            return {"weight": ParamSpec(shape, self.params_dtype, out_axis=0)}
        return {"weight": ParamSpec(shape, FP8, out_axis=0),
                "weight_scale": ParamSpec((self.out_features,), torch.float32, out_axis=0)}

    def load(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor,
             part: int) -> None:
        if name != "weight_scale":
            return super().load(layer, name, param, loaded, part)
        rows = self.part_view(param.data, self.specs[name], part)
        if loaded.numel() == 1:  # per-tensor: one scale for every channel of the part
            rows.fill_(loaded.reshape(()).item())
        else:  # per-channel: [rows] or [rows, 1]
            copy_weight(rows, loaded.reshape(-1))

    def init_dummy(self, layer: nn.Module, random: RandomWeights) -> None:
        w = random((self.out_features, self.in_features), layer.weight.device)
        if self.config.prequantized:
            w8, scale = quantize_fp8_rows(w)
            layer.weight.data.copy_(w8)
            layer.weight_scale.data.copy_(scale.view(-1))
        else:
            layer.weight.data.copy_(w)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.prequantized:
            # Weights quantized per output channel: the same rule as activations, per row.
            w8, scale = quantize_fp8_rows(layer.weight.data)
            replace_parameter(layer, "weight", w8)
            replace_parameter(layer, "weight_scale", scale.view(-1))
        if layer.weight.device.type == "cpu" and self.params_dtype == torch.bfloat16:
            # No fast fp8 matmul on the CPU (_scaled_mm takes milliseconds): the rounded
            # weights run as bfloat16, half float32's bytes (cpu_weights).
            dense = layer.weight.float() * layer.weight_scale.float().view(-1, 1)
            layer.cpu_weights = CpuWeights(dense=dense)
            replace_parameter(layer, "weight", None)
            replace_parameter(layer, "weight_scale", None)
            self.on_cpu = True

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return layer.cpu_weights(x)
        return fp8_linear(x, layer.weight, layer.weight_scale,
                          invariant=layer.batch_invariant)
