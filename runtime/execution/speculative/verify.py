"""Speculative decoding's lossless acceptance rules, as pure tensor functions (drafting is in
`ngram.py` and `draft_model.py`).

A speculating request proposes k draft tokens x_0 .. x_{k-1}; one target forward scores the
k + 1 positions that follow its context and each draft prefix. Position i holds the target's
distribution p_i for the token after x_0 .. x_{i-1}; position k is the "bonus" position after
all drafts. The verification functions here turn that into the tokens to emit:

    position:        0      1      2      ...   k-1     k
    draft:           x_0    x_1    x_2    ...   x_{k-1}
    target:          p_0    p_1    p_2    ...   p_{k-1}  p_k
    emitted:         x_0 .. x_{a-1} accepted, then one token sampled at position a

so every row emits num_accepted + 1 tokens (a = num_accepted), and the KV of the accepted
drafts stays valid: the engine advances `num_computed_tokens` by a + 1 less the new token.

Sampling rows use the rule of Leviathan et al. 2023 / Chen et al. 2023: accept x_i with
probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from the residual
normalize(max(0, p_i - q_i)); if all are accepted, sample the bonus from p_k. The emitted
tokens are then distributed exactly as if sampled from the target one by one. Greedy rows
accept the longest prefix that agrees with the target's argmax, which makes speculation
token-identical to plain greedy decoding.

Both rules are pure tensor functions over the batch (a cumprod finds the accepted prefix; no
loop over tokens). Randomness follows sampler.py: a seeded row draws from its own generator, a
fixed amount that depends only on that row, so its result does not depend on the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.execution.sampling.sampler import SamplingBatch, truncated_logits

# Fills output_tokens past each row's emitted tokens. Negative on purpose: used as a token id
# by mistake, it fails loudly instead of embedding token 0.
PAD_TOKEN = -1


class Verified(NamedTuple):
    """The outcome of verifying one batch of drafts.

    num_accepted: [B] int64, how many drafts each row accepted (0 .. num_drafts).
    output_tokens: [B, k + 1] int64; row b emits output_tokens[b, : num_accepted[b] + 1]
        (its accepted drafts, then the corrected or bonus token); the rest is PAD_TOKEN.
    """

    num_accepted: torch.Tensor
    output_tokens: torch.Tensor

    def emitted(self) -> list[list[int]]:
        """Each row's emitted tokens as host lists (one device sync for the whole batch)."""
        counts = (self.num_accepted + 1).tolist()
        return [row[:n] for row, n in zip(self.output_tokens.tolist(), counts)]


# --------------------------------------------------------------------------------------------
# Greedy verification


def verify_greedy(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    num_drafts: torch.Tensor | Sequence[int],
) -> Verified:
    """Greedy verification: accept the longest draft prefix equal to the target's argmax.

    draft_tokens: [B, k] int64, row b's drafts in its first num_drafts[b] columns; the rest is
        padding of any value (it is never compared).
    target_logits: [B, k + 1, V] float, position i scored after the first i drafts, with any
        penalties and grammar masks already applied.
    num_drafts: [B] int64 (or a host list), 0 .. k; a row with 0 drafts just decodes.
    """
    return verify_tokens(draft_tokens, target_logits.argmax(dim=-1), num_drafts)


def verify_tokens(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    num_drafts: torch.Tensor | Sequence[int],
) -> Verified:
    """Greedy verification against target tokens already chosen at every position.

    target_tokens: [B, k + 1] int64, the target's token at each position (e.g. its argmax).
    Useful when the caller computes the argmax itself, e.g. on a flattened [B * (k + 1), V]
    logits tensor that went through the sampler's greedy path.
    """
    rows, k = draft_tokens.shape
    _check_shape(target_tokens, (rows, k + 1), "target_tokens")
    device = draft_tokens.device
    num_drafts_t = _as_tensor(num_drafts, device)
    positions = torch.arange(k + 1, device=device)  # [k + 1]
    matches = (draft_tokens == target_tokens[:, :k]) & (positions[:k] < num_drafts_t[:, None])
    # cumprod zeroes everything from the first mismatch on: the sum is the accepted prefix.
    num_accepted = matches.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    # The accepted drafts equal the target's tokens, so the output is the target's tokens up
    # to and including position num_accepted (the correction, or the bonus after all drafts).
    output = target_tokens.masked_fill(positions > num_accepted[:, None], PAD_TOKEN)
    return Verified(num_accepted, output.to(torch.int64))


