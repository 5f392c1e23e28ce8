"""Tests for radixlm.runtime.execution.sampling: exactness of greedy, distributional
correctness of sampling (chi-square goodness of fit), per-request seeded reproducibility,
penalties, masks, logprobs."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import pytest
import torch

from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.execution.sampling.logit_processing import apply_penalties, mask_tokens
from radixlm.runtime.execution.sampling.logprobs import compute_logprobs
from radixlm.runtime.execution.sampling.sampler import SamplingBatch, sample

CPU = torch.device("cpu")
# A toy distribution over 8 tokens, deliberately not sorted so that index bookkeeping in the
# sort-based filters is exercised.
TOY_LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.0, -2.0, 1.5, 0.0, -0.5])
DRAWS = 20_000
P_MIN = 1e-3


def build(params: Sequence[SamplingParams], vocab: int,
          generators: Sequence[torch.Generator | None] | None = None) -> SamplingBatch:
    gens = list(generators) if generators is not None else [None] * len(params)
    return SamplingBatch.build(params, gens, vocab, CPU)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def draw_toy(params: SamplingParams, n: int = DRAWS) -> torch.Tensor:
    """Token counts [V] of n draws of the toy distribution, one draw per batch row."""
    logits = TOY_LOGITS.expand(n, -1).clone()
    tokens = sample(logits, build([params] * n, TOY_LOGITS.numel()))
    return torch.bincount(tokens, minlength=TOY_LOGITS.numel())


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test over the support of probs.

    Also asserts that nothing outside the support was drawn: that is a hard property of the
    truncating filters, not a statistical one.
    """
    counts = counts.double()
    probs = probs.double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    if support.sum() == 1:
        return 1.0  # a point mass: the support check above was the whole test
    expected = probs[support] / probs[support].sum() * counts.sum()
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum() - 1), dtype=torch.float64)
    # Survival function of chi2(dof) is the regularized upper incomplete gamma Q(dof/2, x/2).
    return float(torch.special.gammaincc(dof / 2, chi2 / 2))


def toy_probs(temperature: float) -> torch.Tensor:
    return torch.softmax(TOY_LOGITS.double() / temperature, dim=-1)


