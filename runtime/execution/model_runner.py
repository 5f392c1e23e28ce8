"""Turns a scheduled batch into tensors, runs the model and samples the next tokens.

Logits are computed only for the rows that need them: the last token of each request whose
tokens are all computed after this step (it gets a next token), and prompt positions whose
logprobs were asked for. Rows of requests with a grammar are masked to the tokens it allows.
The batch becomes tensors in `step_inputs`; what a step hands back is in `step_result`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.execution import speculative
from radixlm.runtime.execution.sampling import sampler
from radixlm.runtime.execution.sampling.grammar_masks import BatchBitmask, draft_masks
from radixlm.runtime.execution.sampling.logit_processing import (
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
    mask_tokens,
)
from radixlm.runtime.execution.sampling.logprobs import compute_logprobs
from radixlm.runtime.execution.step_inputs import (
    StepInputs,
    collect_inputs,
    device_batch,
    one_row_per_token,
)
from radixlm.runtime.execution.step_result import (
    LaunchedStep,
    PendingHidden,
    StepResult,
    token_logprobs,
)
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.lora.slots import LoRASlots
from radixlm.runtime.scheduling.pages import ReqToTokenTable
from radixlm.runtime.scheduling.request import Request
from radixlm.runtime.scheduling.scheduler import ScheduledBatch


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
        self.graph_steps = 0  # steps that replayed a graph (the rest ran eagerly)
        self.cpu_decode = None  # a cpu_decode.CpuDecode, set by the engine on CPU: every step
        self.draft = None  # a speculative.DraftModel, set by the engine: it mirrors each step
        self.lora: LoRASlots | None = None  # the adapters' slots, when the engine serves any

    def use_lora(self, slots: LoRASlots) -> None:
        """Serve LoRA adapters: each step's rows get their request's adapter update."""
        self.lora = slots
        if self.cpu_decode is not None:
            self.cpu_decode.lora = slots

    def execute(self, scheduled: ScheduledBatch) -> StepResult:
        """Run one step and wait for its result."""
        return self.launch(scheduled).result()

    @torch.inference_mode()
    def launch(self, scheduled: ScheduledBatch) -> LaunchedStep:
        """Queue one step's forward and sampling on the device; nothing here waits for it."""
        inputs = collect_inputs(scheduled)
        sample_rows, prompt_rows = inputs.sample_rows, inputs.prompt_rows
        pending = scheduled.pending_tokens
        graphs = self.cuda_graphs
        adapters = False
        if self.lora is not None:
            self.lora.prepare([r.lora for r in scheduled.requests], scheduled.num_new_tokens)
            adapters = self.lora.step is not None
            if adapters and graphs is not None and graphs.lora is None:
                graphs = None  # the graphs were captured without the adapters' updates
        token_rows = (None if graphs is None or prompt_rows
                      else one_row_per_token(scheduled, inputs, graphs.max_bs))
        batch = None
        if token_rows is not None:
            hidden = graphs.forward(*token_rows, pending, adapters)
            self.graph_steps += 1
        else:
            batch = self._device_batch(inputs, pending)
            if self.cpu_decode is not None:
                hidden = self.cpu_decode.forward(batch)
            else:
                self.attn.plan(batch)
                hidden = self.model(batch, self.attn)
        if self.draft is not None:  # the draft's KV follows the target's, slot for slot
            self.draft.extend(token_rows, lambda: batch or self._device_batch(inputs, pending),
                              pending)
        step = LaunchedStep(scheduled, self.device)

        def score(hidden: torch.Tensor) -> None:
            if sample_rows:
                self._sample(hidden, sample_rows, step)
            if inputs.verify_rows:
                self._verify(hidden, inputs.verify_rows, step)
            if prompt_rows:
                self._prompt_logprobs(hidden, prompt_rows, step)
            step.send_home()

        if isinstance(hidden, PendingHidden):  # the last pipeline stage computes it
            step.deferred = lambda: score(hidden.wait())
        else:
            score(hidden)
        return step

    def _device_batch(self, inputs: StepInputs, pending: torch.Tensor | None) -> ForwardBatch:
        return device_batch(inputs, pending, self.table, self.kv_cache, self.device)

    def _sample(self, hidden: torch.Tensor, rows: list[tuple[Request, int]],
                step: LaunchedStep) -> None:
        requests = [r for r, _ in rows]
        # Grammar masks are built on the host first: on a GPU the forward pass is still
        # running, so this work hides behind it.
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if constrained:
            masks, failed = self._grammar_masks([requests[i] for i in constrained])
            step.failed.update(failed)
        flat = [i for _, i in rows]
        if flat != list(range(hidden.shape[0])):  # decode steps sample every row, in order
            hidden = hidden[to_device(flat, torch.int64, self.device)]
        params = [r.params for r in requests]
        if not constrained and _plain_greedy(requests):
            # The argmax of the raw logits is every row's token: with tensor parallelism the
            # ranks then gather a (max, index) pair per row instead of [B, V] logits.
            step.sampled = requests
            step.tokens = self.model.greedy_tokens(hidden)
            return
        raw = self.model.compute_logits(hidden)  # [B, V] float32
        sbatch = sampler.SamplingBatch.build(params, [r.generator for r in requests],
                                             self.vocab_size, self.device)
        logits = raw
        if sbatch.needs_penalties:
            logits = apply_penalties(logits, sbatch, [r.prompt_ids for r in requests],
                                     [r.output_ids for r in requests])
        logits = _biased(logits, requests)
        banned_rows, banned_ids = _min_token_bans(requests,
                                                  [r.num_output_tokens for r in requests])
        if banned_rows:
            logits = mask_tokens(logits, banned_rows, banned_ids)
        if constrained:
            logits = apply_token_bitmask(logits, constrained, masks)
        tokens = sampler.sample(logits, sbatch)
        if any(p.wants_logprobs for p in params):
            top_n = max(p.top_logprobs_num for p in params)
            step.logprob_tensors = compute_logprobs(raw, tokens, top_n)
        step.sampled = requests
        step.tokens = tokens

    def _verify(self, hidden: torch.Tensor, rows: list[tuple[Request, int]],
                step: LaunchedStep) -> None:
        """Score every draft position of the speculating requests in one go and keep what
        the lossless rule accepts (see speculative.verify)."""
        requests = [r for r, _ in rows]
        counts = [len(r.draft_tokens) for r in requests]
        k = max(counts)
        # Row b, position j reads flat row first_b + j; rows with fewer drafts repeat their
        # last position (it is never compared, only padding).
        index = [first + min(j, n) for (_, first), n in zip(rows, counts) for j in range(k + 1)]
        raw = self.model.compute_logits(hidden[to_device(index, torch.int64, self.device)])
        # Position j is processed as plain decoding would process it after the first j
        # drafts: they count as output for penalties and for the min_new_tokens ban.
        per_row = [r for r in requests for _ in range(k + 1)]
        drafted = [min(j, n) for n in counts for j in range(k + 1)]
        logits = raw
        if any(r.params.has_penalties for r in requests):
            penalties = sampler.SamplingBatch.build([r.params for r in per_row],
                                                    [None] * len(per_row), self.vocab_size,
                                                    self.device)
            logits = apply_penalties(
                logits, penalties, [r.prompt_ids for r in per_row],
                [r.output_ids + r.draft_tokens[:d] for r, d in zip(per_row, drafted)])
        logits = _biased(logits, per_row)
        banned_rows, banned_ids = _min_token_bans(
            per_row, [r.num_output_tokens + d for r, d in zip(per_row, drafted)])
        if banned_rows:
            logits = mask_tokens(logits, banned_rows, banned_ids)
        constrained = [b for b, r in enumerate(requests) if r.grammar is not None]
        if constrained:  # each position under the grammar state the drafts before it reach
            masks = np.concatenate([self._draft_masks(requests[b], k, step)
                                    for b in constrained])
            flat_rows = [b * (k + 1) + j for b in constrained for j in range(k + 1)]
            logits = apply_token_bitmask(
                logits, flat_rows, to_device(torch.from_numpy(masks.view(np.int32)), torch.int32,
                                             self.device))
        logits = logits.view(len(rows), k + 1, self.vocab_size)
        drafts = to_device([r.draft_tokens + [0] * (k - n) for r, n in zip(requests, counts)],
                           torch.int64, self.device)
        sbatch = sampler.SamplingBatch.build([r.params for r in requests],
                                             [r.generator for r in requests],
                                             self.vocab_size, self.device)
        if sbatch.all_greedy:
            verified = speculative.verify_greedy(drafts, logits, counts)
        else:
            draft_probs = None
            if requests[0].draft_probs is not None:  # a draft model that sampled
                draft_probs = torch.stack([r.draft_probs[:k] for r in requests])
            verified = speculative.verify_sampling(
                drafts, draft_probs, speculative.sampling_probs(logits, sbatch), counts,
                sbatch.generators)
        emitted = verified.emitted()
        step.verified = dict(zip(requests, emitted))
        if any(r.params.wants_logprobs for r in requests):  # of the model's own distribution
            tokens = verified.output_tokens.clamp_min(0).reshape(-1)
            top_n = max(r.params.top_logprobs_num for r in requests)
            entries = token_logprobs(per_row, tokens, *compute_logprobs(raw, tokens, top_n))
            step.verified_logprobs = {
                r: entries[b * (k + 1): b * (k + 1) + len(emitted[b])]
                for b, r in enumerate(requests) if r.params.wants_logprobs}

    def _draft_masks(self, request: Request, k: int, step: LaunchedStep) -> np.ndarray:
        """[k + 1, words] masks of a speculating request's draft positions (positions past its
        own drafts repeat its last). A grammar that fails here fails its request alone."""
        n = len(request.draft_tokens)
        try:
            return draft_masks(request, request.draft_tokens)[[min(j, n) for j in range(k + 1)]]
        except Exception as exc:
            step.failed[request] = exc
            return np.full((k + 1, request.grammar.mask_words), 0xFFFFFFFF, dtype=np.uint32)

    def _grammar_masks(self, requests: list[Request]):
        if self.grammar_masks is None:
            words = requests[0].grammar.mask_words
            self.grammar_masks = BatchBitmask(self.table.table.shape[0], words, self.device)
        return self.grammar_masks.fill(requests)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: list[tuple[Request, int, int]],
                         step: LaunchedStep) -> None:
        index = to_device([i for _, i, _ in rows], torch.int64, self.device)
        targets = to_device([r.token_ids[p + 1] for r, _, p in rows], torch.int64, self.device)
        raw = self.model.compute_logits(hidden[index])
        top_n = max(r.params.top_logprobs_num for r, _, _ in rows)
        step.prompt_tensors = (rows, targets, *compute_logprobs(raw, targets, top_n))


