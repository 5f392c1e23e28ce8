"""What one step produced: `LaunchedStep` while its device work is queued, `StepResult` once
its tokens and logprobs are read back to the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from radixlm.runtime.scheduling.request import Request, TokenLogprob
from radixlm.runtime.scheduling.scheduler import ScheduledBatch


@dataclass
class StepResult:
    # Requests that got a next token this step, with it and (if asked) its logprob.
    sampled: list[Request] = field(default_factory=list)
    next_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # Prompt logprobs computed this step: request -> [(prompt position, logprob)].
    prompt_logprobs: dict[Request, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    # Requests whose grammar failed this step, with why; their sampled token is not used.
    failed: dict[Request, Exception] = field(default_factory=dict)
    # Speculating requests: the tokens verification emits (accepted drafts, then one more),
    # and their logprobs for requests that asked.
    verified: dict[Request, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[Request, list[TokenLogprob]] = field(default_factory=dict)


class PendingHidden:
    """Hidden states another process is still computing (the last pipeline stage's, for
    rank 0 to score): `wait()` receives them. The step's sampling waits with it, until its
    result is asked for, so that rank 0 goes on to launch other steps meanwhile."""

    def __init__(self, wait: Callable[[], torch.Tensor]) -> None:
        self.wait = wait


class LaunchedStep:
    """A step whose device work is queued. `tokens` (device) can feed a following step
    before the host has seen them; `result()` waits for this step alone (not for steps queued
    after it) and reads what it produced back to the host."""

    def __init__(self, scheduled: ScheduledBatch, device: torch.device) -> None:
        self.scheduled = scheduled
        self.device = device
        self.sampled: list[Request] = []
        self.tokens: torch.Tensor | None = None  # [len(sampled)] on the device
        self.failed: dict[Request, Exception] = {}
        self.verified: dict[Request, list[int]] = {}
        self.verified_logprobs: dict[Request, list[TokenLogprob]] = {}
        self.logprob_tensors: tuple | None = None  # (chosen, top values, top ids), sampled rows
        self.prompt_tensors: tuple | None = None  # (rows, targets, chosen, top vals, top ids)
        self._host_tokens: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        # The sampling still to do once the hidden states arrive (PendingHidden).
        self.deferred: Callable[[], None] | None = None

    def send_home(self) -> None:
        """Start copying the outputs to pinned host memory; remember when they have landed."""
        if self.device.type != "cuda":
            return

        def home(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        self._host_tokens = home(self.tokens)
        if self.logprob_tensors is not None:
            self.logprob_tensors = tuple(home(t) for t in self.logprob_tensors)
        if self.prompt_tensors is not None:
            rows, *tensors = self.prompt_tensors
            self.prompt_tensors = (rows, *(home(t) for t in tensors))
        self._done = torch.cuda.Event()
        self._done.record()

    def result(self) -> StepResult:
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            deferred()
        if self._done is not None:
            self._done.synchronize()
            tokens = self._host_tokens
        else:
            tokens = self.tokens
        result = StepResult(failed=self.failed, verified=self.verified,
                            verified_logprobs=self.verified_logprobs)
        if tokens is not None:
            result.sampled = self.sampled
            result.next_tokens = tokens.tolist()
            result.logprobs = ([None] * len(self.sampled) if self.logprob_tensors is None else
                               token_logprobs(self.sampled, tokens, *self.logprob_tensors))
        if self.prompt_tensors is not None:
            rows, targets, chosen, top_vals, top_ids = self.prompt_tensors
            requests = [r for r, _, _ in rows]
            for (request, _, position), entry in zip(
                    rows, token_logprobs(requests, targets, chosen, top_vals, top_ids)):
                result.prompt_logprobs.setdefault(request, []).append((position + 1, entry))
        return result


def token_logprobs(requests: list[Request], tokens: torch.Tensor, chosen: torch.Tensor,
                   top_vals: torch.Tensor | None, top_ids: torch.Tensor | None
                   ) -> list[TokenLogprob]:
    """Each row's TokenLogprob, from compute_logprobs's tensors: its token, that token's
    logprob, and the top ones its request asked for."""
    tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
    vals_l = top_vals.tolist() if top_vals is not None else None
    ids_l = top_ids.tolist() if top_ids is not None else None
    out = []
    for i, request in enumerate(requests):
        k = request.params.top_logprobs_num
        top = list(zip(ids_l[i][:k], vals_l[i][:k])) if k and ids_l is not None else None
        out.append(TokenLogprob(tokens_l[i], chosen_l[i], top))
    return out
