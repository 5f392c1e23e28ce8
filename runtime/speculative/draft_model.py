"""The draft model: a small model with the target's tokenizer that proposes k tokens by
running k decode steps of its own.

Its KV lives in its own tensors but at the *same slots* as the target's: the request's pages,
the slot table and the radix cache are shared. Every step the target computes, the draft
computes too, over the same tokens (`extend`), so the invariant is simple: for every position
the target has computed, the draft's KV at that slot is valid. A prefix-cache hit, a
retraction or a rejected draft is therefore handled by the target's bookkeeping alone, and the
draft's prefix cache is the target's radix tree.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from radixlm.runtime import sampler
from radixlm.runtime.attention.base import AttentionBackend, ForwardBatch
from radixlm.runtime.host_copy import to_device
from radixlm.runtime.memory import KVCache, ReqToTokenTable
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.request import Request
from radixlm.runtime.speculative.verify import sampling_probs


class DraftModel:
    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, kv_cache: KVCache,
                 table: ReqToTokenTable, target_vocab_size: int) -> None:
        self.model = model
        self.attn = attn
        self.kv_cache = kv_cache
        self.table = table
        self.vocab_size = target_vocab_size
        self.device = kv_cache.k.device

    def extend(self, batch: ForwardBatch) -> None:
        """Compute the draft's KV for the target's step (same tokens, positions, slots)."""
        draft_batch = dataclasses.replace(batch, kv_cache=self.kv_cache)
        self.attn.plan(draft_batch)
        self.model(draft_batch, self.attn)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: int) -> tuple[list[list[int]],
                                                                    torch.Tensor | None]:
        """k draft tokens for each request, sampled as the request's own parameters ask
        (greedy rows take the argmax), and the distributions they were drawn from ([B, k, V],
        None when every row is greedy). Each request has exactly one uncomputed token (its
        last), and pages for len(token_ids) + k - 1 tokens."""
        device = self.device
        rows = [r.table_row for r in requests]
        starts = [len(r.token_ids) - 1 for r in requests]
        params = [r.params for r in requests]
        sbatch = sampler.SamplingBatch.build(params, [r.generator for r in requests],
                                             self.vocab_size, device)
        rows_t = to_device(rows, torch.int64, device)
        tokens = to_device([r.token_ids[-1] for r in requests], torch.int64, device)
        drafts, probs = [], []
        for step in range(k):
            positions = to_device([s + step for s in starts], torch.int64, device)
            kv_lens = [s + step + 1 for s in starts]
            batch = ForwardBatch(
                input_ids=tokens, positions=positions, q_lens=[1] * len(requests),
                kv_lens=kv_lens, out_slots=self.table.table[rows_t, positions],
                slot_table=self.table.table[rows_t, : max(kv_lens)], kv_cache=self.kv_cache)
            self.attn.plan(batch)
            logits = self._fit_vocab(self.model.compute_logits(self.model(batch, self.attn)))
            tokens = sampler.sample(logits, sbatch)
            drafts.append(tokens)
            if not sbatch.all_greedy:
                probs.append(sampling_probs(logits[:, None], sbatch)[:, 0])
        proposal = torch.stack(drafts, dim=1).tolist()  # [B, k]
        return proposal, (torch.stack(probs, dim=1) if probs else None)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: ids only the draft has are dropped,
        ids only the target has get -inf (a draft can never propose them)."""
        width = logits.shape[1]
        if width >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=1)
