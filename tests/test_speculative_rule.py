"""Tests for radixlm.runtime.execution.speculative: greedy verification against a naive loop, the
sampling rule's output distribution (chi-square goodness of fit on toy distributions, one
position at a time and jointly over a Markov chain), seeded reproducibility, n-gram drafting
against a naive search, grammar truncation and the adaptive draft length."""

from __future__ import annotations

import itertools
import random
from typing import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.execution.sampling.sampler import SamplingBatch, sample
from radixlm.runtime.execution.speculative import (
    PAD_TOKEN,
    AdaptiveK,
    NgramIndex,
    propose_ngram,
    sampling_probs,
    verify_greedy,
    verify_sampling,
    verify_tokens,
)

CPU = torch.device("cpu")
P_MIN = 1e-3  # fixed seeds make every test deterministic; this only sets how strict it is


@pytest.fixture(autouse=True)
def fixed_default_rng():
    """Unseeded rows use the default generator: seed it, and leave it as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square goodness of fit of counts to probs.

    Asserts first that nothing was drawn outside the support of probs: that is exact, not
    statistical. The survival function of chi2(df) is the regularized upper incomplete gamma
    function Q(df / 2, x / 2).
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {counts.tolist()}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    assert expected.min() >= 5, "too few samples per cell for the chi-square approximation"
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


# --------------------------------------------------------------------------------------------
# Greedy


def logits_with_argmax(tokens: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[B, T, V] random logits whose argmax at [b, t] is tokens[b][t]."""
    target = torch.tensor(tokens, dtype=torch.int64)
    logits = torch.randn(*target.shape, vocab)
    return logits.scatter(2, target.unsqueeze(2), logits.abs().amax().item() + 1.0)


def naive_greedy(drafts: list[list[int]], targets: list[list[int]],
                 num_drafts: list[int]) -> list[list[int]]:
    out = []
    for row_drafts, row_targets, n in zip(drafts, targets, num_drafts):
        emitted = []
        for i in range(n):
            if row_drafts[i] != row_targets[i]:
                break
            emitted.append(row_drafts[i])
        emitted.append(row_targets[len(emitted)])
        out.append(emitted)
    return out


@pytest.mark.parametrize("drafts, targets, num_drafts, accepted, output", [
    # all accepted: the bonus token follows
    ([3, 1, 4], [3, 1, 4, 7], 3, 3, [3, 1, 4, 7]),
    # first rejected: only the target's correction
    ([3, 1, 4], [2, 1, 4, 7], 3, 0, [2, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]),
    # middle rejected: a later agreement does not count
    ([3, 1, 4], [3, 5, 4, 7], 3, 1, [3, 5, PAD_TOKEN, PAD_TOKEN]),
    # fewer drafts than the batch width: padding that happens to agree is not accepted
    ([3, 1, 4], [3, 1, 4, 7], 1, 1, [3, 1, PAD_TOKEN, PAD_TOKEN]),
    ([3, PAD_TOKEN, PAD_TOKEN], [3, 6, 0, 0], 1, 1, [3, 6, PAD_TOKEN, PAD_TOKEN]),
    # no drafts: a plain decode step
    ([3, 1, 4], [5, 1, 4, 7], 0, 0, [5, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]),
])
def test_verify_greedy_cases(drafts, targets, num_drafts, accepted, output):
    logits = logits_with_argmax([targets], vocab=8)
    result = verify_greedy(torch.tensor([drafts]), logits, torch.tensor([num_drafts]))
    assert result.num_accepted.tolist() == [accepted]
    assert result.output_tokens.tolist() == [output]
    assert result.emitted() == [output[: accepted + 1]]


