"""Linear layers with their own weight loaders.

Each layer knows how a checkpoint tensor lands in its parameters (`weight_loader`), so tensor
parallelism (shard the rows or columns) and quantized linears (other parameters, another
`forward`) can replace a layer without the model code changing.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.layers.weights import copy_weight


class Linear(nn.Module):
    """y = x @ W.T + b, with W stored [out_features, in_features] as in Hugging Face files."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # torch.empty: weights always come from a loader (checkpoint or dummy init).
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard {shard_id!r}")
        copy_weight(param.data, loaded)


class MergedLinear(Linear):
    """Several linears over the same input fused into one matmul (e.g. gate and up).

    The output rows are the concatenation of the parts; checkpoint tensors arrive per part and
    are written at that part's row offset.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 dtype: torch.dtype | None = None, shard_names: Sequence[str] | None = None):
        super().__init__(in_features, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names or range(len(output_sizes)))
        offsets = [0]
        for size in output_sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = offsets

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id not in self.shard_names:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {self.shard_names}")
        index = self.shard_names.index(shard_id)
        rows = slice(self.offsets[index], self.offsets[index + 1])
        copy_weight(param.data[rows], loaded)


class QKVLinear(MergedLinear):
    """The q, k and v projections fused: rows are [q heads | k heads | v heads]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, dtype, shard_names=["q", "k", "v"])

