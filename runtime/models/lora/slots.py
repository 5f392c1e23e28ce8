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
the rows grouped by slot. A linear with a LoRALinear adds its update through it: on a GPU, the
Triton shrink and expand kernels over the whole batch (kernels/lora.py, the rank padded to a
multiple of their 16-rank blocks); elsewhere one pair of matmuls per adapter in the step, never
a loop over rows. For CUDA graphs the rows and tiles go into buffers allocated once
(`graph_step`, `stage_graph`), and a graph is captured with the most tiles its batch can need.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.kernels.lora_rows import BLOCK_R, TILE_FIELDS, group_rows, max_tiles
from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.lora.adapter import LoRAAdapter, adaptable, load_adapter


@dataclass
class LoRAStep:
    """One forward's rows by slot."""

    token_slots: torch.Tensor | None = None  # [T] int64, -1 for base-model rows
    # (slot, rows): contiguous (start, stop) when the slot's rows are one run, else an index
    # tensor of them.
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    # On a GPU (kernels/lora.py): the adapted rows slot by slot, and their tiles, on the
    # device (None until a linear first needs them: LoRASlots.uploaded).
    rows: torch.Tensor | None = None  # int32
    tiles: torch.Tensor | None = None  # [>= num_tiles, 3] int32
    num_tiles: int = 0


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
        # A proxy: the slots hold their linears, and a cycle would keep every slot's memory
        # until a garbage collection after the engine closes.
        self.owner = weakref.proxy(owner)
        # Output columns each part's B may write (kernels/lora.py reads a part's ranks only
        # for them): the part's own, widened when an adapter's module spans several parts.
        self._cols = [[linear.offsets[p], linear.offsets[p + 1]] for p in range(parts)]
        self.part_cols = torch.tensor(self._cols, dtype=torch.int32, device=device)
        # Each slot's adapter's rank on each part: 0 for a part it does not train (k of an
        # adapter of q and v), whose weights and output columns the kernels then skip.
        self.part_ranks = torch.zeros(num_slots, parts, dtype=torch.int32, device=device)

    def fill(self, slot: int, adapter_parts: Sequence) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        ranks = [0] * len(self._cols)
        for p in adapter_parts:
            ranks[p.part] = max(ranks[p.part], p.a.shape[0])
            r, rows = p.a.shape[0], p.b.shape[0]
            first = p.part * self.rank
            self.a[slot, first:first + r].copy_(_staged(p.a, self.a), non_blocking=True)
            self.b[slot, first:first + r, p.row_start:p.row_start + rows].copy_(
                _staged(p.b.T, self.b), non_blocking=True)
            cols = self._cols[p.part]
            if p.row_start < cols[0] or p.row_start + rows > cols[1]:
                cols[:] = min(cols[0], p.row_start), max(cols[1], p.row_start + rows)
                self.part_cols.copy_(torch.tensor(self._cols, dtype=torch.int32))
        self.part_ranks[slot].copy_(_staged(torch.tensor(ranks, dtype=torch.int32),
                                            self.part_ranks), non_blocking=True)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + this step's updates, row by row each adapter's own."""
        step = self.owner.step
        if step is None:
            return out
        if self.owner.use_kernels:
            from radixlm.kernels.lora import lora_add  # Triton: only where the kernels run

            step = self.owner.uploaded(step)
            return lora_add(x, out, self.a, self.b, step.rows, step.tiles, step.num_tiles,
                            self.part_ranks, self.part_cols, self.rank)
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
                 dtype: torch.dtype, device: torch.device,
                 targets: set[str] | None = None) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("max_loras_per_batch and max_lora_rank must be at least 1")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.use_kernels = uses_kernels(device)
        # The rows each part's A takes in a slot (a multiple of the kernels' rank block).
        stride = -(-max_rank // BLOCK_R) * BLOCK_R if self.use_kernels else max_rank
        # Only the linears some adapter may train (`targets`; None: every decoder linear)
        # hold slots and run updates.
        self.targets = targets
        self.linears: dict[str, LoRALinear] = {}
        for name, module in model.named_modules():
            if (isinstance(module, Linear) and adaptable(name)
                    and (targets is None or name in targets)):
                module.lora = self.linears[name] = LoRALinear(
                    module, num_slots, stride, dtype, device, self)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # Tensor parallelism: rank 0's group, which every step's slots are sent to, and the
        # adapters by index, the same list on every rank (the slots' fills name them by it).
        self.followers: Any = None
        self.catalog: list[LoRAAdapter] = []
        # CUDA graphs' rows and tiles (graph_buffers)
        self._graph_rows: torch.Tensor | None = None
        self._graph_tiles: torch.Tensor | None = None
        self._host_step: tuple[list[int], list[tuple[int, int, int]]] = ([], [])
        self.loads = 0  # adapters copied into a slot (many per step: raise num_slots)
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
        per_row: list[int] = []
        fills: list[tuple[int, LoRAAdapter]] = []
        if any(a is not None for a in adapters):
            needed = {id(a): a for a in adapters if a is not None}
            if len(needed) > self.num_slots:
                raise RuntimeError(f"{len(needed)} adapters in one step; "
                                   f"{self.num_slots} slots (the scheduler bounds this)")
            slots = {key: self._load(a, needed, fills) for key, a in needed.items()}
            for adapter, count in zip(adapters, counts):
                per_row.extend([-1 if adapter is None else slots[id(adapter)]] * count)
        # (Nothing to send when this step and the one before run no adapter.)
        if self.followers is not None and (per_row or self.step is not None):
            self.followers.lora_step(per_row, [(slot, self.catalog.index(adapter))
                                               for slot, adapter in fills])
        self._set_rows(per_row)

    def follow(self, per_row: list[int], fills: list[tuple[int, int]]) -> None:
        """A tensor-parallel rank's side of rank 0's `prepare`: the same slot fills (slot,
        catalog index) and rows."""
        for slot, index in fills:
            self._fill(slot, self.catalog[index])
        self._set_rows(per_row)

    def _set_rows(self, per_row: list[int]) -> None:
        """The step of rows using slots per_row[i] (-1: none); None without any adapter."""
        if not per_row or max(per_row) < 0:
            self.step = None
            return
        if self.use_kernels:
            # Sent to the device by the first linear that runs eagerly (`uploaded`); a graph
            # replay copies them into its own buffers instead (`stage_graph`).
            self._host_step = group_rows(per_row)
            self.step = LoRAStep(num_tiles=len(self._host_step[1]))
            return
        token_slots = torch.tensor(per_row, dtype=torch.int64)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted({s for s in per_row if s >= 0}):
            rows = (token_slots == slot).nonzero().flatten()
            first, last = int(rows[0]), int(rows[-1])
            run = last - first + 1 == len(rows)
            groups.append((slot, slice(first, last + 1) if run else rows.to(self.device)))
        self.step = LoRAStep(token_slots.to(self.device), groups)

    def uploaded(self, step: LoRAStep) -> LoRAStep:
        """The step with its rows and tiles on the device (sent once per step)."""
        if step.tiles is None:
            rows, tiles = self._host_step
            step.rows = to_device(rows, torch.int32, self.device)
            step.tiles = to_device(tiles, torch.int32, self.device)
        return step

    def graph_buffers(self, max_batch_size: int) -> None:
        """Allocate the rows and tiles CUDA graphs read, for up to max_batch_size rows."""
        self._graph_rows = torch.zeros(max_batch_size, dtype=torch.int32, device=self.device)
        self._graph_tiles = torch.full((max_tiles(max_batch_size, self.num_slots), TILE_FIELDS),
                                       -1, dtype=torch.int32, device=self.device)

    def graph_step(self, batch_size: int) -> LoRAStep:
        """The step a graph of batch_size rows is captured with: the fixed buffers, and as
        many tiles as batch_size rows can need (unused ones are -1 when replayed)."""
        assert self._graph_rows is not None and self._graph_tiles is not None
        return LoRAStep(rows=self._graph_rows, tiles=self._graph_tiles,
                        num_tiles=max_tiles(batch_size, self.num_slots))

    def stage_graph(self) -> None:
        """Copy the prepared step's rows and tiles into the graphs' buffers."""
        assert self._graph_rows is not None and self._graph_tiles is not None
        rows, tiles = self._host_step
        padded = tiles + [(-1, 0, 0)] * (self._graph_tiles.shape[0] - len(tiles))
        self._graph_tiles.copy_(to_device(padded, torch.int32, self.device))
        self._graph_rows[:len(rows)].copy_(to_device(rows, torch.int32, self.device))

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, linear in self.linears.items():
            linear.fill(slot, adapter.modules.get(name, ()))
        self.ranks[slot] = adapter.rank

    def set_catalog(self, index: int, adapter: LoRAAdapter) -> None:
        """Put an adapter at `index` of the catalog (its end, or in place of one no request
        holds any more, which leaves its slot if it had one)."""
        if index == len(self.catalog):
            self.catalog.append(adapter)
            return
        old = self.catalog[index]
        slot = self.slot_of(old)
        if slot is not None:
            del self._resident[slot]
        self.catalog[index] = adapter

    def _load(self, adapter: LoRAAdapter, needed: dict[int, LoRAAdapter],
              fills: list[tuple[int, LoRAAdapter]]) -> int:
        slot = self.slot_of(adapter)
        if slot is None:
            free = [s for s in range(self.num_slots) if s not in self._resident]
            if free:
                slot = free[0]
            else:  # the least recently used one this step does not need
                slot = next(s for s, a in self._resident.items() if id(a) not in needed)
                del self._resident[slot]
            self._fill(slot, adapter)
            fills.append((slot, adapter))
            self.loads += 1
        self._resident[slot] = adapter
        self._resident.move_to_end(slot)
        return slot


def slot_dtype(device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """The slots' dtype: the model's own (the CPU kernel reads float32 or bfloat16 slots,
    widened exactly and summed in float32)."""
    if device.type == "cpu" and model_dtype not in (torch.float32, torch.bfloat16):
        return torch.float32
    return model_dtype


def follower_slots(model: torch.nn.Module, spec: dict[str, Any], model_dtype: torch.dtype,
                   device: torch.device) -> LoRASlots:
    """A tensor-parallel rank's slots, as rank 0 describes its own (`describe`): the same
    adapters, in the same order, each loaded as this rank's share of it."""
    targets = None if spec["targets"] is None else set(spec["targets"])
    slots = LoRASlots(model, spec["slots"], spec["rank"], slot_dtype(device, model_dtype),
                      device, targets)
    slots.catalog = [load_adapter(name, path, model) for name, path in spec["adapters"]]
    return slots


def describe(slots: LoRASlots) -> dict[str, Any]:
    """What another tensor-parallel rank needs to build the same slots."""
    return {"slots": slots.num_slots, "rank": slots.max_rank,
            "targets": None if slots.targets is None else sorted(slots.targets),
            "adapters": [(a.name, a.path) for a in slots.catalog]}


def _staged(host: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """An adapter's host tensor ready for a non-blocking copy into the slots: in pinned
    memory on a GPU (a copy from pageable memory would first wait for the GPU's queued
    work, the step in flight), in the slots' dtype."""
    host = host.to(slots.dtype)
    return host.pin_memory() if slots.is_cuda else host


def uses_kernels(device: torch.device) -> bool:
    """Whether the updates run in the Triton kernels (on a GPU) or as torch matmuls."""
    return device.type == "cuda"
