"""Vocabulary-sized weights: the token embedding, and the output head when it is untied.

With tensor parallelism the vocabulary is cut into equal shards of ceil(V / tp_size) rows
(`TPInfo.vocab_shard`); the last shard is padded with zero rows past V. A rank embeds the ids
in its shard, zeros elsewhere, and an all-reduce sums the ranks' rows into every embedding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.groups import TPInfo, all_gather_last, all_gather_rows, all_reduce
from radixlm.runtime.models.weights.loading import copy_weight, narrow


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
        # The same weights packed for the logits matmul on the CPU (a GGUF model's quantized
        # output head, or the CPU kernel's tiles of a float one: cpu_weights.CpuWeights):
        # [N, d] -> [N, V].
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
        out = self._shard_logits(hidden)
        if self.tp is not None:  # [N, shard] on each rank -> [N, size * shard], minus padding
            out = all_gather_last(out, self.tp)[:, : self.vocab_size]
        return out.float()

    def greedy(self, hidden: torch.Tensor,
               final: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """[N, d] -> [N] int64: argmax over the vocabulary of final(logits(hidden)), the
        first of equal maxima as torch.argmax picks it (`final` must be elementwise). With
        tensor parallelism each rank reduces its shard to (max, index) per row and only those
        pairs are gathered (10 or 12 bytes a row from each rank, by the logits' dtype)
        instead of its [N, shard] logits.
        Without `final` the argmax reads the head's own output (bfloat16 on a GPU): widening
        to float32 is exact and keeps the order, so the token is the same, and no float32
        copy of the [N, vocab] logits is written and read again."""
        logits = self._shard_logits(hidden)
        if final is not None:
            logits = final(logits.float())
        if self.num_real < logits.shape[1]:
            logits[:, self.num_real:] = float("-inf")  # the last shard's padding
        tokens = logits.argmax(dim=-1)
        if self.tp is None:
            return tokens
        best = logits.gather(1, tokens[:, None]).squeeze(1)
        best, tokens = all_gather_rows(best, self.tp), all_gather_rows(tokens + self.start,
                                                                       self.tp)
        # Ranks hold increasing ranges of ids: the first rank holding a row's maximum holds
        # its first index.
        return tokens.gather(0, best.argmax(dim=0, keepdim=True)).squeeze(0)

    def _shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_logits is not None:
            return self.packed_logits(hidden, float_out=True)
        return F.linear(hidden, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: int | str | None = None) -> None:
        if self.tp is None:
            copy_weight(param.data, loaded)
            return
        param.data.zero_()  # the padding rows stay zero
        copy_weight(param.data[: self.num_real], narrow(loaded, 0, self.start, self.num_real))
