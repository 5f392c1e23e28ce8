"""Launching a Triton kernel with as deep a pipeline as the GPU's shared memory holds.

Our tilings' pipeline depths were measured on Hopper (227 KB of shared memory a block) with
16-bit and float8 operands. Float32 operands take twice the bytes a stage, and Ampere's and
Ada's consumer cards (RTX 30x0 and 40x0, A10, L4) have 99 KB, so a depth chosen there can
be more than a card holds; Triton then refuses the kernel (`OutOfResources`) when it loads
it, before launching anything, also inside a CUDA graph capture. The depth only sets how
many tiles are in flight, never which float operations an output gets, so a shallower
pipeline gives the same results, bit for bit.
"""

from __future__ import annotations

from typing import Callable

from triton.runtime.errors import OutOfResources

# Pipeline depths that loaded, by the caller's key (the kernel's tiling, dtypes, device).
_STAGES: dict[tuple, int] = {}


def launch_within_shared_memory(launch: Callable[[int], None], num_stages: int,
                                key: tuple) -> None:
    """launch(num_stages), or with as many fewer stages as the GPU's shared memory needs;
    the depth that loaded is remembered under `key`, so later calls compile nothing that
    fails."""
    stages = _STAGES.get(key, num_stages)
    while True:
        try:
            launch(stages)
            break
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
    _STAGES[key] = stages
