"""Copying checkpoint tensors into parameters, with a clear error on a shape mismatch."""

from __future__ import annotations

import torch


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit a "
                         f"parameter of shape {tuple(dst.shape)}")
    dst.copy_(src)
