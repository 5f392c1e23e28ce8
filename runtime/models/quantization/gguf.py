"""GGUF blocks run as they are: each decoder linear is one or two 4-bit planes (see
gguf_blocks), held as our CPU kernel's tiles (cpu_weights.CpuWeights), or, where the kernel
cannot be built, multiplied by torch's CPU int4 kernel.

Codes are read as they are (a Q4_1 layer reads 0.625 bytes per weight where its float16
dequantization would read 2), and K-quants' scales as the file factors them (a byte per
sub-block under the block's float16 d). A merged layer (qkv, gate_up) whose parts are of
different types (Q4_K_M's Q4_K q and k beside a Q6_K v) runs each run of parts of one form as
its own segment of the outputs (CpuWeights.stack).

A part whose type the converter could not keep as blocks (Q3_K, Q2_K, float) arrives as float
weights: the layer then runs as dense bfloat16 tiles.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.models.quantization.cpu_weights import CpuWeights
from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks
from radixlm.runtime.models.quantization.linear_method import (
    LinearMethod,
    ParamSpec,
    RandomWeights,
    replace_parameter,
)


class GGUFLinearMethod(LinearMethod):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._parts: dict[int, GGUFBlocks | torch.Tensor] = {}  # until packed

    def checkpoint_params(self) -> dict[str, ParamSpec]:
        # The blocks' shape depends on each part's type: the parameter is a placeholder and
        # `load` keeps the parts until process_weights_after_loading packs them.
        return {"weight": ParamSpec((0,), torch.uint8, out_axis=None)}

    def init_dummy(self, layer: nn.Module, random: RandomWeights) -> None:
        raise ValueError("quantization='gguf' needs a GGUF model; load_format='dummy' has "
                         "no blocks (use int8 or fp8 for quantized random weights)")

    def load(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: object,
             part: int) -> None:
        rows, cols = self.output_sizes[part], self.in_features
        if tuple(loaded.shape) != (rows, cols):  # blocks or (dequantized) float weights
            raise ValueError(f"GGUF weight of shape {tuple(loaded.shape)} for a part of "
                             f"{rows} x {cols}")
        self._parts[part] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [self._parts.pop(i) for i in range(len(self.output_sizes))]
        replace_parameter(layer, "weight", None)
        if all(isinstance(p, GGUFBlocks) for p in parts):
            layer.cpu_weights = CpuWeights.stack([p.planes() for p in parts],
                                                 self.output_sizes, self.in_features)
        else:
            layer.cpu_weights = CpuWeights(dense=torch.cat([
                p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in parts]))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.cpu_weights(x)
