"""RMSNorm, computed in float32 whatever the activation dtype (as the reference models do)."""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.layers.weights import copy_weight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        copy_weight(param.data, loaded)
