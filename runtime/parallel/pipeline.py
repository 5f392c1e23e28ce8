"""Pipeline parallelism: the layers cut into stages, each held by `tp_size` ranks.

Rank 0 (stage 0, tensor-parallel rank 0) schedules and samples, as with tensor parallelism
alone; stage 0 also holds the embedding and the output head, the last stage the final norm.
For each step rank 0 tells every rank of the later stages what the step is, point to point
(`PipelineChannel`: the header and lengths over the gloo control group, the positions and KV
slots over the default group, NCCL on CUDA), runs the first stage's layers and sends the
residual stream on. Rank t of each later stage receives the stream from rank t of the stage
before, runs its layers and sends on; the last stage's rank 0 sends its hidden states (after
the final norm) back to rank 0, which scores them.

Every send is asynchronous, so rank 0 is free to launch the next batch as soon as it has
handed this one on: EngineCore._step_pipelined keeps up to one batch per stage in flight, on
disjoint requests, and each stage works through them in the order they were launched. A
stage's KV cache holds its own layers' K and V at the slots rank 0 assigned, so the page
allocator, radix cache and scheduler stay on rank 0 alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.distributed.groups import PipelineInfo
from radixlm.runtime.parallel.step_channel import FORWARD, HEADER


class PipelineChannel:
    """What travels between stages: rank 0's step descriptions to every rank of the later
    stages, and each step's hidden states from a stage's rank to the next stage's."""

    def __init__(self, info: PipelineInfo, tp_rank: int, hidden_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.info = info
        self.tp_rank = tp_rank
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        # Sends still in progress, with the tensors they read (kept alive until done).
        self._sends: list[tuple[Any, torch.Tensor]] = []

    @property
    def later_ranks(self) -> list[int]:
        return [self.info.rank(stage, t) for stage in range(1, self.info.size)
                for t in range(self.info.tp_size)]

    @property
    def next_rank(self) -> int:
        """Where this rank's stage output goes: the same tensor-parallel rank of the next
        stage (the last stage's rank 0 returns it to rank 0)."""
        if self.info.last:
            return 0
        return self.info.rank(self.info.stage + 1, self.tp_rank)

    @property
    def previous_rank(self) -> int:
        return self.info.rank(self.info.stage - 1, self.tp_rank)

    @property
    def last_rank(self) -> int:
        """The rank whose output rank 0 receives."""
        return self.info.rank(self.info.size - 1, 0)

    def _send(self, tensor: torch.Tensor, dst: int, group: Any = None) -> None:
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]
        self._sends.append((dist.isend(tensor, dst, group=group), tensor))

    def flush(self) -> None:
        """Wait for every send of this rank to be received."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    # -- rank 0 -> the later stages ---------------------------------------------------------

    def send_header(self, command: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        header = torch.tensor([command, a, b, c], dtype=torch.int64)
        for dst in self.later_ranks:
            self._send(header, dst, self.info.control)

    def send_step(self, batch: ForwardBatch) -> None:
        num, seqs = batch.num_tokens, len(batch.q_lens)
        cols = batch.slot_table.shape[1]
        self.send_header(FORWARD, num, seqs, cols)
        lens = torch.tensor(batch.q_lens + batch.kv_lens, dtype=torch.int64)
        packed = torch.cat([batch.positions, batch.out_slots, batch.slot_table.reshape(-1)])
        for dst in self.later_ranks:
            self._send(lens, dst, self.info.control)
            self._send(packed, dst)

    # -- a later stage's rank ---------------------------------------------------------------

    def recv_header(self) -> list[int]:
        header = torch.empty(HEADER, dtype=torch.int64)
        dist.recv(header, 0, group=self.info.control)
        return header.tolist()

    def recv_step(self, header: list[int], kv_cache: KVCache) -> ForwardBatch:
        _, num, seqs, cols = header
        lens = torch.empty(2 * seqs, dtype=torch.int64)
        dist.recv(lens, 0, group=self.info.control)
        packed = torch.empty(2 * num + seqs * cols, dtype=torch.int64, device=self.device)
        dist.recv(packed, 0)
        positions, out_slots, table = packed.split([num, num, seqs * cols])
        lens_l = lens.tolist()
        # The token ids stay on stage 0, which embeds them: a placeholder of the right length.
        return ForwardBatch(input_ids=positions, positions=positions, q_lens=lens_l[:seqs],
                            kv_lens=lens_l[seqs:], out_slots=out_slots,
                            slot_table=table.view(seqs, cols), kv_cache=kv_cache)

    # -- hidden states between stages ------------------------------------------------------

    def send_hidden(self, hidden: torch.Tensor) -> None:
        if self.info.last and self.tp_rank != 0:
            return  # rank 0 needs one copy of the output; every rank of the stage has it
        self._send(hidden.contiguous(), self.next_rank)

    def recv_hidden(self, rows: int, src: int | None = None) -> torch.Tensor:
        hidden = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, self.previous_rank if src is None else src)
        return hidden
