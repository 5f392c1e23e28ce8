"""Adapters in a fixed number of slots on the model's device, and each step's rows mapped to
them.

Every linear an adapter may touch holds, per slot, A stacked over its parts ([P * R, in]: part
p's A in rows p R .. p R + r) and B transposed ([P * R, out]: part p's outputs read only their
own block of rows, zeros elsewhere), R being the largest rank served. One product then serves every
part and every rank: u = A x, out += B u; a smaller rank's padding and the other parts' blocks
add exact zeros. (B is kept transposed so that the CPU kernel runs 16 outputs per vector.)
Slots are filled on demand from the adapters kept on the host, and the least
recently used slot not needed by the step is overwritten; the scheduler admits at most
`num_slots` adapters into a running batch, so a step's adapters always fit.

`LoRAStep` is what one forward needs: which slot each token row uses (-1: the base model), and
the rows grouped by slot. A linear with a LoRALinear adds its update through it: one pair of
matmuls per adapter in the step, never a loop over rows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import torch

from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.lora.adapter import LoRAAdapter


@dataclass
class LoRAStep:
    """One forward's rows by slot."""

    token_slots: torch.Tensor | None = None  # [T] int64, -1 for base-model rows
    # (slot, rows): contiguous (start, stop) when the slot's rows are one run, else an index
    # tensor of them.
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoRALinear:
    """The slots' weights for one linear, and its update."""

    def __init__(self, linear: Linear, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device, owner: "LoRASlots") -> None:
        parts = len(linear.output_sizes)
        self.rank = rank
        self.a = torch.zeros(num_slots, parts * rank, linear.in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(num_slots, parts * rank, linear.out_features, dtype=dtype,
                             device=device)
        self.owner = owner

    def fill(self, slot: int, adapter_parts: Sequence) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p in adapter_parts:
            r, rows = p.a.shape[0], p.b.shape[0]
            first = p.part * self.rank
            self.a[slot, first:first + r].copy_(p.a)
            self.b[slot, first:first + r, p.row_start:p.row_start + rows].copy_(p.b.T)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + this step's updates, row by row each adapter's own."""
        step = self.owner.step
        if step is None or not step.groups:
            return out
        for slot, rows in step.groups:
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            update = (xs.to(self.a.dtype) @ self.a[slot].T) @ self.b[slot]
            if isinstance(rows, slice):
                out[rows] += update.to(out.dtype)
            else:
                out.index_add_(0, rows, update.to(out.dtype))
        return out


class LoRASlots:
    """`num_slots` adapter slots over a model's linears (`Linear.lora` set on each)."""

    def __init__(self, model: torch.nn.Module, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be at least 1")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.linears: dict[str, LoRALinear] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and _adaptable(name):
                module.lora = self.linears[name] = LoRALinear(
                    module, num_slots, max_rank, dtype, device, self)
        self.step: LoRAStep | None = None
        # slot -> adapter in it, least recently used first
        self._resident: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        for slot, resident in self._resident.items():
            if resident is adapter:
                return slot
        return None

    def prepare(self, adapters: Sequence[LoRAAdapter | None], counts: Sequence[int]) -> None:
        """Set up the next forward: `counts[i]` consecutive token rows use `adapters[i]`."""
        if not any(a is not None for a in adapters):
            self.step = None
            return
        needed = {id(a): a for a in adapters if a is not None}
        if len(needed) > self.num_slots:
            raise RuntimeError(f"{len(needed)} adapters in one step; "
                               f"{self.num_slots} slots (the scheduler bounds this)")
        slots = {key: self._load(a, needed) for key, a in needed.items()}
        per_row: list[int] = []
        for adapter, count in zip(adapters, counts):
            per_row.extend([-1 if adapter is None else slots[id(adapter)]] * count)
        token_slots = torch.tensor(per_row, dtype=torch.int64)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(set(slots.values())):
            rows = (token_slots == slot).nonzero().flatten()
            first, last = int(rows[0]), int(rows[-1])
            run = last - first + 1 == len(rows)
            groups.append((slot, slice(first, last + 1) if run else rows.to(self.device)))
        self.step = LoRAStep(token_slots.to(self.device), groups)

    def forget(self, adapter: LoRAAdapter) -> None:
        """An unloaded adapter's slot becomes free (no running request uses it any more)."""
        slot = self.slot_of(adapter)
        if slot is not None:
            del self._resident[slot]

    def _load(self, adapter: LoRAAdapter, needed: dict[int, LoRAAdapter]) -> int:
        slot = self.slot_of(adapter)
        if slot is None:
            free = [s for s in range(self.num_slots) if s not in self._resident]
            if free:
                slot = free[0]
            else:  # the least recently used one this step does not need
                slot = next(s for s, a in self._resident.items() if id(a) not in needed)
                del self._resident[slot]
            for name, linear in self.linears.items():
                linear.fill(slot, adapter.modules.get(name, ()))
        self._resident[slot] = adapter
        self._resident.move_to_end(slot)
        return slot


def _adaptable(module_name: str) -> bool:
    """The decoder layers' linears (not the MoE experts, embeddings or head)."""
    return ".layers." in module_name and ".experts" not in module_name
