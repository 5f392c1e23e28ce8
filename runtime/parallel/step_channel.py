"""What rank 0 broadcasts to the ranks that compute each step with it (tensor parallelism's,
a pipeline's first stage, sequence parallelism's ranks), the commands that say what comes
next, and what both sides of that protocol share: the ranks' agreement, the model's shape
read before loading, the parent-watch variable (see sharded.py for rank 0's side, worker.py
for the other)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS
from radixlm.runtime.parallel.sequence import kv_rows, store_kv_rows

FORWARD, LOGITS, HEARTBEAT, STOP, GRAPH, GREEDY, LORA, LORA_LOAD = 1, 2, 3, 4, 5, 6, 7, 8
SPLIT_FORWARD, KV_ROWS = 9, 10  # sequence parallelism (sequence.py)
TIER = 11  # the prefix cache's lower tier, each rank's own (sharded_tier.py)
TIER_STORE, TIER_LOAD, TIER_SETTLE = 0, 1, 2  # a TIER command's first argument
HEADER = 4  # int64 words: (command, a, b, c)
# Workers launched here (not by hand for a multi-node run) watch this process id and exit
# when it goes away, so a killed engine leaves no orphans.
PARENT_ENV = "RADIXLM_TP_PARENT_PID"


class StepChannel:
    """The broadcasts that carry each step from rank 0 to the other ranks.

    Two kinds: what the other ranks' hosts need (the command header and the step's
    lengths) goes host to host through the gloo group, so a rank queues its GPU work as
    soon as rank 0 has decided the step, without first waiting for its own GPU to receive
    anything; what rank 0 already has on its device (token ids, positions, KV slots, hidden
    rows) goes device to device (NCCL on CUDA), ordered on the GPUs' streams."""

    def __init__(self, device: torch.device, dtype: torch.dtype, host_group: Any,
                 group: Any = None) -> None:
        self.device = device
        self.dtype = dtype
        self.host_group = host_group
        self.group = group  # the device broadcasts' (None: the default group)

    def _send_host(self, values: list[int]) -> None:
        dist.broadcast(torch.tensor(values, dtype=torch.int64), src=0, group=self.host_group)

    def _recv_host(self, count: int) -> list[int]:
        values = torch.empty(count, dtype=torch.int64)
        dist.broadcast(values, src=0, group=self.host_group)
        return values.tolist()

    def send_header(self, command: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        self._send_host([command, a, b, c])

    def recv_header(self) -> list[int]:
        return self._recv_host(HEADER)

    def send_forward(self, batch: ForwardBatch, command: int = FORWARD) -> None:
        num, seqs = batch.num_tokens, len(batch.q_lens)
        cols = batch.slot_table.shape[1]
        self.send_header(command, num, seqs, cols)
        self._send_host(batch.q_lens + batch.kv_lens)
        packed = torch.cat([batch.input_ids.to(torch.int64), batch.positions, batch.out_slots,
                            batch.slot_table.reshape(-1)])
        dist.broadcast(packed, src=0, group=self.group)

    def recv_forward(self, header: list[int], kv_cache: KVCache) -> ForwardBatch:
        _, num, seqs, cols = header
        lens = self._recv_host(2 * seqs)
        packed = torch.empty(3 * num + seqs * cols, dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0, group=self.group)
        ids, positions, out_slots, table = packed.split([num, num, num, seqs * cols])
        return ForwardBatch(input_ids=ids, positions=positions, q_lens=lens[:seqs],
                            kv_lens=lens[seqs:], out_slots=out_slots,
                            slot_table=table.view(seqs, cols), kv_cache=kv_cache)

    def send_graph_step(self, inputs: torch.Tensor, table_rows: torch.Tensor,
                        kv_lens: list[int]) -> None:
        """A decode step the ranks replay as a CUDA graph: the graph's staged inputs
        [rows, bs] and the step's slot-table rows [num, width], already on the device, and
        the padded context lengths [bs] (a backend may plan from them on the host)."""
        rows, bs = inputs.shape
        num, width = table_rows.shape
        self.send_header(GRAPH, bs, num, width)
        self._send_host(kv_lens)
        dist.broadcast(torch.cat([inputs.reshape(-1), table_rows.reshape(-1)]), src=0,
                       group=self.group)

    def recv_graph_step(self, header: list[int], rows: int
                        ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        _, bs, num, width = header
        kv_lens = self._recv_host(bs)
        packed = torch.empty(rows * bs + num * width, dtype=torch.int64, device=self.device)
        dist.broadcast(packed, src=0, group=self.group)
        inputs, table_rows = packed.split([rows * bs, num * width])
        return inputs.view(rows, bs), table_rows.view(num, width), kv_lens

    def send_lora(self, per_row: list[int], fills: list[tuple[int, int]]) -> None:
        """The next forward's LoRA slots: each token row's (-1: none), and the slots to fill
        first, as (slot, adapter index)."""
        self.send_header(LORA, len(per_row), len(fills))
        values = per_row + [v for fill in fills for v in fill]
        if values:
            self._send_host(values)

    def recv_lora(self, header: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        _, rows, fills = header[:3]
        values = self._recv_host(rows + 2 * fills) if rows + fills else []
        pairs = values[rows:]
        return values[:rows], [(pairs[2 * i], pairs[2 * i + 1]) for i in range(fills)]

    def send_hidden(self, hidden: torch.Tensor, command: int = LOGITS) -> None:
        """The rows to score: their logits (LOGITS) or only their argmax (GREEDY)."""
        self.send_header(command, hidden.shape[0], hidden.shape[1])
        dist.broadcast(hidden.contiguous(), src=0, group=self.group)

    def recv_hidden(self, header: list[int]) -> torch.Tensor:
        hidden = torch.empty(header[1], header[2], dtype=self.dtype, device=self.device)
        dist.broadcast(hidden, src=0, group=self.group)
        return hidden

    def send_kv_rows(self, cache: KVCache, slots: torch.Tensor) -> None:
        """A step rank 0 computed alone: its rows' K and V, every layer's (sequence.py)."""
        rows = kv_rows(cache, slots)
        self.send_header(KV_ROWS, *rows.shape[1:])
        dist.broadcast(slots, src=0, group=self.group)
        dist.broadcast(rows, src=0, group=self.group)

    def recv_kv_rows(self, header: list[int], cache: KVCache) -> None:
        _, num, heads, width = header
        slots = torch.empty(num, dtype=torch.int64, device=self.device)
        dist.broadcast(slots, src=0, group=self.group)
        rows = torch.empty(cache.k.shape[0], num, heads, width, dtype=torch.uint8,
                           device=self.device)
        dist.broadcast(rows, src=0, group=self.group)
        store_kv_rows(cache, slots, rows)


def agree(ok: bool, group: Any) -> bool:
    """True when every rank of the group says ok."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def settle_count(count: int, group: Any) -> int:
    """The smallest of the ranks' counts (pages each loaded into its tier's share)."""
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return int(value.item())


def model_shape(config: EngineConfig) -> ModelConfig:
    """The model's config.json, read before anything is loaded (config.model resolved)."""
    if config.load_format == "dummy" and config.model in ARCHITECTURE_PRESETS:
        return ModelConfig.from_dict(ARCHITECTURE_PRESETS[config.model])
    return ModelConfig.from_folder(config.model)
