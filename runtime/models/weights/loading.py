"""Copying checkpoint tensors into parameters, with a clear error on a shape mismatch.

A checkpoint tensor arrives either as a torch.Tensor or, when each rank loads only its shard,
as a lazy safetensors slice: `narrow` reads just the rows or columns asked for, and
`materialize` reads the whole tensor (for parameters every rank holds in full).
"""

from __future__ import annotations

from typing import Any

import torch


def materialize(src: Any) -> torch.Tensor:
    if isinstance(src, torch.Tensor):
        return src
    return src[tuple(slice(None) for _ in src.get_shape())]


def narrow(src: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """src[..., start:start + length, ...] along `dim`, reading only that part of a slice."""
    if isinstance(src, torch.Tensor):
        return src.narrow(dim, start, length)
    shape = src.get_shape()
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + length)
    return src[tuple(index)]


def tensor_shape(src: Any) -> tuple[int, ...]:
    return tuple(src.shape if isinstance(src, torch.Tensor) else src.get_shape())


def copy_weight(dst: torch.Tensor, src: Any) -> None:
    src = materialize(src)
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit a "
                         f"parameter of shape {tuple(dst.shape)}")
    dst.copy_(src)
