"""GGUF blocks run as they are: each decoder linear is one or two 4-bit planes (see
gguf_blocks) multiplied by torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`).

The kernel takes bfloat16 activations and a bfloat16 (scale, zero) pair per 32 inputs, so the
weights it computes with differ from the file's only by the rounding of those scales to
bfloat16; 4-bit codes are read as they are (a Q4_1 layer reads 0.625 bytes per weight where its
float16 dequantization would read 2). A merged layer (qkv, gate_up) stacks its parts' planes;
a part with one plane gets an all-zero second plane when another part needs two.

A part whose type the converter could not keep as blocks (Q6_K and the other 16-input
scale types) arrives as float weights: the layer then runs as a dense bfloat16 matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.models.quantization.base import (
    LinearMethod,
    ParamSpec,
    RandomWeights,
    replace_parameter,
)
from radixlm.runtime.models.quantization.gguf_blocks import (
    GROUP,
    GGUFBlocks,
    Plane,
)


class Int4Planes(nn.Module):
    """y = x @ W.T for W given as 4-bit planes, through torch's CPU int4 kernel: per plane a
    packed [N, K / 2] uint8 weight and bfloat16 (scale, zero) pairs [K / 32, N, 2]."""

    def __init__(self, planes: list[Plane]) -> None:
        super().__init__()
        self.num_planes = len(planes)
        for index, (codes, scale, zero) in enumerate(planes):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), 1)
            scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16)
            self.register_buffer(f"qweight{index}", packed)
            self.register_buffer(f"scales_zeros{index}", scales_zeros.contiguous())
        self._weights = [(getattr(self, f"qweight{i}"), getattr(self, f"scales_zeros{i}"))
                         for i in range(self.num_planes)]

    @staticmethod
    def stack(parts: list[list[Plane]], rows: list[int], columns: int) -> "Int4Planes":
        """Planes of several parts stacked along the rows (a merged layer's parts)."""
        count = max(len(planes) for planes in parts)
        return Int4Planes([
            Plane(*(torch.cat(t) for t in zip(*(
                planes[index] if index < len(planes) else _empty_plane(n, columns)
                for planes, n in zip(parts, rows)))))
            for index in range(count)])

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(packed, scales_zeros) of each plane."""
        return list(self._weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 -> [M, N] bfloat16."""
        (first, first_sz), *rest = self._weights
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, first, GROUP, first_sz)
        for packed, scales_zeros in rest:
            out += torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
        return out


class GGUFLinearMethod(LinearMethod):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._parts: dict[int, GGUFBlocks | torch.Tensor] = {}  # until packed
        self.dense = False  # True: a part was not blocks; the layer runs a bfloat16 matmul

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
        shape = (loaded.shape if isinstance(loaded, GGUFBlocks)
                 else tuple(getattr(loaded, "shape", ())))
        if tuple(shape) != (rows, cols):
            raise ValueError(f"GGUF weight of shape {tuple(shape)} for a part of "
                             f"{rows} x {cols}")
        self._parts[part] = loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [self._parts.pop(i) for i in range(len(self.output_sizes))]
        replace_parameter(layer, "weight", None)
        if all(isinstance(p, GGUFBlocks) for p in parts):
            layer.planes = Int4Planes.stack([p.planes() for p in parts], self.output_sizes,
                                            self.in_features)
        else:
            self.dense = True
            dense = torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float()
                               for p in parts])
            replace_parameter(layer, "dense_weight", dense.to(torch.bfloat16))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = F.linear(x2, layer.dense_weight) if self.dense else layer.planes(x2)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


def _empty_plane(rows: int, columns: int) -> Plane:
    """A plane that adds nothing: codes 8 (the kernel's zero point), scale and zero 0."""
    groups = (rows, columns // GROUP)
    return Plane(torch.full((rows, columns), 8, dtype=torch.uint8), torch.zeros(groups),
                 torch.zeros(groups))
