"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and newer GPUs.

A decode step at batch 1 is ~300 small kernels back to back. Launched with PDL, a kernel is
set up while the kernel before it on the stream still runs, and its blocks wait
(griddepcontrol.wait, `gdc_wait`) until that kernel has finished and its writes are visible:
the same order as without PDL, minus part of the gap between the two. Every kernel launched
with PDL calls `pdl_prologue` first, before touching memory, so none can read an input before it
is written or overwrite one still being read; a kernel between two of ours that does not take
part (cuBLAS, torch) is ordered as usual.

The kernels do not let their successors start early (`gdc_launch_dependents`): on an H200
(Llama-3-8B shape, batch-1 decode in CUDA graphs, 2026-12-04) waiting only took a step from
4.56 to 4.42 ms, while triggering at the start of each kernel made it 4.75 ms, the waiting
blocks of the next kernel taking SM slots from the running one. RADIXLM_PDL=0 turns PDL off
(for comparisons).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@cache
def _supported(device_index: int) -> bool:
    if os.environ.get("RADIXLM_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel taking a PDL constexpr: PDL on for CUDA devices that have
    it (compute capability 9.0+), off elsewhere (CPU, the Triton interpreter)."""
    if device.type == "cuda" and _supported(device.index if device.index is not None
                                            else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