def truncate(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def nucleus(probs: torch.Tensor, top_p: float) -> list[int]:
    """Reference nucleus: the smallest most-likely-first prefix whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    keep, mass = [], 0.0
    for i in order:
        keep.append(i)
        mass += float(probs[i])
        # Keep the test away from the float-rounding knife edge at the exact boundary.
        assert abs(mass - top_p) > 1e-3, "pick a top_p away from a cumulative-mass boundary"
        if mass >= top_p:
            break
    return keep


# --------------------------------------------------------------------------------------------
# Build


def test_build_normalises_params() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=0.8, top_k=-1),
        SamplingParams(temperature=0.8, top_k=0),
        SamplingParams(temperature=0.8, top_k=500),
        SamplingParams(temperature=0.8, top_k=5),
    ]
    gens = [seeded(1), seeded(2), None, seeded(3), None, None]
    batch = SamplingBatch.build(params, gens, 100, CPU)
    assert batch.temperatures.tolist() == pytest.approx([0.0, 0.0, 0.8, 0.8, 0.8, 0.8])
    assert batch.top_ks.tolist() == [100, 1, 100, 100, 100, 5]
    assert batch.top_ks.dtype == torch.int64 and batch.temperatures.dtype == torch.float32
    # Greedy rows never draw, so their generators are dropped.
    assert batch.generators[0] is None and batch.generators[1] is None
    assert batch.generators[3] is gens[3]
    assert not batch.all_greedy and batch.needs_top_k
    assert not (batch.needs_top_p or batch.needs_min_p or batch.needs_penalties)


def test_build_flags_ignore_greedy_rows() -> None:
    batch = build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2)], 10)
    assert batch.all_greedy
    assert not (batch.needs_top_k or batch.needs_top_p or batch.needs_min_p)
    batch = build([SamplingParams(temperature=0.0, repetition_penalty=1.2)], 10)
    assert batch.needs_penalties  # penalties change the argmax, so greedy rows need them


def test_build_rejects_generator_count_mismatch() -> None:
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()], [], 10, CPU)


# --------------------------------------------------------------------------------------------
# Greedy


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    tokens = sample(logits, build([SamplingParams(temperature=0.0)] * 16, 1000))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 1000)
    tokens = sample(logits, build([SamplingParams(temperature=1.0, top_k=1)] * 64, 1000))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_truncation_path_with_top_k_one_is_argmax() -> None:
    # Bypass build()'s greedy shortcut so the sort/threshold path itself is checked.
    torch.manual_seed(2)
    logits = torch.randn(64, 1000)
    batch = build([SamplingParams(temperature=1.0, top_k=2)] * 64, 1000)
    batch.top_ks = torch.ones(64, dtype=torch.int64)
    assert torch.equal(sample(logits, batch), logits.argmax(dim=-1))
    # A nucleus smaller than the top token's mass keeps only the argmax as well.
    batch = build([SamplingParams(temperature=1.0, top_p=1e-6)] * 64, 1000)
    assert torch.equal(sample(logits, batch), logits.argmax(dim=-1))


def test_mixed_greedy_and_sampling_rows() -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 1000)
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 1.0) for r in range(8)]
    tokens = sample(logits, build(params, 1000))
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
    # With 1000 near-flat logits the sampled rows almost surely differ from the argmax.
    assert not torch.equal(tokens[1::2], logits[1::2].argmax(dim=-1))


# --------------------------------------------------------------------------------------------
# Distributions (chi-square goodness of fit)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.8])
def test_sampling_matches_softmax(temperature: float) -> None:
    torch.manual_seed(10)
    counts = draw_toy(SamplingParams(temperature=temperature))
    assert chi_square_p(counts, toy_probs(temperature)) > P_MIN


def test_chi_square_detects_wrong_temperature() -> None:
    # The goodness-of-fit test has power: draws at temperature 0.7 are rejected as softmax(x).
    torch.manual_seed(11)
    counts = draw_toy(SamplingParams(temperature=0.7))
    assert chi_square_p(counts, toy_probs(1.0)) < 1e-6


def test_per_row_temperatures_in_one_batch() -> None:
    torch.manual_seed(12)
    temps = [0.7, 1.5]
    rows = [SamplingParams(temperature=temps[r % 2]) for r in range(2 * DRAWS)]
    logits = TOY_LOGITS.expand(len(rows), -1).clone()
    tokens = sample(logits, build(rows, TOY_LOGITS.numel()))
    for parity, t in enumerate(temps):
        counts = torch.bincount(tokens[parity::2], minlength=TOY_LOGITS.numel())
        assert chi_square_p(counts, toy_probs(t)) > P_MIN


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_top_k_distribution(top_k: int) -> None:
    torch.manual_seed(20)
    probs = toy_probs(0.9)
    keep = probs.argsort(descending=True)[:top_k].tolist()
    counts = draw_toy(SamplingParams(temperature=0.9, top_k=top_k))
    assert chi_square_p(counts, truncate(probs, keep)) > P_MIN


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.85, 0.97])
def test_top_p_distribution(top_p: float) -> None:
    torch.manual_seed(21)
    probs = toy_probs(1.0)
    counts = draw_toy(SamplingParams(temperature=1.0, top_p=top_p))
    assert chi_square_p(counts, truncate(probs, nucleus(probs, top_p))) > P_MIN


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.5])
def test_min_p_distribution(min_p: float) -> None:
    torch.manual_seed(22)
    probs = toy_probs(1.2)
    keep = [i for i in range(len(probs)) if probs[i] >= min_p * probs.max()]
    counts = draw_toy(SamplingParams(temperature=1.2, min_p=min_p))
    assert chi_square_p(counts, truncate(probs, keep)) > P_MIN


def test_top_k_then_top_p_renormalises() -> None:
    # top-p is applied to the distribution renormalised after top-k.
    torch.manual_seed(23)
    probs = toy_probs(1.0)
    after_k = truncate(probs, probs.argsort(descending=True)[:4].tolist())
    keep = nucleus(after_k, 0.7)
    # The chosen top_p discriminates: on the raw distribution the nucleus would be larger.
    assert len(keep) < len(nucleus(probs, 0.7))
    counts = draw_toy(SamplingParams(temperature=1.0, top_k=4, top_p=0.7))
    assert chi_square_p(counts, truncate(probs, keep)) > P_MIN


def test_seeded_rows_match_softmax() -> None:
    # Each row has its own seed, so the seeded draw path is checked for distribution too.
    n = 4000
    logits = TOY_LOGITS.expand(n, -1).clone()
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    tokens = sample(logits, build(params, TOY_LOGITS.numel(), [seeded(s) for s in range(n)]))
    counts = torch.bincount(tokens, minlength=TOY_LOGITS.numel())
    assert chi_square_p(counts, toy_probs(1.0)) > P_MIN


# --------------------------------------------------------------------------------------------
# Seeded reproducibility

VOCAB = 512
STEPS = 6


def step_logits(key: int, step: int) -> torch.Tensor:
    """Deterministic per-request, per-step logits (as a model would produce)."""
    g = torch.Generator().manual_seed(1000 * key + step)
    return torch.randn(VOCAB, generator=g) * 0.5


def run(requests: list[tuple[int, SamplingParams]]) -> list[list[int]]:
    """Decode STEPS tokens for each (key, params) row batched together; seeded rows get a
    generator made from their seed once, as the engine would."""
    gens = [seeded(p.seed) if p.seed is not None else None for _, p in requests]
    params = [p for _, p in requests]
    out: list[list[int]] = [[] for _ in requests]
    for step in range(STEPS):
        logits = torch.stack([step_logits(key, step) for key, _ in requests])
        tokens = sample(logits, SamplingBatch.build(params, gens, VOCAB, CPU)).tolist()
        for row, tok in enumerate(tokens):
            out[row].append(tok)
    return out


TARGETS = [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.8, top_k=40, seed=7),
    SamplingParams(temperature=1.1, top_p=0.9, seed=7),
    SamplingParams(temperature=1.0, min_p=0.1, seed=7),
]
NEIGHBOURS = [
    (1, SamplingParams(temperature=1.0)),
    (2, SamplingParams(temperature=0.6, top_k=10, seed=123)),
    (3, SamplingParams(temperature=0.0)),
    (4, SamplingParams(temperature=1.3, top_p=0.5, min_p=0.05)),
    (5, SamplingParams(temperature=0.9, seed=99)),
]


@pytest.mark.parametrize("target", TARGETS)
def test_seeded_row_independent_of_batch(target: SamplingParams) -> None:
    torch.manual_seed(0)
    alone = run([(0, target)])[0]
    assert len(set(alone)) > 1  # the row really samples
    for position in (0, 2, len(NEIGHBOURS)):
        torch.manual_seed(position + 1)  # the default RNG state must not matter either
        batch = list(NEIGHBOURS)
        batch.insert(position, (0, target))
        assert run(batch)[position] == alone, f"differs at row {position}"
    # Sanity: the seed does matter.
    other = target.replace(seed=8)
    assert run([(0, other)])[0] != alone


def test_unseeded_rows_follow_default_rng() -> None:
    batch = [(k, SamplingParams(temperature=1.0)) for k in range(4)]
    torch.manual_seed(42)
    first = run(batch)
    torch.manual_seed(42)
    assert run(batch) == first


# --------------------------------------------------------------------------------------------
# Penalties


def reference_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                        prompt_ids: Sequence[Sequence[int]],
                        output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    out = logits.clone()
    for r, p in enumerate(params):
        for t in set(prompt_ids[r]) | set(output_ids[r]):
            x = float(out[r, t])
            out[r, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(output_ids[r]).items():
            out[r, t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_reference() -> None:
    torch.manual_seed(30)
    vocab = 50
    logits = torch.randn(5, vocab) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.0),
        SamplingParams(),  # neutral row in a penalized batch
        SamplingParams(repetition_penalty=2.0, presence_penalty=-1.5),
    ]
    prompt_ids = [[1, 2, 3, 3], [4, 5], [], [1, 2, 3], [7, 7, 8, 9, 10, 11]]
    output_ids = [[3, 6, 6], [5, 5, 5, 6], [0, 49, 49], [9, 9], []]
    got = apply_penalties(logits, build(params, vocab), prompt_ids, output_ids)
    want = reference_penalties(logits, params, prompt_ids, output_ids)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3], logits[3])  # neutral row untouched, bit for bit
    assert not torch.equal(got, logits)


def test_penalties_ignore_out_of_range_ids() -> None:
    logits = torch.randn(1, 10)
    batch = build([SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)], 10)
    got = apply_penalties(logits, batch, [[-1, 2]], [[10, 13, 2]])
    want = reference_penalties(logits, [SamplingParams(repetition_penalty=1.5,
                                                       frequency_penalty=1.0)], [[2]], [[2]])
    torch.testing.assert_close(got, want)


def test_penalties_skipped_when_unused() -> None:
    logits = torch.randn(2, 10)
    batch = build([SamplingParams(), SamplingParams(temperature=0.0)], 10)
    assert apply_penalties(logits, batch, [[1, 2], [3]], [[4], []]) is logits


def test_penalties_all_empty_histories() -> None:
    logits = torch.randn(2, 10)
    batch = build([SamplingParams(repetition_penalty=1.5)] * 2, 10)
    assert torch.equal(apply_penalties(logits, batch, [[], []], [[], []]), logits)


# --------------------------------------------------------------------------------------------
# Masks


def test_mask_tokens_bans_ids() -> None:
    torch.manual_seed(40)
    logits = torch.randn(4, 20)
    logits[1, 5] = logits[3, 7] = 100.0  # the banned ids would otherwise win
    original = logits.clone()
    masked = mask_tokens(logits, [1, 3], [[5, 6], [7, 99, -1]])  # out-of-range ids ignored
    assert torch.equal(logits, original)  # input not modified
    assert masked[1, 5] == masked[1, 6] == masked[3, 7] == float("-inf")
    untouched = torch.isfinite(masked)
    assert untouched.sum() == logits.numel() - 3
    assert torch.equal(masked[untouched], logits[untouched])
    greedy = sample(masked, build([SamplingParams(temperature=0.0)] * 4, 20))
    assert greedy[1] != 5 and greedy[3] != 7
    many = masked[[1, 3]].repeat(500, 1)
    drawn = sample(many, build([SamplingParams(temperature=1.0)] * 1000, 20))
    assert not ((drawn[0::2] == 5) | (drawn[0::2] == 6)).any()
    assert not (drawn[1::2] == 7).any()


def test_mask_tokens_no_rows() -> None:
    logits = torch.randn(2, 5)
    assert torch.equal(mask_tokens(logits, [], []), logits)


# --------------------------------------------------------------------------------------------
# Logprobs


def test_compute_logprobs() -> None:
    torch.manual_seed(50)
    logits = torch.randn(6, 100) * 2
    tokens = torch.randint(0, 100, (6,))
    chosen, top_vals, top_ids = compute_logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chosen, ref[torch.arange(6), tokens])
    assert top_vals is not None and top_ids is not None
    assert top_vals.shape == top_ids.shape == (6, 5)
    torch.testing.assert_close(top_vals, ref.sort(dim=-1, descending=True).values[:, :5])
    torch.testing.assert_close(ref.gather(1, top_ids), top_vals)
    assert torch.equal(top_ids[:, 0], logits.argmax(dim=-1))


def test_compute_logprobs_without_top_n_and_clamped() -> None:
    logits = torch.randn(3, 4)
    chosen, vals, ids = compute_logprobs(logits, torch.tensor([0, 1, 2]), 0)
    assert vals is None and ids is None and chosen.shape == (3,)
    _, vals, ids = compute_logprobs(logits, torch.tensor([0, 1, 2]), 10)
    assert vals is not None and ids is not None and vals.shape == (3, 4)
    assert torch.equal(ids.sort(dim=-1).values, torch.arange(4).expand(3, -1))


def test_logit_bias_adds_per_row_and_leaves_the_input_alone() -> None:
    from radixlm.runtime.execution.sampling.logit_processing import apply_logit_bias

    logits = torch.zeros(3, 8)
    out = apply_logit_bias(logits, [0, 2], [((1, 5.0), (7, -100.0)), ((3, 2.5),)])
    expected = torch.zeros(3, 8)
    expected[0, 1], expected[0, 7], expected[2, 3] = 5.0, -100.0, 2.5
    assert torch.equal(out, expected) and torch.equal(logits, torch.zeros(3, 8))


@pytest.mark.parametrize("bias, message", [
    ({"x": 1}, "keys must be token ids"), ({"3": 101}, "[-100, 100]"),
    ({"3": float("nan")}, "[-100, 100]"), ([1, 2], "map token ids"),
    ({"\u0661\u0662": 1}, "keys must be token ids"),  # Arabic-Indic digits: not an id
    ({str(i): 1 for i in range(1025)}, "at most 1024"),
])
def test_logit_bias_is_checked(bias, message) -> None:
    with pytest.raises(ValueError, match="logit_bias") as error:
        SamplingParams(logit_bias=bias)
    assert message in str(error.value)
    assert SamplingParams(logit_bias={"5": 1, 2: -3.5}).logit_bias == ((2, -3.5), (5, 1.0))
