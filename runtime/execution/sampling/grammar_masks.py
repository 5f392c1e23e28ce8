"""One step's grammar masks: a preallocated int32 bitmask, a row per constrained request.

Rows are filled on the host by the grammar engine (a batch at once, in parallel where the
engine can), plus the request's own EOS ids when its grammar accepts here and EOS is not
banned.
The sampler unpacks the bits with tensor ops (`logit_processing.apply_token_bitmask`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from radixlm.runtime.scheduling.request import Request


class BatchBitmask:
    def __init__(self, max_rows: int, words: int, device: torch.device) -> None:
        self.words = words
        self.device = device
        # Pinned host memory makes the copy to the GPU asynchronous.
        self.host = torch.zeros(max_rows, words, dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self.bits = self.host.numpy().view(np.uint32)

    def fill(self, requests: Sequence[Request]) -> tuple[torch.Tensor, dict[Request, Exception]]:
        """Masks for these (constrained) requests, on the device, and the requests whose
        grammar failed, with why. A failed row allows nothing; its request is aborted."""
        rows = self.bits[: len(requests)]
        matchers = [r.grammar for r in requests]
        errors = type(matchers[0]).fill_masks(matchers, rows)
        limit = self.words * 32
        for i, (request, error) in enumerate(zip(requests, errors)):
            if error is None:
                try:
                    if request.grammar.is_final and _eos_allowed(request):
                        for eos in request.eos_token_ids:
                            if 0 <= eos < limit:
                                rows[i, eos >> 5] |= np.uint32(1 << (eos & 31))
                except Exception as exc:
                    errors[i] = exc
        failed: dict[Request, Exception] = {}
        empty = ~rows.any(axis=1)  # one pass over the batch, not a Python call per row
        for i in np.flatnonzero(empty | np.array([e is not None for e in errors])):
            # One request's grammar must not fail the batch: its row allows nothing.
            rows[i] = 0
            failed[requests[i]] = errors[i] or RuntimeError("the grammar allows no token here")
        masks = self.host[: len(requests)]
        return masks.to(self.device, non_blocking=True), failed


def draft_masks(request: Request, drafts: Sequence[int]) -> np.ndarray:
    """[len(drafts) + 1, words] uint32 masks of a request's grammar at each draft position:
    row j is the mask after the first j drafts (all allowed by the grammar), EOS included
    where the grammar may end there."""
    rows, finals = request.grammar.masks_along(drafts)
    if _eos_allowed(request):
        limit = rows.shape[1] * 32
        for row, final in zip(rows, finals):
            if final:
                for eos in request.eos_token_ids:
                    if 0 <= eos < limit:
                        row[eos >> 5] |= np.uint32(1 << (eos & 31))
    return rows


def _eos_allowed(request: Request) -> bool:
    params = request.params
    return not params.ignore_eos and request.num_output_tokens >= params.min_new_tokens
