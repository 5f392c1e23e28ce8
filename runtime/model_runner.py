"""Turns a scheduled batch into tensors, runs the model and samples the next tokens.

Logits are computed only for the rows that need them: the last token of each request whose
tokens are all computed after this step (it gets a next token), and prompt positions whose
logprobs were asked for. Rows of requests with a grammar are masked to the tokens it allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixlm.runtime import sampler
from radixlm.runtime.attention.base import AttentionBackend, ForwardBatch
from radixlm.runtime.grammar.masks import BatchBitmask
from radixlm.runtime.memory import KVCache, ReqToTokenTable
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.request import Request, TokenLogprob
from radixlm.runtime.scheduler import ScheduledBatch


@dataclass
class StepResult:
    # Requests that got a next token this step, with it and (if asked) its logprob.
    sampled: list[Request] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Prompt logprobs computed this step: request -> [(prompt position, logprob)].
    prompt_logprobs: dict[Request, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    # Requests whose grammar failed this step, with why; their sampled token is not used.
    failed: dict[Request, str] = field(default_factory=dict)


class StepInputs(NamedTuple):
    """A step's inputs on the host: flat token rows, and per-sequence rows and lengths."""

    input_ids: list[int]
    positions: list[int]
    rows: list[int]  # slot-table row of each sequence
    q_lens: list[int]
    kv_lens: list[int]
    sample_rows: list[tuple[Request, int]]  # (request, flat token index)
    prompt_rows: list[tuple[Request, int, int]]  # (request, flat index, position)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, kv_cache: KVCache,
                 table: ReqToTokenTable, device: torch.device) -> None:
        self.model = model
        self.attn = attn
        self.kv_cache = kv_cache
        self.table = table
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.grammar_masks: BatchBitmask | None = None  # allocated on first use
        self.cuda_graphs = None  # a cuda_graph.DecodeGraphs, set by the engine on CUDA

    @torch.inference_mode()
    def execute(self, scheduled: ScheduledBatch) -> StepResult:
        inputs = self._collect(scheduled)
        sample_rows, prompt_rows = inputs.sample_rows, inputs.prompt_rows
        graphs = self.cuda_graphs
        if graphs is not None and not prompt_rows and graphs.fits(inputs.q_lens):
            hidden = graphs.forward(scheduled.requests, inputs.input_ids, inputs.positions,
                                    inputs.rows, inputs.kv_lens)
        else:
            batch = self._device_batch(inputs)
            self.attn.plan(batch)
            hidden = self.model(batch, self.attn)
        result = StepResult()
        if sample_rows:
            self._sample(hidden, sample_rows, result)
        if prompt_rows:
            self._prompt_logprobs(hidden, prompt_rows, result)
        return result

    def _collect(self, scheduled: ScheduledBatch) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        q_lens, kv_lens = [], []
        sample_rows: list[tuple[Request, int]] = []  # (request, flat token index)
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, flat index, position)
        for request, count in zip(scheduled.requests, scheduled.num_new_tokens):
            start = request.num_computed_tokens
            end = start + count
            flat = len(ids)
            ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            rows.append(request.table_row)
            q_lens.append(count)
            kv_lens.append(end)
            if end == len(request.token_ids):
                sample_rows.append((request, flat + count - 1))
            first = request.prompt_logprob_start
            if first is not None:
                # Hidden state at position p scores prompt token p + 1.
                for p in range(max(start, first - 1, 0), min(end, request.prompt_len - 1)):
                    prompt_rows.append((request, flat + p - start, p))
        return StepInputs(ids, positions, rows, q_lens, kv_lens, sample_rows, prompt_rows)

    def _device_batch(self, inputs: StepInputs) -> ForwardBatch:
        device = self.device
        positions_t = torch.tensor(inputs.positions, dtype=torch.int64, device=device)
        rows_t = torch.tensor(inputs.rows, dtype=torch.int64, device=device)
        # output_size: the length is known here, so repeat_interleave need not ask the GPU.
        token_rows = torch.repeat_interleave(rows_t, torch.tensor(inputs.q_lens, device=device),
                                             output_size=len(inputs.input_ids))
        return ForwardBatch(
            input_ids=torch.tensor(inputs.input_ids, dtype=torch.int64, device=device),
            positions=positions_t,
            q_lens=inputs.q_lens,
            kv_lens=inputs.kv_lens,
            out_slots=self.table.table[token_rows, positions_t],
            slot_table=self.table.table[rows_t, : max(inputs.kv_lens)],
            kv_cache=self.kv_cache,
        )

    def _sample(self, hidden: torch.Tensor, rows: list[tuple[Request, int]],
                result: StepResult) -> None:
        requests = [r for r, _ in rows]
        # Grammar masks are built on the host first: on a GPU the forward pass is still
        # running, so this work hides behind it.
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            masks, result.failed = self._grammar_masks([requests[i] for i in constrained])
        index = torch.tensor([i for _, i in rows], device=self.device)
        raw = self.model.compute_logits(hidden[index])  # [B, V] float32
        params = [r.params for r in requests]
        sbatch = sampler.SamplingBatch.build(params, [r.generator for r in requests],
                                             self.vocab_size, self.device)
        logits = raw
        if sbatch.needs_penalties:
            logits = sampler.apply_penalties(logits, sbatch, [r.prompt_ids for r in requests],
                                             [r.output_ids for r in requests])
        banned_rows, banned_ids = [], []
        for i, r in enumerate(requests):
            if r.num_output_tokens < r.params.min_new_tokens:
                banned_rows.append(i)
                eos = () if r.params.ignore_eos else tuple(r.eos_token_ids)
                banned_ids.append(eos + r.params.stop_token_ids)
        if banned_rows:
            logits = sampler.mask_tokens(logits, banned_rows, banned_ids)
        if constrained:
            logits = sampler.apply_token_bitmask(logits, constrained, masks)
        tokens = sampler.sample(logits, sbatch)
        top_n = max(p.top_logprobs_num for p in params)
        logprob_entries: list[TokenLogprob | None] = [None] * len(requests)
        if any(p.wants_logprobs for p in params):
            chosen, top_vals, top_ids = sampler.compute_logprobs(raw, tokens, top_n)
            logprob_entries = _entries(requests, tokens, chosen, top_vals, top_ids)
        result.sampled = requests
        result.next_tokens = tokens.tolist()
        result.logprobs = logprob_entries

    def _grammar_masks(self, requests: list[Request]):
        if self.grammar_masks is None:
            words = requests[0].grammar.grammar.mask_words
            self.grammar_masks = BatchBitmask(self.table.table.shape[0], words, self.device)
        return self.grammar_masks.fill(requests)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[Request, int, int]],
                         result: StepResult) -> None:
        index = torch.tensor([i for _, i, _ in rows], device=self.device)
        targets = torch.tensor([r.token_ids[p + 1] for r, _, p in rows], device=self.device)
        raw = self.model.compute_logits(hidden[index])
        top_n = max(r.params.top_logprobs_num for r, _, _ in rows)
        chosen, top_vals, top_ids = sampler.compute_logprobs(raw, targets, top_n)
        requests = [r for r, _, _ in rows]
        for (request, _, position), entry in zip(
                rows, _entries(requests, targets, chosen, top_vals, top_ids)):
            result.prompt_logprobs.setdefault(request, []).append((position + 1, entry))


def _entries(requests: list[Request], tokens: torch.Tensor, chosen: torch.Tensor,
             top_vals: torch.Tensor | None, top_ids: torch.Tensor | None) -> list[TokenLogprob]:
    tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
    vals_l = top_vals.tolist() if top_vals is not None else None
    ids_l = top_ids.tolist() if top_ids is not None else None
    out = []
    for i, request in enumerate(requests):
        k = request.params.top_logprobs_num
        top = list(zip(ids_l[i][:k], vals_l[i][:k])) if k and ids_l is not None else None
        out.append(TokenLogprob(tokens_l[i], chosen_l[i], top))
    return out