def test_verify_greedy_ragged_batch_and_k0():
    drafts = [[3, 1, 4], [2, 2, PAD_TOKEN], [5, 5, 5], [0, 0, 0]]
    targets = [[3, 1, 4, 7], [2, 2, 6, 1], [5, 4, 5, 5], [1, 0, 0, 0]]
    num_drafts = [3, 2, 3, 0]
    result = verify_greedy(torch.tensor(drafts), logits_with_argmax(targets, 8), num_drafts)
    assert result.num_accepted.tolist() == [3, 2, 1, 0]
    assert result.emitted() == [[3, 1, 4, 7], [2, 2, 6], [5, 4], [1]]

    # k = 0 for the whole batch: the argmax of the single position
    logits = logits_with_argmax([[4], [6]], 8)
    result = verify_greedy(torch.empty(2, 0, dtype=torch.int64), logits, [0, 0])
    assert result.num_accepted.tolist() == [0, 0]
    assert result.output_tokens.tolist() == [[4], [6]]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_verify_greedy_matches_naive_loop(data):
    rows = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(0, 5))
    vocab = data.draw(st.integers(2, 4))  # small: drafts agree with the target often
    token = st.integers(0, vocab - 1)
    drafts = data.draw(st.lists(st.lists(token, min_size=k, max_size=k), min_size=rows,
                                max_size=rows))
    targets = data.draw(st.lists(st.lists(token, min_size=k + 1, max_size=k + 1),
                                 min_size=rows, max_size=rows))
    num_drafts = data.draw(st.lists(st.integers(0, k), min_size=rows, max_size=rows))
    expected = naive_greedy(drafts, targets, num_drafts)
    draft_t = torch.tensor(drafts, dtype=torch.int64).view(rows, k)
    by_tokens = verify_tokens(draft_t, torch.tensor(targets), torch.tensor(num_drafts))
    by_logits = verify_greedy(draft_t, logits_with_argmax(targets, vocab), num_drafts)
    assert by_tokens.emitted() == expected
    assert by_logits.emitted() == expected
    assert by_logits.num_accepted.tolist() == [len(e) - 1 for e in expected]
    # everything past the emitted tokens is padding
    for row, emitted in zip(by_logits.output_tokens.tolist(), expected):
        assert row[len(emitted):] == [PAD_TOKEN] * (k + 1 - len(emitted))


# --------------------------------------------------------------------------------------------
# Sampling: distributions, one position at a time

# Target p_i and draft q_i over 6 tokens at 3 draft positions (+ the bonus position).
# They differ on purpose: q puts mass where p has none (token 5 at position 0) and misses
# tokens p allows (token 0 at position 1), so acceptance, residual and bonus all matter.
P = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
    [0.10, 0.40, 0.05, 0.05, 0.20, 0.20],
    [0.05, 0.05, 0.30, 0.30, 0.15, 0.15],
    [0.20, 0.20, 0.20, 0.10, 0.20, 0.10],
], dtype=torch.float64)
Q = torch.tensor([
    [0.05, 0.40, 0.05, 0.20, 0.10, 0.20],
    [0.00, 0.20, 0.30, 0.10, 0.20, 0.20],
    [0.30, 0.05, 0.05, 0.30, 0.15, 0.15],
], dtype=torch.float64)
ROWS = 40_000