# --------------------------------------------------------------------------------------------
# Sampling verification


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_drafts: torch.Tensor | Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> Verified:
    """Lossless rejection sampling of drafts against the target distribution.

    draft_tokens: [B, k] int64, row b's drafts in its first num_drafts[b] columns (padding of
        any value after them).
    draft_probs: [B, k, V] float, the distribution q_i each draft was sampled from, or None
        when the drafts are deterministic proposals (n-gram lookup, a greedy draft model):
        q_i is then the point mass on x_i, accepted with probability p_i(x_i), and the
        residual is p_i without x_i, renormalised.
    target_probs: [B, k + 1, V] float, the target's distribution at each position after the
        same processing a plain decode step would apply (penalties, masks, temperature,
        top-k/top-p/min-p); see `sampling_probs`. Each row sums to 1 (up to rounding).
    num_drafts: [B] int64 tensor or host list, 0 .. k. Pass a host list (the scheduler knows
        the counts) to avoid a device sync when seeded rows are present.
    generators: per row, its own generator (seeded requests) or None (the default RNG);
        `SamplingBatch.generators` fits (it already holds None for greedy rows).

    Random draws: a seeded row draws num_drafts[b] Uniform[0, 1) values (one per draft, in
    order) and then V Exp(1) values (one exponential race for the single sampled token) from
    its own generator, so its result depends on nothing but the row. A row with no drafts
    draws exactly what `sampler.sample` draws for it and picks the same token.

    Greedy rows in a sampling batch: pass a one-hot target at the argmax (what
    `sampling_probs` produces for temperature 0). Then a draft is accepted iff it equals the
    argmax, and the sampled token is the argmax: the same output as `verify_greedy`.
    """
    rows, k = draft_tokens.shape
    vocab_size = target_probs.shape[-1]
    _check_shape(target_probs, (rows, k + 1, vocab_size), "target_probs")
    if draft_probs is not None:
        _check_shape(draft_probs, (rows, k, vocab_size), "draft_probs")
    if len(generators) != rows:
        raise ValueError(f"got {len(generators)} generators for {rows} rows; pass one per row")
    device = target_probs.device
    target_probs = target_probs.float()
    num_drafts_t = _as_tensor(num_drafts, device)
    # Padding may be any value (e.g. PAD_TOKEN); clamp it to a valid index for the gathers,
    # its columns are masked out below.
    drafts = draft_tokens.to(torch.int64).clamp(0, vocab_size - 1)
    valid = torch.arange(k, device=device) < num_drafts_t[:, None]  # [B, k]

    seeded = any(g is not None for g in generators)
    counts = _host_counts(num_drafts, rows, k) if seeded else None
    uniforms, noise = _draw(rows, k, vocab_size, counts, generators, device)

    # Accept x_i with probability min(1, p/q): u < p/q, written u * q < p so that q = 0 needs
    # no division and p = 0 always rejects.
    p_x = target_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, k]
    if draft_probs is None:
        accept = uniforms < p_x
    else:
        q_x = draft_probs.float().gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, k]
        accept = uniforms * q_x < p_x
    num_accepted = (accept & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

    # Exactly one token is sampled per row, at position a = num_accepted: from the residual if
    # draft a was rejected (a < num_drafts), else the bonus from p_a.
    batch_index = torch.arange(rows, device=device)
    p_a = target_probs[batch_index, num_accepted]  # [B, V]
    weights = p_a
    if k > 0:
        # Rows that accepted all k drafts have a = k; the clamp only keeps that gather in range
        # (those rows take the bonus, not the residual).
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            # max(0, p - onehot(x)) is p with x zeroed, since p(x) <= 1.
            residual = p_a.scatter(1, drafts[batch_index, at].unsqueeze(1), 0.0)
        else:
            residual = (p_a - draft_probs[batch_index, at].float()).clamp_min(0.0)
        # A zero residual means p == q up to rounding, where a rejection has ~zero probability
        # anyway; fall back to p rather than sample from an empty distribution.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_a)
        rejected = num_accepted < num_drafts_t
        weights = torch.where(rejected[:, None], residual, p_a)
    # Exponential race on unnormalised weights: argmax(w / E) is a sample of w / sum(w).
    sampled = (weights / noise).argmax(dim=1)  # [B]

    positions = torch.arange(k + 1, device=device)
    padded = torch.cat([draft_tokens.to(torch.int64),
                        torch.full((rows, 1), PAD_TOKEN, dtype=torch.int64, device=device)], 1)
    a = num_accepted[:, None]
    output = torch.where(positions < a, padded,
                         torch.where(positions == a, sampled[:, None], PAD_TOKEN))
    return Verified(num_accepted, output)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, T, V] logits (penalties and masks applied) -> [B, T, V] float32 probabilities: the
    distribution `sampler.sample` would draw from at each of the T positions of row b, which
    shares row b's SamplingBatch entries. Greedy rows (temperature 0) get a one-hot at the
    argmax, so `verify_sampling` treats them exactly like `verify_greedy`.

    Use it for the target (T = k + 1) and, with a draft model, for the draft's q (T = k).
    """
    rows, positions, vocab_size = logits.shape
    flat = logits.reshape(rows * positions, vocab_size).float()  # [B * T, V]
    greedy_rows = (batch.temperatures == 0).repeat_interleave(positions)  # [B * T]
    one_hot = torch.zeros_like(flat).scatter_(1, flat.argmax(dim=1, keepdim=True), 1.0)
    if batch.all_greedy:
        return one_hot.view(rows, positions, vocab_size)

    def expand(values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(positions)

    # The truncation filters read the per-row tensors of a SamplingBatch; give each of the
    # T positions its row's values.
    per_position = dataclasses.replace(
        batch, temperatures=expand(batch.temperatures), top_ks=expand(batch.top_ks),
        top_ps=expand(batch.top_ps), min_ps=expand(batch.min_ps),
        generators=[g for g in batch.generators for _ in range(positions)])
    scaled = truncated_logits(flat, per_position)
    probs = torch.where(greedy_rows[:, None], one_hot, scaled.softmax(dim=1))
    return probs.view(rows, positions, vocab_size)


def _draw(
    rows: int, k: int, vocab_size: int, counts: list[int] | None,
    generators: Sequence[torch.Generator | None], device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, k] Uniform[0, 1) and [B, V] Exp(1) draws (clamped away from 0).

    Unseeded rows draw in one call each on the default generator. Seeded row b draws
    counts[b] uniforms, then V exponentials, from its own generator: the per-row loop is what
    makes it independent of the batch, as in sampler._draw_exponential.
    """
    uniforms = torch.rand(rows, k, device=device)
    noise = torch.empty(rows, vocab_size, device=device).exponential_()
    for b, gen in enumerate(generators):
        if gen is not None:
            assert counts is not None
            uniforms[b, : counts[b]].uniform_(generator=gen)
            noise[b].exponential_(generator=gen)
    return uniforms, noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _as_tensor(num_drafts: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(num_drafts, torch.Tensor):
        return num_drafts.to(device=device, dtype=torch.int64)
    return to_device(list(num_drafts), torch.int64, device)


def _host_counts(num_drafts: torch.Tensor | Sequence[int], rows: int, k: int) -> list[int]:
    counts = num_drafts.tolist() if isinstance(num_drafts, torch.Tensor) else list(num_drafts)
    if len(counts) != rows or any(not 0 <= c <= k for c in counts):
        raise ValueError(f"num_drafts must hold {rows} counts in 0..{k}, got {counts}")
    return counts


def _check_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
