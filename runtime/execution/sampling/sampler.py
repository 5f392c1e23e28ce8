"""Next-token sampling as pure tensor functions, vectorized over the batch.

The engine calls, once per decode step and for the rows that need a next token:

    batch = SamplingBatch.build(params, generators, vocab_size, device)
    logits = apply_penalties(logits, batch, prompt_ids, output_ids)   # if batch.needs_penalties
    logits = mask_tokens(logits, rows, banned_ids)                    # min_new_tokens
    logits = apply_token_bitmask(logits, rows, bitmask)               # grammars
    tokens = sample(logits, batch)
    logprobs = compute_logprobs(raw_logits, tokens, top_n)            # if anyone asked

`SamplingBatch` and `sample` live here; the logit changes before the draw are in
`logit_processing`, and `compute_logprobs` in `logprobs`.

Reproducibility. A seeded request must get the same tokens whatever else shares its batch and
at whatever row it sits. Two things make that hold:

* Randomness: sampling uses the exponential race (Gumbel-max): token = argmax(p_i / E_i) with
  E_i ~ Exp(1), drawn as a full [V] vector per row per step, indexed by *vocabulary id*. A
  seeded row draws only from its own generator, and always exactly V values, so its generator
  advances the same way regardless of the other rows.
* Truncation: top-k / top-p / min-p are computed per row, and when a row does not ask for one
  of them the operation is an exact identity for that row. The batch-level `needs_*` flags
  therefore only skip work; they never change a row's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.config.sampling_params import SamplingParams

# Temperatures below this are treated as greedy: dividing logits by a near-zero temperature
# overflows float32 to inf, and inf - inf in the softmax gives NaN. The limit distribution of
# a temperature -> 0 is the argmax anyway.
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step, built from each row's SamplingParams."""

    temperatures: torch.Tensor  # [B] float32; 0 marks a greedy row
    top_ks: torch.Tensor  # [B] int64, vocab_size where disabled
    top_ps: torch.Tensor  # [B] float32
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    # Per-row generator for seeded sampling rows, else None. Greedy rows get None even when
    # seeded: they never consume randomness, so there is nothing to draw for them.
    generators: list[torch.Generator | None]
    all_greedy: bool
    needs_penalties: bool
    # Skip work when nobody asks for it (only rows that actually sample count).
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        if len(generators) != len(params):
            raise ValueError(
                f"got {len(generators)} generators for {len(params)} rows; pass one per row "
                "(None for unseeded rows)")
        greedy = [is_greedy(p) for p in params]
        # Greedy rows are normalised here (temperature 0, no truncation) so that `sample`
        # can tell them apart on the device without asking the host.
        temperatures = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [_effective_top_k(p.top_k, vocab_size) for p in params]
        sampling = [p for p, g in zip(params, greedy) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        return cls(
            temperatures=f32(temperatures),
            top_ks=to_device(top_ks, torch.int64, device),
            top_ps=f32([p.top_p for p in params]),
            min_ps=f32([p.min_p for p in params]),
            repetition_penalties=f32([p.repetition_penalty for p in params]),
            frequency_penalties=f32([p.frequency_penalty for p in params]),
            presence_penalties=f32([p.presence_penalty for p in params]),
            generators=[None if g else gen for gen, g in zip(generators, greedy)],
            all_greedy=all(greedy),
            # Penalties change which token is argmax, so greedy rows need them too.
            needs_penalties=any(p.has_penalties for p in params),
            needs_top_k=any(_effective_top_k(p.top_k, vocab_size) < vocab_size
                            for p in sampling),
            needs_top_p=any(p.top_p < 1.0 for p in sampling),
            needs_min_p=any(p.min_p > 0.0 for p in sampling),
        )


def is_greedy(p: SamplingParams) -> bool:
    return p.greedy or p.temperature < _GREEDY_TEMPERATURE


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    # -1 and 0 both mean "disabled"; a k above the vocabulary is the same as disabled.
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)



# --------------------------------------------------------------------------------------------
# Sampling


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float logits (after penalties/masks) -> [B] int64 token ids. Greedy rows
    (temperature 0) take argmax. Others: divide by temperature, apply top-k, top-p (nucleus,
    keep the smallest set whose probability mass reaches top_p, always at least one token),
    min-p (drop tokens with prob < min_p * max_prob), then sample."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens

    sampled = _exponential_race(truncated_logits(logits, batch), batch.generators)
    return torch.where(batch.temperatures == 0, greedy_tokens, sampled)


