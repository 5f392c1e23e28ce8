"""Vocabulary-sized weights: the token embedding, and the output head when it is untied."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.layers.weights import copy_weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        copy_weight(param.data, loaded)
