"""AWQ checkpoints (AutoAWQ's GEMM layout, `quant_method: awq`): INT4 weights, one scale and
zero point per `group_size` input channels and output channel.

    qweight [K, N / 8] int32   packed along the output, in AWQ's word order (packing.py)
    qzeros  [G, N / 8] int32   the same packing
    scales  [G, N] float16     W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]

AWQ's activation-aware scaling is already folded into the checkpoint (the weights were scaled
up per input channel, the preceding norm or linear scaled down), so running it is plain
group dequantization. After loading, the tensors are repacked into our runtime layout
(int_weight.py), which the Triton kernel reads.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.models.quantization.int_weight import (
    IntWeight,
    attach_cpu_weights,
    int_weight_matmul,
)
from radixlm.runtime.models.quantization.linear_method import (
    LinearMethod,
    ParamSpec,
    RandomWeights,
    replace_parameter,
)
from radixlm.runtime.models.quantization.packing import pack_awq, pack_gptq_weight, unpack_awq
from radixlm.runtime.models.quantization.rtn import rtn_quantize


class AWQLinearMethod(LinearMethod):
    on_cpu = False  # True once repacked for torch's CPU kernel (int_weight.attach_cpu_weights)

    def checkpoint_params(self) -> dict[str, ParamSpec]:
        k, n = self.in_features, self.out_features
        groups = -(-k // self.group)
        if any(size % 8 for size in self.output_sizes):
            raise ValueError(f"AWQ packs 8 output channels per int32; part sizes "
                             f"{self.output_sizes} are not all multiples of 8")
        return {"qweight": ParamSpec((k, n // 8), torch.int32, out_axis=1, out_pack=8),
                "qzeros": ParamSpec((groups, n // 8), torch.int32, out_axis=1, out_pack=8),
                "scales": ParamSpec((groups, n), self.params_dtype, out_axis=1)}

    def init_dummy(self, layer: nn.Module, random: RandomWeights) -> None:
        w = random((self.out_features, self.in_features), layer.qweight.device)
        q, scales, zeros = rtn_quantize(w, 4, self.group, sym=False)
        layer.qweight.data.copy_(pack_awq(q.t()))
        layer.qzeros.data.copy_(pack_awq(zeros.t()))
        layer.scales.data.copy_(scales.t())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_awq(layer.qweight.data)  # [K, N]
        zeros = unpack_awq(layer.qzeros.data).to(torch.uint8)  # [G, N]
        replace_parameter(layer, "qzeros", None)
        replace_parameter(layer, "qweight", pack_gptq_weight(q, 4))
        replace_parameter(layer, "zeros", zeros)
        self.on_cpu = attach_cpu_weights(
            layer, IntWeight(layer.qweight, layer.scales, layer.zeros, 4, self.group),
            self.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return layer.cpu_weights(x)
        weight = IntWeight(layer.qweight, layer.scales, layer.zeros, 4, self.group)
        return int_weight_matmul(x, weight, invariant=layer.batch_invariant)
