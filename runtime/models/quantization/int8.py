"""INT8 weight-only: float checkpoints quantized on load, one symmetric scale per output channel.

q = round(w / s) in [-127, 127] with s = max|w_row| / 127, stored offset by 128 in our
runtime INT layout (zero point 128, one group spanning the whole input), so CUDA runs it
through the same Triton kernel as INT4 with 8-bit words; activations stay in float.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.models.quantization.int_weight import (
    IntWeight,
    attach_cpu_weights,
    from_group_quantized,
    int_weight_matmul,
)
from radixlm.runtime.models.quantization.linear_method import (
    LinearMethod,
    ParamSpec,
    RandomWeights,
    replace_parameter,
)
from radixlm.runtime.models.quantization.rtn import GroupQuantized


class Int8LinearMethod(LinearMethod):
    on_cpu = False  # True once repacked for torch's CPU kernel (int_weight.attach_cpu_weights)

    def checkpoint_params(self) -> dict[str, ParamSpec]:
        return {"weight": ParamSpec((self.out_features, self.in_features), self.params_dtype,
                                    out_axis=0)}

    def init_dummy(self, layer: nn.Module, random: RandomWeights) -> None:
        layer.weight.data.copy_(random(tuple(layer.weight.shape), layer.weight.device))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data.float()
        # The scale is rounded to the dtype it is stored in before w is rounded to the grid.
        scale = (w.abs().amax(1, keepdim=True) / 127).to(self.params_dtype).float()
        scale = scale.clamp(min=torch.finfo(self.params_dtype).tiny)  # an all-zero row
        q = (torch.round(w / scale).clamp(-127, 127) + 128).to(torch.int32)
        zeros = torch.full_like(scale, 128, dtype=torch.int32)
        quantized = GroupQuantized(q, scale, zeros)
        packed = from_group_quantized(quantized, 8, -1, self.params_dtype)
        replace_parameter(layer, "weight", None)
        for name, value in (("qweight", packed.qweight), ("scales", packed.scales),
                            ("zeros", packed.zeros)):
            replace_parameter(layer, name, value)
        self.on_cpu = attach_cpu_weights(layer, packed, self.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return layer.cpu_weights(x)
        weight = IntWeight(layer.qweight, layer.scales, layer.zeros, 8, self.in_features)
        return int_weight_matmul(x, weight, invariant=layer.batch_invariant)
