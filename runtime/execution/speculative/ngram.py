"""Drafts without a draft model: n-gram (prompt-lookup) proposals, and an adaptive draft
length driven by the observed acceptance."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# --------------------------------------------------------------------------------------------
# N-gram (prompt-lookup) drafting


def propose_ngram(token_ids: Sequence[int], k: int, max_ngram: int = 4,
                  min_ngram: int = 1) -> list[int]:
    """Draft up to k tokens by prompt lookup, without keeping state between calls.

    Finds the longest suffix n-gram (max_ngram >= n >= min_ngram) of the context that occurred
    earlier, takes its most recent earlier occurrence, and proposes the k tokens that follow
    it. The copy reads like LZ77: when fewer than k tokens follow the occurrence, it runs on
    into the tokens being proposed, i.e. it repeats the cycle it found ("a b a b" proposes
    "a b a b ..."). Returns [] when no suffix n-gram occurred before.

    O(len(token_ids)) per call (a numpy scan); `NgramIndex` answers the same in O(max_ngram)
    per step for a context that grows.
    """
    length = len(token_ids)
    if k <= 0 or length < min_ngram + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Candidate ends e (exclusive, e <= length - 1 so that a token follows) of earlier
    # occurrences of the suffix n-gram, narrowed as n grows: tokens[e - n : e] must equal
    # tokens[length - n :].
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1]) + 1
    best = None
    for n in range(1, min(max_ngram, length - 1) + 1):
        if n > 1:
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tokens[length - n]]
        if not ends.size:
            break
        if n >= min_ngram:
            best = int(ends[-1])
    if best is None:
        return []
    return _continuation(token_ids, best, k)


class NgramIndex:
    """Incremental prompt lookup for one request: the same proposals as `propose_ngram`, in
    O(max_ngram) per appended token and per proposal.

    For each n it maps every n-gram seen to the end of its latest occurrence. Before the map
    is updated with the n-gram that ends the context, the old entry is that n-gram's most
    recent *earlier* occurrence: that is the match the next proposal continues. Append-only:
    drafts are not appended, only the tokens the request keeps.
    """

    def __init__(self, token_ids: Sequence[int] = (), max_ngram: int = 4,
                 min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # _last[n]: n-gram -> end (exclusive) of its latest occurrence, the suffix included.
        self._last: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)}
        # _match[n]: end of the latest earlier occurrence of the suffix n-gram, if any.
        self._match: dict[int, int | None] = dict.fromkeys(self._last)
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        self.extend((token,))

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens (a prompt at once is fine: the n-grams go in by one dict.update)."""
        if not len(token_ids):
            return
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in token_ids)
        length = len(self.tokens)
        tokens = self.tokens
        for n, last in self._last.items():
            if length < n:
                continue
            # n-grams ending at e = first .. length - 1 (all new ones but the suffix): the
            # i-th element of the gram ending at e is tokens[e - n + i].
            first = max(n, old + 1)
            if first < length:
                grams = zip(*(tokens[first - n + i: length - n + i] for i in range(n)))
                last.update(zip(grams, range(first, length)))
            suffix = tuple(tokens[length - n:])
            self._match[n] = last.get(suffix)
            last[suffix] = length

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens continuing the context, or [] (see `propose_ngram`)."""
        if k <= 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            end = self._match[n]
            if end is not None:
                return _continuation(self.tokens, end, k)
        return []


def _continuation(token_ids: Sequence[int], end: int, k: int) -> list[int]:
    """The k tokens after a match that ends at `end` (< len(token_ids)). Past the context the
    copy continues into its own output, so it repeats token_ids[end:] with that period."""
    tail = [int(t) for t in token_ids[end: end + k]]  # only what is needed: matches can be old
    if len(tail) == k:
        return tail
    return (tail * -(-k // len(tail)))[:k]


# --------------------------------------------------------------------------------------------
# Adaptive draft length


class AdaptiveK:
    """Choose the number of drafts from the observed acceptance.

    Models drafts as accepted independently with probability alpha, estimated as an
    exponential moving average over verified steps: a step that accepted a of n drafts
    saw a successes in a + (a < n) trials. The j-th draft is worth proposing while the chance
    that it is reached and accepted, alpha ** j, is at least `min_gain` (its cost relative to
    the tokens it brings: drafting and scoring one more position), so
    k = floor(log(min_gain) / log(alpha)), kept in [1, k_max].

    Host-side and cheap; keep one per request (acceptance depends on the text) or one per
    engine.
    """

    def __init__(self, k_max: int, min_gain: float = 0.25, decay: float = 0.9,
                 prior: float = 0.6) -> None:
        if k_max < 1 or not 0 < min_gain < 1 or not 0 <= decay < 1 or not 0 <= prior <= 1:
            raise ValueError("need k_max >= 1, 0 < min_gain < 1, 0 <= decay < 1, "
                             "0 <= prior <= 1")
        self.k_max = k_max
        self.min_gain = min_gain
        self.decay = decay
        # The prior counts as two trials: it fades after a few steps.
        self._successes = 2.0 * prior
        self._trials = 2.0

    @property
    def acceptance(self) -> float:
        """Estimated probability that a draft is accepted, given the ones before it were."""
        return self._successes / self._trials

    @property
    def k(self) -> int:
        alpha = self.acceptance
        if alpha >= 1.0:
            return self.k_max
        if alpha <= 0.0:
            return 1
        return max(1, min(self.k_max, int(math.log(self.min_gain) / math.log(alpha))))

    def update(self, num_drafts: int, num_accepted: int) -> None:
        """Record one verified step of one request (a step without drafts says nothing)."""
        if num_drafts <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        self._successes = self.decay * self._successes + num_accepted
        self._trials = self.decay * self._trials + trials

