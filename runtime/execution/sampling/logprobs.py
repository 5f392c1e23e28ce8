"""Logprobs of the model's own distribution, as a pure tensor function."""

from __future__ import annotations

import torch


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-softmax of the raw logits: returns (logprob of token_ids [B], top_n logprobs
    [B, top_n] or None, their ids [B, top_n] or None).

    Pass the logits *before* temperature, penalties and masks: logprobs report the model's own
    distribution (see SamplingParams.logprobs). top_n is clamped to the vocabulary size.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.to(torch.int64).unsqueeze(1)).squeeze(1)
    if top_n <= 0:
        return chosen, None, None
    top = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
    return chosen, top.values, top.indices


__all__ = ["compute_logprobs"]
