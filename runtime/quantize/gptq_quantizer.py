"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize a linear's weight one input column at a time and push each
column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian of
the layer's reconstruction loss ||W X - Q X||^2, whose Hessian is H = 2 X X^T over the
calibration inputs.

The steps, as in the paper (Algorithm 1):
- H from the inputs; inputs that never fire (H_ii = 0) get H_ii = 1 and a zero weight column;
  dampening lambda = damp * mean(diag H) on the diagonal keeps the inverse well conditioned.
- Optional act-order: columns in order of decreasing H_ii (the inputs that matter most are
  quantized first, while the most columns remain to absorb their error).
- The Cholesky factor U of H^-1 (upper) gives, row by row, the inverse-Hessian rows the update
  needs: quantizing column i, err = (w_i - q_i) / U_ii and W[:, j>i] -= err * U_i,j.
- Lazy batch updates: within a block of B columns errors are applied to the block only; the
  rest of the matrix gets one [N, B] x [B, rest] update per block, which turns a memory-bound
  loop into matrix products.
- Groups: the scale and zero point of a group come from its columns as they are when the group
  starts (already updated by the errors of earlier columns).
"""

from __future__ import annotations

import torch

from radixlm.runtime.models.quantization.rtn import GroupQuantized, grid_params, quantize_to_grid


def accumulate_hessian(hessian: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """Add x [T, K]'s contribution X^T X to an unnormalised Hessian (any positive scale of H
    gives the same GPTQ result: the dampening is relative to its diagonal)."""
    x = x.float()
    update = x.t() @ x
    return update if hessian is None else hessian.add_(update)


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  sym: bool = False, act_order: bool = False, damp: float = 0.01,
                  block_size: int = 128, scale_dtype: torch.dtype = torch.float16
                  ) -> tuple[GroupQuantized, torch.Tensor]:
    """w [N, K], hessian [K, K] -> (the quantized weight in the original column order, g_idx
    [K] int32: the group of each input column)."""
    rows, cols = w.shape
    group = cols if group_size <= 0 else group_size
    if group < block_size and block_size % group:
        raise ValueError(f"block_size {block_size} must be a multiple of group_size {group}")
    W = w.detach().clone().float()
    H = hessian.detach().clone().float()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    # U: upper Cholesky factor of H^-1; row i holds what quantizing column i does to the rest.
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    num_groups = -(-cols // group)
    Q = torch.zeros(rows, cols, dtype=torch.int32, device=W.device)
    scales = torch.zeros(rows, num_groups, device=W.device)
    zeros = torch.zeros(rows, num_groups, dtype=torch.int32, device=W.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        errors = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:  # a new group: its grid from the columns as they are now
                W[:, i1:i2] = W1
                scale, zero = grid_params(W[:, col:col + group], bits, sym, scale_dtype)
                scales[:, col // group], zeros[:, col // group] = scale, zero
            q = quantize_to_grid(W1[:, i:i + 1], scale, zero, bits)[:, 0]
            Q[:, col] = q
            err = (W1[:, i] - (q - zero).float() * scale) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            errors[:, i] = err
        W[:, i2:] -= errors @ U[i1:i2, i2:]  # the lazy update of every later column

    g_idx = torch.arange(cols, device=W.device) // group  # group of each (permuted) column
    if perm is not None:
        inverse = torch.argsort(perm)
        Q, g_idx = Q[:, inverse], g_idx[inverse]
    return GroupQuantized(Q, scales.to(scale_dtype), zeros), g_idx.to(torch.int32)