def _plain_greedy(requests: Sequence[Request]) -> bool:
    """Whether every row's token is the argmax of the model's logits: greedy, with nothing
    that changes logits (penalties, logit_bias, a min_new_tokens ban) and no logprobs."""
    for request in requests:
        p = request.params
        if (not sampler.is_greedy(p) or p.has_penalties or p.logit_bias or p.wants_logprobs
                or request.num_output_tokens < p.min_new_tokens):
            return False
    return True


def _biased(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The logits with each row's request's logit_bias added (the same tensor if none)."""
    rows = [i for i, r in enumerate(requests) if r.params.logit_bias]
    if not rows:
        return logits
    return apply_logit_bias(logits, rows, [requests[i].params.logit_bias for i in rows])


def _min_token_bans(requests: list[Request], num_outputs: list[int]
                    ) -> tuple[list[int], list[tuple[int, ...]]]:
    """Rows whose request has fewer than min_new_tokens outputs (counting `num_outputs`),
    and the ids each must not produce yet: EOS (unless ignored) and its stop ids."""
    rows, ids = [], []
    for i, (request, count) in enumerate(zip(requests, num_outputs)):
        params = request.params
        if count < params.min_new_tokens:
            rows.append(i)
            ids.append((() if params.ignore_eos else tuple(request.eos_token_ids))
                       + params.stop_token_ids)
    return rows, ids
