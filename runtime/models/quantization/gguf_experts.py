"""A mixture-of-experts layer's experts as the GGUF file's blocks, run by our CPU kernel.

A GGUF file stacks a layer's experts in three tensors of one block type each (ffn_gate_exps,
ffn_up_exps, ffn_down_exps). Held as planes in our kernel's tiles (cpu_weights), one expert
reads the file's bytes where bfloat16 copies would read 3.5 (Q4_K) times more and hold as
much more memory: Qwen3-30B-A3B's Q4_K_M file is 18 GB, its experts in bfloat16 about 57 GB.

Every expert of a tensor has the same type, and so the same tiled form: each of the tiles'
tensors is stacked over the experts, [E, ...], and expert e's linear is their slices at e:

    gate_up  each expert's gate rows then up rows [2I, d]: one segment, or two where gate and
             up differ in form (as a merged dense layer's parts, cpu_weights.segments_of)
    down     each expert's down projection [d, I]

A part the converter could not keep as blocks (Q2_K, Q3_K, float) makes its linear dense
bfloat16 tiles for every expert. The C++ forward step (kernels/cpu_decode.cpp) reads these
stacks directly; `expert_mlp` is the eager path's, with the same linears.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.models.quantization import host_memory
from radixlm.runtime.models.quantization.cpu_weights import (
    linear_kernel,
    segments_of,
    tile_dense,
    tile_planes,
)
from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks

# The checkpoint parts of each stacked linear, in row order.
LINEAR_PARTS = {"gate_up": ("gate", "up"), "down": ("down",)}


class StackedLinear(NamedTuple):
    """One linear of every expert, as the kernel reads it: `segments` of seven tensors
    (cpu_linear.h's planes_linear), or 0 for one dense bfloat16 tile tensor; each tensor
    [E, ...] with expert e's at e; `width` output features."""

    segments: int
    width: int
    tensors: list[torch.Tensor]


class GGUFExperts(nn.Module):
    """The experts of one MoE layer from a GGUF file: `load` each expert's parts as they come
    (GGUFBlocks, or float weights where the file's type has no blocks); the last one tiles
    them all (`finish`); then each expert's MLP runs as `expert_mlp`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.kernel = linear_kernel()
        if self.kernel is None:
            raise RuntimeError("GGUF experts run on the CPU kernel, which did not build")
        self.num_experts = num_experts
        self.shapes = {"gate": (intermediate_size, hidden_size),
                       "up": (intermediate_size, hidden_size),
                       "down": (hidden_size, intermediate_size)}
        self._parts: dict[tuple[int, str], GGUFBlocks | torch.Tensor] = {}
        self.linears: dict[str, StackedLinear] = {}

    def load(self, expert: int, part: str, loaded: GGUFBlocks | torch.Tensor) -> None:
        if tuple(loaded.shape) != self.shapes[part]:
            raise ValueError(f"expert {expert}'s {part} projection has shape "
                             f"{tuple(loaded.shape)}, expected {self.shapes[part]}")
        self._parts[expert, part] = loaded
        if len(self._parts) == len(self.shapes) * self.num_experts:
            self.finish()  # now, not after the whole model: its blocks are freed layer by layer

    def finish(self) -> None:
        """Tile every expert's parts into the stacks (the blocks are then released)."""
        for name, parts in LINEAR_PARTS.items():
            rows = [self.shapes[p][0] for p in parts]
            columns = self.shapes[parts[0]][1]
            stacked = self._stack(parts, rows, columns, compact=True)
            if stacked is None:  # an expert's compact form differs: every one as it comes
                stacked = self._stack(parts, rows, columns, compact=False)
            for e in range(self.num_experts):
                for p in parts:
                    del self._parts[e, p]
            for index, tensor in enumerate(stacked.tensors):
                self.register_buffer(f"{name}{index}", tensor)
            self.linears[name] = stacked

    def _stack(self, parts: tuple[str, ...], rows: list[int], columns: int,
               compact: bool) -> StackedLinear | None:
        """The experts' tiles stacked, each copied in as it is made; None when not every
        expert's tiles have the first one's form (compact forms depend on the values)."""
        stacked: list[torch.Tensor] = []
        segments = 0
        for e in range(self.num_experts):
            segments_e, tiles = self._tiles([self._parts[e, p] for p in parts], rows, columns,
                                            compact)
            if e == 0:
                segments = segments_e
                stacked = [host_memory.empty((self.num_experts, *t.shape), t.dtype)
                           for t in tiles]
            elif segments_e != segments or [(t.dtype, t.shape) for t in tiles] != [
                    (s.dtype, s.shape[1:]) for s in stacked]:
                return None
            for target, t in zip(stacked, tiles):
                target[e] = t
        return StackedLinear(segments, sum(rows), stacked)

    @staticmethod
    def _tiles(parts: list[GGUFBlocks | torch.Tensor], rows: list[int], columns: int,
               compact: bool) -> tuple[int, list[torch.Tensor]]:
        if all(isinstance(p, GGUFBlocks) for p in parts):
            segments = segments_of([p.planes() for p in parts], rows, columns)
            return len(segments), [t for planes in segments
                                   for t in tile_planes(planes, compact, kept=False)]
        weight = torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float()
                            for p in parts])
        return 0, [tile_dense(weight.to(torch.bfloat16))]

    def linear(self, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, K] (bfloat16) through expert `expert`'s linear `name` -> [n, N] bfloat16."""
        stacked = self.linears[name]
        tensors = [t[expert] for t in stacked.tensors]
        if stacked.segments == 0:
            return self.kernel.dense_linear(x, tensors[0], stacked.width, False)
        return self.kernel.planes_linear(x, tensors, stacked.width, False)

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `expert`'s gated MLP (SiLU) of its rows [n, d] bfloat16 -> [n, d]."""
        gate, up = self.linear("gate_up", expert, rows).chunk(2, dim=-1)
        return self.linear("down", expert, F.silu(gate) * up)


def dense_stack(weights: torch.Tensor, float32: bool) -> StackedLinear:
    """Float experts' linear [E, N, K] as the kernel reads it: dense tiles (bfloat16, or
    float32 with `float32`) stacked over the experts, made one expert at a time."""
    experts, rows, _ = weights.shape
    dtype = torch.float32 if float32 else torch.bfloat16
    first = tile_dense(weights[0].to(dtype))
    stacked = host_memory.empty((experts, *first.shape), dtype)
    stacked[0] = first
    for e in range(1, experts):
        stacked[e] = tile_dense(weights[e].to(dtype))
    return StackedLinear(0, rows, [stacked])

