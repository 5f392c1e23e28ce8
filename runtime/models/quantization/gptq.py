"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`): INT4 or INT8 weights, one
scale and zero point per group of input channels and output channel.

    qweight [K / pack, N] int32   packed along the input (pack = 32 / bits), values in order
    qzeros  [G, N / pack] int32   packed along the output; v1 stores zero - 1
    scales  [G, N] float16
    g_idx   [K] int32             the group of each input channel

W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]. Without act-order g_idx[k] is
k // group_size. With act-order (`desc_act`) columns were quantized in order of decreasing
Hessian diagonal, so a group is a scattered set of input channels: we sort the channels by
g_idx once after loading (repacking qweight), which makes groups contiguous again, and gather
the activations by the same permutation at every call (x[..., perm]), as exllama does. For a
merged layer, q/k/v (or gate/up) must share g_idx: they do when quantized from the same inputs.
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
from radixlm.runtime.models.quantization.packing import (
    pack_gptq_weight,
    pack_gptq_zeros,
    unpack_gptq_weight,
    unpack_gptq_zeros,
)
from radixlm.runtime.models.quantization.rtn import rtn_quantize


class GPTQLinearMethod(LinearMethod):
    on_cpu = False  # True once repacked for torch's CPU kernel (int_weight.attach_cpu_weights)

    has_perm = False  # set once loading finds an act-order g_idx

    def checkpoint_params(self) -> dict[str, ParamSpec]:
        k, n, bits = self.in_features, self.out_features, self.config.bits
        pack = 32 // bits
        if k % pack or any(size % pack for size in self.output_sizes):
            raise ValueError(f"GPTQ {bits}-bit packs {pack} values per int32; a layer with "
                             f"{k} inputs and parts {self.output_sizes} does not divide")
        groups = -(-k // self.group)
        return {"qweight": ParamSpec((k // pack, n), torch.int32, out_axis=1),
                "qzeros": ParamSpec((groups, n // pack), torch.int32, out_axis=1,
                                    out_pack=pack),
                "scales": ParamSpec((groups, n), self.params_dtype, out_axis=1),
                # Always accepted; only act-order checkpoints must have it.
                "g_idx": ParamSpec((k,), torch.int32, out_axis=None,
                                   required=self.config.desc_act)}

    @property
    def v1(self) -> bool:
        return self.config.checkpoint_format == "gptq"

    def init_dummy(self, layer: nn.Module, random: RandomWeights) -> None:
        bits = self.config.bits
        w = random((self.out_features, self.in_features), layer.qweight.device)
        q, scales, zeros = rtn_quantize(w, bits, self.group, sym=not self.config.zero_point)
        layer.qweight.data.copy_(pack_gptq_weight(q.t(), bits))
        layer.qzeros.data.copy_(pack_gptq_zeros(zeros.t(), bits, self.v1))
        layer.scales.data.copy_(scales.t())
        g_idx = torch.arange(self.in_features, device=w.device) // self.group
        self.load(layer, "g_idx", layer.g_idx, g_idx.to(torch.int32), 0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bits = self.config.bits
        zeros = unpack_gptq_zeros(layer.qzeros.data, bits, self.v1).to(torch.uint8)
        perm = self._act_order_perm(layer)
        if perm is not None:
            q = unpack_gptq_weight(layer.qweight.data, bits)[perm]  # rows in group order
            replace_parameter(layer, "qweight", pack_gptq_weight(q, bits))
            layer.register_buffer("perm", perm)
            self.has_perm = True
        replace_parameter(layer, "qzeros", None)
        replace_parameter(layer, "g_idx", None)
        replace_parameter(layer, "zeros", zeros)
        self.on_cpu = attach_cpu_weights(
            layer, IntWeight(layer.qweight, layer.scales, layer.zeros, bits, self.group),
            self.params_dtype, perm)

    def _act_order_perm(self, layer: nn.Module) -> torch.Tensor | None:
        """The input order that makes each group contiguous, or None if it already is."""
        if not self.loaded_shared("g_idx"):
            return None
        g_idx = layer.g_idx.data.long()
        contiguous = torch.arange(self.in_features, device=g_idx.device) // self.group
        if torch.equal(g_idx, contiguous):
            return None
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError(f"g_idx does not put {self.group} input channels in each group; "
                             "this GPTQ layout is not supported")
        return perm

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return layer.cpu_weights(x)
        weight = IntWeight(layer.qweight, layer.scales, layer.zeros, self.config.bits,
                           self.group)
        return int_weight_matmul(x, weight, layer.perm if self.has_perm else None,
                                 layer.batch_invariant)
