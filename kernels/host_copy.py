"""Host-to-device copies that never make the host wait for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, and such a copy first waits
for all the work already queued on the stream. Inside the engine loop that would stall the
host on the previous step's forward, which is exactly the time the loop uses to prepare the
next step. Staged through pinned memory and issued non-blocking, the copy is queued behind
that work instead. PyTorch's caching host allocator keeps the pinned block alive until the
copy has run, so the staging memory needs no bookkeeping here.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a tensor on `device`, without a host sync."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    if isinstance(values, torch.Tensor):
        staged = values.to(dtype).pin_memory()
    else:
        staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)
