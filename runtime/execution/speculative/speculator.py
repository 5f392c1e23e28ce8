"""The engine side of speculative decoding: which requests speculate in a step, and with which
drafts.

After the scheduler has picked a step, each decode request in it (one uncomputed token) may
take up to k drafts: they are appended to the step as more tokens to compute (the token rule:
`num_new_tokens` becomes 1 + drafts), with pages for them. The model runner verifies them in
the same forward; the engine core appends what was accepted and `finish` hands the pages of
rejected drafts back. The radix cache only ever sees verified tokens: `num_computed_tokens`
advances over a draft only once it is accepted.

With a grammar (regex, JSON schema), a draft model samples its drafts under the grammar's
masks, n-gram drafts are cut at their first token the grammar forbids (`valid_prefix`), and
verification masks each position with the grammar's state after the drafts before it
(`GrammarMatcher.masks_along`, which rolls back); the tokens a grammar forces are appended by
jump-forward without drafting. Penalties and the `min_new_tokens` ban are applied at each
draft position as if the drafts before it were output, and logprobs are reported for every
emitted token, so speculation changes none of them.
"""

from __future__ import annotations

from collections import Counter

from radixlm.runtime.execution.speculative.draft_model import DraftModel
from radixlm.runtime.execution.speculative.ngram import AdaptiveK, NgramIndex
from radixlm.runtime.scheduling.kv_manager import KVManager
from radixlm.runtime.scheduling.request import Request
from radixlm.runtime.scheduling.scheduler import ScheduledBatch


class Speculator:
    def __init__(self, method: str, k: int, kv: KVManager, max_step_tokens: int,
                 draft: DraftModel | None = None, adaptive: bool = True) -> None:
        if (method == "draft") != (draft is not None):
            raise ValueError("a draft model is needed for, and only for, method='draft'")
        self.method = method
        self.k = k
        self.kv = kv
        self.max_step_tokens = max_step_tokens
        self.draft = draft
        self.adaptive = adaptive
        self.counters: Counter[str] = Counter()

    def propose(self, scheduled: ScheduledBatch) -> None:
        """Give each eligible decode request of the step its drafts (request.draft_tokens)
        and count them in scheduled.num_new_tokens."""
        budget = self.max_step_tokens - scheduled.num_tokens
        chosen: list[tuple[int, Request, int]] = []  # (index in the step, request, k)
        for index, (request, count) in enumerate(zip(scheduled.requests,
                                                     scheduled.num_new_tokens)):
            k = min(self._draft_length(request), request.remaining_new_tokens - 1, budget)
            if count != 1 or request.num_uncomputed != 1 or k <= 0 or not _eligible(request):
                continue
            # Pages for the drafts the target verifies (and the draft model writes).
            if not self.kv.grow(request, len(request.token_ids) + k):
                continue
            chosen.append((index, request, k))
            budget -= k
        if not chosen:
            return
        if self.draft is not None:
            proposals, probs = self.draft.propose([r for _, r, _ in chosen],
                                                  max(k for _, _, k in chosen))
        else:
            proposals, probs = [self._ngram(r, k) for _, r, k in chosen], None
        for row, ((index, request, k), drafts) in enumerate(zip(chosen, proposals)):
            drafts = drafts[:k]
            if request.grammar is not None:  # cut at the first token the grammar forbids
                try:
                    drafts = drafts[: request.grammar.valid_prefix(drafts)]
                except Exception:  # a broken grammar fails at its next mask, not here
                    drafts = []
            request.draft_tokens = drafts
            request.draft_probs = probs[row] if probs is not None else None
            scheduled.num_new_tokens[index] = 1 + len(request.draft_tokens)
            self.counters["drafted_tokens"] += len(request.draft_tokens)

    def finish(self, request: Request, emitted: list[int]) -> None:
        """Account one verification (`emitted`: accepted drafts, then one more token) and
        drop the drafts; pages past the request's tokens go back to the free list."""
        if request.draft_tokens:
            if request.draft_length is not None:
                request.draft_length.update(len(request.draft_tokens), len(emitted) - 1)
            self.counters["verified_requests"] += 1
            self.counters["accepted_tokens"] += len(emitted) - 1
            self.counters["emitted_tokens"] += len(emitted)
        request.draft_tokens = []
        request.draft_probs = None
        if not request.finished:
            self.kv.trim(request)

    def stats(self) -> dict[str, float]:
        verified = self.counters["verified_requests"]
        drafted = self.counters["drafted_tokens"]
        return {
            "spec_drafted_tokens": drafted,
            "spec_accepted_tokens": self.counters["accepted_tokens"],
            "spec_acceptance_rate": self.counters["accepted_tokens"] / drafted if drafted else 0.0,
            # Tokens each speculating request gained per target forward (1 without drafts).
            "spec_mean_accept_length": (self.counters["emitted_tokens"] / verified
                                        if verified else 0.0),
        }

    def _draft_length(self, request: Request) -> int:
        if not self.adaptive:
            return self.k
        if request.draft_length is None:
            request.draft_length = AdaptiveK(self.k)
        return request.draft_length.k

    def _ngram(self, request: Request, k: int) -> list[int]:
        index = request.ngram_index
        if index is None:
            index = request.ngram_index = NgramIndex(request.token_ids)
        elif len(index) < len(request.token_ids):
            index.extend(request.token_ids[len(index):])
        return index.propose(k)


def _eligible(request: Request) -> bool:
    # A constrained request speculates once its grammar is attached: drafts are checked
    # against it.
    return request.grammar is not None or not request.params.constrained