def truncated_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float logits divided by each row's temperature, then top-k, top-p and min-p
    applied (dropped tokens at -inf): the distribution a sampled row draws from. Greedy rows
    go through the arithmetic with temperature 1 and their result is for the caller to
    discard; that is cheaper than splitting the batch and keeps every step the same shape."""
    temperatures = torch.where(batch.temperatures == 0, 1.0, batch.temperatures).unsqueeze(1)
    scaled = logits / temperatures
    if batch.needs_top_k or batch.needs_top_p:
        scaled = apply_top_k_top_p(scaled, batch)
    if batch.needs_min_p:
        scaled = apply_min_p(scaled, batch.min_ps)
    return scaled


def apply_top_k_top_p(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask everything below a per-row logit threshold found in one descending sort.

    Truncating by a threshold value (rather than by sorted position) keeps all tokens tied at
    the boundary, which makes the result independent of how the sort orders equal values.
    """
    vocab_size = scaled.shape[-1]
    sorted_logits = scaled.sort(dim=-1, descending=True, stable=True).values
    top_ks = batch.top_ks.clamp(1, vocab_size)
    n_keep = top_ks
    if batch.needs_top_p:
        # top-p looks at the distribution renormalised after top-k (vLLM / SGLang order).
        positions = torch.arange(vocab_size, device=scaled.device)
        after_k = sorted_logits.masked_fill(positions >= top_ks.unsqueeze(1), float("-inf"))
        probs = after_k.softmax(dim=-1)
        # Keep a token while the mass strictly before it is still short of top_p: that is the
        # smallest prefix reaching top_p, and position 0 (mass before = 0) is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        n_nucleus = (mass_before < batch.top_ps.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        # top_p == 1 must be an exact no-op; cumsum rounding could otherwise drop a tail token.
        n_nucleus = torch.where(batch.top_ps >= 1.0, vocab_size, n_nucleus)
        n_keep = torch.minimum(top_ks, n_nucleus)
    threshold = sorted_logits.gather(1, (n_keep - 1).unsqueeze(1))
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def apply_min_p(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max_prob.

    In log space that is logit - max_logit < log(min_p): no softmax needed, and the ratio is
    unchanged by the renormalisation after top-k/top-p, so the order of the filters does not
    matter. min_p == 0 gives log 0 = -inf, an exact no-op; the argmax itself is always kept.
    """
    max_logit = scaled.max(dim=-1, keepdim=True).values
    log_min_p = torch.log(min_ps).unsqueeze(1)
    return scaled.masked_fill(scaled - max_logit < log_min_p, float("-inf"))


def _exponential_race(
    scaled: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Sample each row from softmax(scaled) as argmax(p / E) = argmax(scaled - log E).

    Working with logits avoids the softmax, and a masked -inf logit stays -inf (E is clamped
    away from 0, so log E is finite and no inf - inf NaN can arise).
    """
    noise = _draw_exponential(scaled.shape, generators, scaled.device)
    tiny = torch.finfo(noise.dtype).tiny
    return (scaled - noise.clamp_min_(tiny).log_()).argmax(dim=-1)


def _draw_exponential(
    shape: torch.Size, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """[B, V] Exp(1) draws: V from each seeded row's own generator, the rest in one call on the
    default generator.

    The per-row loop is what makes seeded rows independent of the batch; its cost is one small
    kernel per seeded row.
    """
    rows, vocab_size = shape
    noise = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if len(unseeded) == rows:
        return noise.exponential_()
    if unseeded:
        index = to_device(unseeded, torch.int64, device)
        fresh = torch.empty(len(unseeded), vocab_size, dtype=torch.float32, device=device)
        noise.index_copy_(0, index, fresh.exponential_())
    for r, gen in enumerate(generators):
        if gen is not None:
            noise[r].exponential_(generator=gen)
    return noise


__all__ = [
    "SamplingBatch",
    "apply_min_p",
    "apply_top_k_top_p",
    "is_greedy",
    "sample",
    "truncated_logits",
]