def draft_from(q: torch.Tensor, rows: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, k] drafts, column i drawn from q[i]."""
    return torch.stack([torch.multinomial(q_i.float(), rows, replacement=True, generator=gen)
                        for q_i in q], dim=1)


@pytest.mark.parametrize("proposals", ["sampled", "point-mass"])
def test_each_emitted_position_follows_the_target(proposals):
    k = Q.shape[0]
    if proposals == "sampled":
        drafts = draft_from(Q, ROWS, seeded(0))
        draft_probs = Q.float().expand(ROWS, -1, -1)
        q = Q
    else:  # deterministic proposals (n-gram): the draft "distribution" is a point mass
        drafts = torch.tensor([[1, 4, 2]]).expand(ROWS, -1)
        draft_probs = None
        q = torch.nn.functional.one_hot(drafts[0], P.shape[1]).double()
    result = verify_sampling(drafts, draft_probs, P.float().expand(ROWS, -1, -1),
                             torch.full((ROWS,), k), [None] * ROWS)
    accepted, tokens = result.num_accepted, result.output_tokens
    for i in range(k + 1):
        # Position i is emitted when the drafts before it were accepted; since the toy
        # distributions do not depend on context, it must then be distributed as p_i.
        reached = accepted >= i
        counts = torch.bincount(tokens[reached, i], minlength=P.shape[1])
        assert chi_square_p(counts, P[i]) > P_MIN, (i, counts.tolist())
        if i < k:
            # A draft that is reached is accepted with probability sum(min(p_i, q_i)).
            rate = torch.minimum(P[i], q[i]).sum().item()
            observed = (accepted[reached] > i).double().mean().item()
            sigma = (rate * (1 - rate) / reached.sum().item()) ** 0.5
            assert abs(observed - rate) < 5 * sigma + 1e-9, (i, observed, rate)


def test_chi_square_has_power():
    """The drafts themselves do not follow p: the same test must reject them."""
    drafts = draft_from(Q, ROWS, seeded(0))
    assert chi_square_p(torch.bincount(drafts[:, 1], minlength=6), P[1]) < 1e-6


# --------------------------------------------------------------------------------------------
# Sampling: the joint distribution of several tokens, over verification rounds

# A Markov chain: the target's next-token distribution given the previous token, and a
# draft that disagrees with it. Over rounds of k drafts, the emitted sequences must be
# distributed as the target's chain.
P_CHAIN = torch.tensor([
    [0.50, 0.30, 0.10, 0.10],
    [0.20, 0.20, 0.40, 0.20],
    [0.30, 0.10, 0.30, 0.30],
    [0.25, 0.25, 0.25, 0.25],
], dtype=torch.float64)
Q_CHAIN = torch.tensor([
    [0.10, 0.60, 0.00, 0.30],
    [0.70, 0.10, 0.10, 0.10],
    [0.30, 0.10, 0.30, 0.30],
    [0.00, 0.00, 0.90, 0.10],
], dtype=torch.float64)


def run_chain(rows: int, length: int, k: int, point_mass: bool) -> torch.Tensor:
    """[rows, length] tokens generated after context token 0 by rounds of speculation."""
    gen = seeded(1)
    sequences: list[list[int]] = [[0] for _ in range(rows)]
    while True:
        todo = [r for r in range(rows) if len(sequences[r]) < length + 1]
        if not todo:
            break
        last = torch.tensor([sequences[r][-1] for r in todo])
        # Draft k tokens autoregressively from the draft chain (or its argmax).
        drafts, draft_probs, prev = [], [], last
        for _ in range(k):
            q = Q_CHAIN[prev].float()  # [n, V]
            nxt = q.argmax(1) if point_mass else torch.multinomial(q, 1, generator=gen)[:, 0]
            drafts.append(nxt)
            draft_probs.append(q)
            prev = nxt
        drafts_t = torch.stack(drafts, 1)  # [n, k]
        # The target scores the context and every draft prefix.
        contexts = torch.cat([last[:, None], drafts_t], 1)  # [n, k + 1]
        target = P_CHAIN[contexts].float()  # [n, k + 1, V]
        result = verify_sampling(drafts_t, None if point_mass else torch.stack(draft_probs, 1),
                                 target, [k] * len(todo), [None] * len(todo))
        for r, emitted in zip(todo, result.emitted()):
            sequences[r].extend(emitted)
    return torch.tensor([s[1: length + 1] for s in sequences])


@pytest.mark.parametrize("point_mass", [False, True])
def test_sequences_follow_the_target_chain(point_mass):
    length, vocab = 3, P_CHAIN.shape[0]
    tokens = run_chain(20_000, length, k=2, point_mass=point_mass)
    cells = tokens[:, 0] * vocab ** 2 + tokens[:, 1] * vocab + tokens[:, 2]
    counts = torch.bincount(cells, minlength=vocab ** length)
    expected = torch.tensor([P_CHAIN[0, a] * P_CHAIN[a, b] * P_CHAIN[b, c]
                             for a, b, c in itertools.product(range(vocab), repeat=length)])
    assert chi_square_p(counts, expected) > P_MIN


# --------------------------------------------------------------------------------------------
# Sampling: edge cases


def test_impossible_draft_is_always_rejected():
    rows = 500
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]).expand(rows, -1, -1)
    drafts = torch.zeros(rows, 1, dtype=torch.int64)  # token 0, which p_0 does not allow
    result = verify_sampling(drafts, None, p, [1] * rows, [None] * rows)
    assert result.num_accepted.eq(0).all()
    assert set(result.output_tokens[:, 0].tolist()) == {1, 2}


def test_empty_residual_falls_back_to_the_target():
    """Rounding can make q >= p everywhere (here q is over-normalised on purpose): after a
    rejection the residual is then zero and the token must still come from p."""
    rows = 3000
    p = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]]).expand(rows, -1, -1)
    q = torch.tensor([[[0.0, 0.6, 0.5]]]).expand(rows, -1, -1)
    drafts = torch.ones(rows, 1, dtype=torch.int64)
    result = verify_sampling(drafts, q, p, [1] * rows, [None] * rows)
    rejected = result.num_accepted == 0
    assert 300 < rejected.sum() < 700  # accepted with probability 0.5 / 0.6
    assert set(result.output_tokens[rejected, 0].tolist()) == {1, 2}


def test_rows_without_drafts_and_padding():
    rows = 4000
    p = P.float()[[0, 1]].expand(rows, -1, -1)  # k = 1
    drafts = torch.full((rows, 1), PAD_TOKEN)  # padding only: nobody has a draft
    result = verify_sampling(drafts, None, p, torch.zeros(rows, dtype=torch.int64),
                             [None] * rows)
    assert result.num_accepted.eq(0).all()
    assert result.output_tokens[:, 1].eq(PAD_TOKEN).all()
    counts = torch.bincount(result.output_tokens[:, 0], minlength=6)
    assert chi_square_p(counts, P[0]) > P_MIN


def test_greedy_rows_match_verify_greedy():
    """One-hot targets (sampling_probs of a temperature-0 row) make the rule greedy."""
    rows, k, vocab = 64, 3, 5
    target_tokens = torch.randint(0, vocab, (rows, k + 1))
    # Drafts agree with the target often, so that acceptance runs of every length occur.
    agree = torch.rand(rows, k) < 0.7
    drafts = torch.where(agree, target_tokens[:, :k], torch.randint(0, vocab, (rows, k)))
    num_drafts = torch.randint(0, k + 1, (rows,))
    logits = logits_with_argmax(target_tokens.tolist(), vocab)
    params = [SamplingParams(temperature=0.0) if r % 2 else SamplingParams(temperature=0.8)
              for r in range(rows)]
    batch = SamplingBatch.build(params, [None] * rows, vocab, CPU)
    probs = sampling_probs(logits, batch)
    draft_probs = torch.softmax(torch.randn(rows, k, vocab), -1)
    expected = verify_greedy(drafts, logits, num_drafts).emitted()
    for q in (None, draft_probs):
        got = verify_sampling(drafts, q, probs, num_drafts, [seeded(r) for r in range(rows)])
        greedy_rows = range(1, rows, 2)
        assert [got.emitted()[r] for r in greedy_rows] == [expected[r] for r in greedy_rows]


# --------------------------------------------------------------------------------------------
# Sampling: reproducibility and consistency with the sampler


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 6
    outcomes = set()
    for seed in range(30):
        drafts = torch.tensor([2, 3])  # this row's two drafts
        p = torch.softmax(torch.randn(3, vocab), -1)
        q = torch.softmax(torch.randn(2, vocab), -1)

        def run(position: int, rows: int, k: int):
            # The row of interest at `position`; the others random, seeded or not, with
            # their own draft counts; the batch width k >= 2 pads this row's drafts.
            all_drafts = torch.randint(0, vocab, (rows, k))
            all_p = torch.softmax(torch.randn(rows, k + 1, vocab), -1)
            all_q = torch.softmax(torch.randn(rows, k, vocab), -1)
            counts = torch.randint(0, k + 1, (rows,)).tolist()
            gens = [seeded(1000 + r) if r % 2 else None for r in range(rows)]
            all_drafts[position, :2], all_p[position, :3], all_q[position, :2] = drafts, p, q
            counts[position], gens[position] = 2, seeded(seed)
            result = verify_sampling(all_drafts, all_q, all_p, counts, gens)
            return result.emitted()[position]

        first = run(0, 3, 2)
        assert run(4, 7, 5) == first
        assert run(1, 2, 3) == first
        outcomes.add(tuple(first))
    assert len(outcomes) > 3  # the seed matters: the row is really random


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=0.0),
], ids=["temperature", "top_k", "top_p", "min_p", "greedy"])
def test_no_drafts_samples_like_the_sampler(params):
    """With no drafts a seeded row draws what `sample` draws and picks the same token; this
    also checks that sampling_probs is the distribution `sample` uses."""
    rows, vocab = 50, 10
    logits = torch.randn(rows, vocab) * 2
    reference = sample(logits, SamplingBatch.build(
        [params] * rows, [seeded(s) for s in range(rows)], vocab, CPU))
    batch = SamplingBatch.build([params] * rows, [None] * rows, vocab, CPU)
    probs = sampling_probs(logits[:, None, :], batch)
    assert torch.allclose(probs.sum(-1), torch.ones(rows, 1))
    gens = [seeded(s) for s in range(rows)] if params.temperature > 0 else [None] * rows
    result = verify_sampling(torch.empty(rows, 0, dtype=torch.int64), None, probs,
                             [0] * rows, gens)
    assert result.output_tokens[:, 0].tolist() == reference.tolist()


def test_sampling_probs_truncates_per_position():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])  # [1, 2, 4]
    batch = SamplingBatch.build([SamplingParams(top_k=2)], [None], 4, CPU)
    probs = sampling_probs(logits, batch)
    assert probs[0, 0, 2:].eq(0).all() and probs[0, 1, :2].eq(0).all()
    expected = torch.softmax(torch.tensor([3.0, 2.0]), 0)
    assert torch.allclose(probs[0, 0, :2], expected)
    assert torch.allclose(probs[0, 1, 2:], expected.flip(0))


# --------------------------------------------------------------------------------------------
# N-gram proposals


def naive_ngram(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Longest suffix n-gram, latest earlier occurrence, copy what follows (into the copy
    itself once the context runs out)."""
    length = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[length:]
    return []


