"""RMSNorm, normalised in float32 whatever the activation dtype (as the reference models do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.models.layers.weights import copy_weight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # rms_norm accumulates in float32 for low-precision inputs, then rounds to x's dtype,
        # as the reference implementation does before applying the weight.
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        copy_weight(param.data, loaded)
