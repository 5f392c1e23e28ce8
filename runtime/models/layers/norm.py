"""RMSNorm, normalised in float32 whatever the activation dtype (as the reference models do).

`OffsetRMSNorm` is Gemma's: the checkpoint stores w and the layer scales by (1 + w), in float32
before rounding (where Llama rounds first, then scales by w).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.models.weights.loading import copy_weight


class RMSNorm(nn.Module):
    unit_weight = 1.0  # the stored weight that leaves the normalised input unscaled

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        # Deterministic inference on CUDA: radixlm.kernels.fused.rms_norm, one program per
        # row. torch's reductions may split a row over several blocks when there are few rows,
        # so a row's sum would depend on how many rows share the call.
        self.kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        # rms_norm accumulates in float32 for low-precision inputs, then rounds to x's dtype,
        # as the reference implementation does before applying the weight.
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        copy_weight(param.data, loaded)


class OffsetRMSNorm(RMSNorm):
    unit_weight = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
