"""The gated MLP, down(act(gate(x)) * up(x)), with a choice of activation.

Used by the families outside the Llama module: Gemma's GELU-tanh MLP, and the dense layers and
shared expert of the MoE families. Tensor parallelism splits the intermediate channels like
the Llama MLP: gate_up column-parallel, down row-parallel with an all-reduce.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.layers.linear import Linear, LinearShard, MergedLinear
from radixlm.runtime.models.quantization.quant_config import QuantConfig


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act / hidden_activation in config.json -> the function.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str,
                 dtype: torch.dtype, bias: bool = False, quant: QuantConfig | None = None,
                 tp: TPInfo | None = None) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        start, size = 0, intermediate_size
        up_shard = down_shard = None
        if tp is not None:
            start, size = tp.split(intermediate_size, "intermediate_size")
            up_shard = LinearShard(part_starts=(start, start))
            down_shard = LinearShard(in_start=start)
        self.gate_up_proj = MergedLinear(hidden_size, [size] * 2, bias=bias, dtype=dtype,
                                         quant=quant, shard=up_shard)
        self.down_proj = Linear(size, hidden_size, bias=bias, dtype=dtype, quant=quant,
                                shard=down_shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
