"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): protect the weights that meet large activations by scaling them up before
quantization and the activations down by the same factor, which the previous operation absorbs
(an RMSNorm's weight, or the rows of a linear whose output feeds this one).

Per input channel j, s_j = mean|x_j| ** alpha with alpha searched on a grid over [0, 1) to
minimise the output error of the linear on calibration inputs (the paper's Eq. 5):

    || Q(W diag(s)) (diag(s)^-1 X) - W X ||^2

s is normalised by sqrt(max(s) * min(s)) so it centres on 1; alpha = 0 is plain RTN, so the
search never loses to it on the calibration data. Then the paper's weight clipping: per group,
the clamp range max|w| * (1 - i / n_grid) (up to halving it) that minimises the group's own
output error; it is not applied to q and k, whose errors the attention softmax amplifies.
"""

from __future__ import annotations

from typing import Callable

import torch

from radixlm.runtime.models.quantization.rtn import fake_quantize, grid_params, quantize_to_grid

Expand = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def search_scales(w: torch.Tensor, x: torch.Tensor, x_mean: torch.Tensor, bits: int,
                  group_size: int, sym: bool = False, n_grid: int = 20,
                  expand: Expand | None = None) -> torch.Tensor:
    """Best per-input-channel scales for w [N, K] on inputs x [n, K]. x_mean is the mean |x|
    per scale (a scale may stand for several channels: `expand` maps [P] scales to the [K]
    channels, e.g. one scale per KV channel shared by the query heads of its group)."""
    w, x = w.float(), x.float()
    expand = expand or (lambda s: s)
    reference = x @ w.t()
    best_err, best = float("inf"), torch.ones(w.shape[1], device=w.device)
    for i in range(n_grid):
        s = x_mean.float().pow(i / n_grid).clamp(min=1e-4)
        s = expand(s / (s.max() * s.min()).sqrt())
        wq = fake_quantize(w * s, bits, group_size, sym) / s
        err = (x @ wq.t() - reference).pow(2).mean().item()
        if err < best_err:
            best_err, best = err, s
    return best


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int,
                sym: bool = False, n_grid: int = 20, max_shrink: float = 0.5,
                rows_per_chunk: int = 256) -> torch.Tensor:
    """Per-group clamp limits [N, G] for w [N, K] on inputs x [n, K]: for each group, the limit
    whose quantized weights best reproduce that group's share of the output, x_g @ w_g."""
    rows, cols = w.shape
    group = cols if group_size <= 0 else group_size
    groups = -(-cols // group)
    pad = groups * group - cols  # the ragged last group, zero-padded (see rtn.py)
    wg = torch.nn.functional.pad(w.float(), (0, pad)).view(rows, groups, group)
    xg = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, groups, group)
    limits = []
    for start in range(0, rows, rows_per_chunk):
        chunk = wg[start:start + rows_per_chunk]  # [r, G, g]
        reference = torch.einsum("ngk,rgk->grn", xg, chunk)
        amax = chunk.abs().amax(-1)  # [r, G]
        best, best_err = amax.clone(), torch.full_like(amax, float("inf"))
        for i in range(int(max_shrink * n_grid)):
            limit = amax * (1 - i / n_grid)
            clipped = torch.maximum(torch.minimum(chunk, limit[..., None]), -limit[..., None])
            scale, zero = grid_params(clipped, bits, sym)
            wq = (quantize_to_grid(clipped, scale, zero, bits) - zero[..., None]).float()
            out = torch.einsum("ngk,rgk->grn", xg, wq * scale[..., None])
            err = (out - reference).pow(2).mean(-1).t()  # [r, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, limit, best)
        limits.append(best)
    return torch.cat(limits)


def apply_clip(w: torch.Tensor, limits: torch.Tensor, group_size: int) -> torch.Tensor:
    """Clamp each group of w [N, K] to +-limits [N, G]."""
    cols = w.shape[1]
    group = cols if group_size <= 0 else group_size
    per_col = limits.repeat_interleave(group, dim=1)[:, :cols]
    return torch.maximum(torch.minimum(w, per_col), -per_col)
