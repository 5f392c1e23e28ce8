"""Vocabulary-sized weights: the token embedding, and the output head when it is untied.

With tensor parallelism the vocabulary is cut into equal shards of ceil(V / tp_size) rows
(`TPInfo.vocab_shard`); the last shard is padded with zero rows past V. A rank embeds the ids
in its shard, zeros elsewhere, and an all-reduce sums the ranks' rows into every embedding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.models.layers.weights import copy_weight, narrow
from radixlm.runtime.parallel.groups import TPInfo, all_gather_last, all_reduce


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tp: TPInfo | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.start, rows = (0, vocab_size) if self.tp is None else self.tp.vocab_shard(
            vocab_size)
        # Real (unpadded) rows of this shard.
        self.num_real = max(0, min(rows, vocab_size - self.start))
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype),
                                   requires_grad=False)
        # The same weights packed for the logits matmul (a GGUF model's quantized output
        # head, radixlm.runtime.models.quantization.cpu_weights.CpuWeights): [N, d] -> [N, V].
        self.packed_logits: nn.Module | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, vocab] float32: this weight used as the output head."""
        if self.packed_logits is not None:
            out = self.packed_logits(hidden.to(torch.bfloat16))
        else:
            out = F.linear(hidden, self.weight)
        if self.tp is not None:  # [N, shard] on each rank -> [N, size * shard], minus padding
            out = all_gather_last(out, self.tp)[:, : self.vocab_size]
        return out.float()

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: int | str | None = None) -> None:
        if self.tp is None:
            copy_weight(param.data, loaded)
            return
        param.data.zero_()  # the padding rows stay zero
        copy_weight(param.data[: self.num_real], narrow(loaded, 0, self.start, self.num_real))
