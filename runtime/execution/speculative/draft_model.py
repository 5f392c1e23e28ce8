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
from typing import Any, Callable, Sequence

import numpy as np
import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.execution.sampling import sampler
from radixlm.runtime.execution.sampling.grammar_masks import draft_masks
from radixlm.runtime.execution.sampling.logit_processing import apply_token_bitmask
from radixlm.runtime.execution.speculative.verify import sampling_probs
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.scheduling.pages import ReqToTokenTable
from radixlm.runtime.scheduling.request import Request


class DraftModel:
    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, kv_cache: KVCache,
                 table: ReqToTokenTable, target_vocab_size: int) -> None:
        self.model = model
        self.attn = attn
        self.kv_cache = kv_cache
        self.table = table
        self.vocab_size = target_vocab_size
        self.device = kv_cache.k.device
        self.cuda_graphs = None  # a cuda_graph.DecodeGraphs of the draft, set on CUDA

    def extend(self, token_rows: tuple | None, eager_batch: Callable[[], ForwardBatch],
               pending_tokens: torch.Tensor | None = None) -> None:
        """Compute the draft's KV for the target's step (same tokens, positions, slots):
        replayed as one decode row per token when the target's step could be
        (`token_rows`, see model_runner), else eagerly on the target's batch."""
        graphs = self.cuda_graphs
        if token_rows is not None and graphs is not None:
            graphs.forward(*token_rows, pending_tokens)
            return
        draft_batch = dataclasses.replace(eager_batch(), kv_cache=self.kv_cache)
        self.attn.plan(draft_batch)
        self.model(draft_batch, self.attn)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: int) -> tuple[list[list[int]],
                                                                    torch.Tensor | None]:
        """k draft tokens for each request, sampled as the request's own parameters ask
        (greedy rows take the argmax), and the distributions they were drawn from ([B, k, V],
        None when every row is greedy). Each request has exactly one uncomputed token (its
        last), and pages for len(token_ids) + k - 1 tokens.

        A request with a grammar drafts under it: each step masks its row with the state its
        drafts so far reach (its matcher accepts them, and rolls them back at the end; the
        sampled tokens are read back to the host, so such steps sync once each). Past a draft
        the grammar cannot follow (EOS), its row runs unmasked and is cut later."""
        device = self.device
        rows = [r.table_row for r in requests]
        starts = [len(r.token_ids) - 1 for r in requests]
        params = [r.params for r in requests]
        sbatch = sampler.SamplingBatch.build(params, [r.generator for r in requests],
                                             self.vocab_size, device)
        tokens = to_device([r.token_ids[-1] for r in requests], torch.int64, device)
        # Row -> drafts its matcher has accepted (rows whose grammar stopped following leave).
        following = {b: 0 for b, r in enumerate(requests) if r.grammar is not None}
        accepted = dict(following)
        drafts, probs = [], []
        try:
            for step in range(k):
                positions = [s + step for s in starts]
                hidden = self._decode(requests, tokens, positions, rows)
                logits = self._fit_vocab(self.model.compute_logits(hidden))
                masked, masks = [], []
                for b in list(following):
                    try:
                        masks.append(draft_masks(requests[b], []))
                        masked.append(b)
                    except Exception:  # not followed further (see _follow)
                        del following[b]
                if masked:
                    logits = apply_token_bitmask(
                        logits, masked, to_device(torch.from_numpy(
                            np.concatenate(masks).view(np.int32)), torch.int32, device))
                tokens = sampler.sample(logits, sbatch)
                if following:
                    sampled = tokens.tolist()
                    for b in list(following):
                        if self._follow(requests[b].grammar, sampled[b]):
                            accepted[b] += 1
                        else:
                            del following[b]
                drafts.append(tokens)
                if not sbatch.all_greedy:
                    probs.append(sampling_probs(logits[:, None], sbatch)[:, 0])
        finally:
            for b, count in accepted.items():
                try:
                    requests[b].grammar.rollback(count)
                except Exception:  # a broken grammar fails its request at its next mask
                    pass
        proposal = torch.stack(drafts, dim=1).tolist()  # [B, k]
        return proposal, (torch.stack(probs, dim=1) if probs else None)

    @staticmethod
    def _follow(matcher: Any, token: int) -> bool:
        """Advance a drafting request's matcher by its sampled draft, if the grammar allows it
        (a grammar that fails is not followed further; its request fails at its next mask)."""
        try:
            if matcher.valid_prefix([token]) == 1:
                matcher.accept(token)
                return True
        except Exception:
            pass
        return False

    def _decode(self, requests: Sequence[Request], tokens: torch.Tensor, positions: list[int],
                rows: list[int]) -> torch.Tensor:
        """One decode step of the draft: hidden states [len(requests), d]."""
        kv_lens = [p + 1 for p in positions]
        graphs = self.cuda_graphs
        if graphs is not None and len(requests) <= graphs.max_bs:
            return graphs.forward(requests, [0] * len(requests), positions, rows, kv_lens,
                                  tokens)
        rows_t = to_device(rows, torch.int64, self.device)
        positions_t = to_device(positions, torch.int64, self.device)
        batch = ForwardBatch(
            input_ids=tokens, positions=positions_t, q_lens=[1] * len(requests),
            kv_lens=kv_lens, out_slots=self.table.table[rows_t, positions_t],
            slot_table=self.table.table[rows_t, : max(kv_lens)], kv_cache=self.kv_cache)
        self.attn.plan(batch)
        return self.model(batch, self.attn)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: ids only the draft has are dropped,
        ids only the target has get -inf (a draft can never propose them)."""
        width = logits.shape[1]
        if width >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=1)