def both(tokens: list[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    stateless = propose_ngram(tokens, k, max_ngram, min_ngram)
    indexed = NgramIndex(tokens, max_ngram, min_ngram).propose(k)
    assert stateless == indexed
    return stateless


def test_ngram_finds_the_continuation():
    assert both([1, 2, 3, 4, 9, 9, 1, 2, 3], 2) == [4, 9]
    assert both([1, 2, 3, 4, 9, 9, 1, 2, 3], 4) == [4, 9, 9, 1]


def test_ngram_prefers_the_longest_match():
    # The 3-gram 5 6 7 occurred at the start (then 8); the 1-gram 7 more recently (then 1).
    tokens = [5, 6, 7, 8, 0, 7, 1, 5, 6, 7]
    assert both(tokens, 1) == [8]
    assert both(tokens, 1, max_ngram=1) == [1]


def test_ngram_no_match_min_ngram_and_k():
    assert both([1, 2, 3, 4], 3) == []
    assert both([], 3) == [] and both([7], 3) == []
    assert both([1, 2, 1], 2) == [2, 1]
    assert both([1, 2, 1], 2, min_ngram=2) == []
    tokens = list(range(20)) + list(range(5))
    assert both(tokens, 0) == []
    assert both(tokens, 1) == [5]
    assert both(tokens, 8) == [5, 6, 7, 8, 9, 10, 11, 12]


def test_ngram_continues_a_cycle():
    assert both([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert both([4, 4, 4], 3) == [4, 4, 4]


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=40), k=st.integers(0, 6),
       max_ngram=st.integers(1, 4), data=st.data())
def test_ngram_matches_naive_search(tokens, k, max_ngram, data):
    min_ngram = data.draw(st.integers(1, max_ngram))
    assert propose_ngram(tokens, k, max_ngram, min_ngram) == naive_ngram(
        tokens, k, max_ngram, min_ngram)
    # The index, grown in random chunks, agrees after every chunk.
    index = NgramIndex(max_ngram=max_ngram, min_ngram=min_ngram)
    position = 0
    while position < len(tokens):
        step = data.draw(st.integers(1, 5))
        index.extend(tokens[position: position + step])
        position = len(index)
        assert index.propose(k) == naive_ngram(tokens[:position], k, max_ngram, min_ngram)


def test_ngram_on_a_long_context():
    """A few thousand tokens with repeated passages, as in code editing or summarising: the
    two implementations agree step after step (no timing assertions: benchmarks time)."""
    rng = random.Random(0)
    passage = [rng.randrange(2000) for _ in range(300)]
    prompt = [rng.randrange(2000) for _ in range(1500)] + passage + \
        [rng.randrange(2000) for _ in range(1500)] + passage[:50]
    index = NgramIndex(prompt)
    context = list(prompt)
    hits = 0
    for _ in range(300):
        proposal = index.propose(5)
        assert proposal == propose_ngram(context, 5)
        hits += bool(proposal)
        token = proposal[0] if proposal and rng.random() < 0.9 else rng.randrange(2000)
        context.append(token)
        index.append(token)
    assert hits > 200


# --------------------------------------------------------------------------------------------
# Adaptive k


def test_adaptive_k_follows_acceptance():
    adaptive = AdaptiveK(k_max=8)
    for _ in range(40):
        adaptive.update(adaptive.k, adaptive.k)  # everything accepted
    assert adaptive.k == 8 and adaptive.acceptance > 0.95
    for _ in range(80):
        adaptive.update(adaptive.k, 0)  # everything rejected
    assert adaptive.k == 1 and adaptive.acceptance < 0.05
    # 2 of 4 drafts accepted: 2 successes in 3 trials, alpha = 2/3, and
    # k = floor(log 0.25 / log(2/3)) = floor(3.42) = 3.
    for _ in range(80):
        adaptive.update(4, 2)
    assert abs(adaptive.acceptance - 2 / 3) < 0.01 and adaptive.k == 3
    before = adaptive.acceptance
    adaptive.update(0, 0)
    assert adaptive.acceptance == before
