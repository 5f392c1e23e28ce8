"""CUDA graphs for decode steps: the model forward captured once per padded batch size.

A decode step launches ~15 kernels per layer; at batch 1 on an 8B model the GPU finishes each
faster than Python issues the next, so replaying a captured graph is what brings the step
near its weight-streaming time. A graph replays fixed kernels on fixed addresses, so:

- Batches are padded to the next captured size (1, 2, 4, 8, 16, 24, ... up to the limit).
  A padded row is token 0 at position 0 with a context of one token; it writes its K/V to a
  scratch slot that no request owns, and its output is never read.
- Every input lives in a buffer allocated once. The host packs the step into one of two
  pinned [fields, max batch] tensors (alternating, so packing a step never waits for the
  previous step's copy), and a single non-blocking copy moves it to the device copy the
  graph reads. A step that follows one still on the device (overlap scheduling) then takes
  its input tokens from that step's sampled tokens, device to device. The slot table rows of
  the step are gathered into a fixed [max batch, max_len] buffer (stale rows beyond the batch
  still hold valid slots, so padded rows read real memory).
- The attention backend plans into its own fixed buffers (`plan_cuda_graph`), outside the
  graph, right before capture and before every replay.
- With tensor parallelism every rank captures the same graphs at the same time (the
  all-reduces inside the layers are captured with them). Before each replay rank 0 sends the
  step's device inputs and slot-table rows to the other ranks (`followers`), which copy them
  into their own buffers and replay (`replay_received`): they hold no slot table of their own.

- With LoRA adapters served, each size is captured twice: without them (base-model steps pay
  nothing) and with the adapters' kernels reading rows and tiles from the slots' fixed buffers
  (models/lora/slots.py), filled before each replay of a step that uses adapters.

A step comes here as one row per new token (step_inputs.one_row_per_token): decode tokens,
speculative drafts, and prompt chunks of up to GRAPH_CHUNK_TOKENS tokens, as long as the
step's tokens fit the largest size; the model runner sends every other step down the eager
path.
`capture=False` keeps the padding and buffers but runs the forward eagerly: that is how the
CPU tests check this module's bookkeeping under the Triton interpreter.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any, Sequence

import torch

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.lora.slots import LoRASlots
from radixlm.runtime.scheduling.pages import ReqToTokenTable

if TYPE_CHECKING:
    from radixlm.runtime.scheduling.request import Request

# Captured batch sizes: dense where small batches are common, then every 16, then every 32.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                 208, 224, 240, 256)
MAX_CAPTURE_SIZE = CAPTURE_SIZES[-1]
# Rows of the packed per-step input tensor.
IDS, POSITIONS, KV_LENS, OUT_SLOTS, TABLE_ROWS = range(5)
SENT_ROWS = 4  # the rows other tensor-parallel ranks need: all but TABLE_ROWS


def capture_sizes(limit: int) -> list[int]:
    """The captured sizes for at most `limit` sequences per step (limit itself included)."""
    limit = min(limit, MAX_CAPTURE_SIZE)
    return [bs for bs in CAPTURE_SIZES if bs < limit] + [limit]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, kv_cache: KVCache,
                 table: ReqToTokenTable | None, scratch_slot: int, max_batch_size: int,
                 max_len: int, capture: bool = True, followers: Any = None,
                 lora: LoRASlots | None = None) -> None:
        """scratch_slot: a KV slot outside every page the allocator hands out. max_len: the
        longest context a sequence can have (the engine's max_model_len). table: None on a
        tensor-parallel rank other than 0 (it replays what rank 0 sends). followers: rank 0's
        tensor_parallel.TensorParallelGroup, to send each replayed step to. lora: the adapters'
        slots, when the engine serves any."""
        self.model = model
        self.followers = followers
        self.attn = attn
        self.kv_cache = kv_cache
        self.table = table
        self.page_size = kv_cache.page_size
        self.scratch_slot = scratch_slot
        self.sizes = capture_sizes(max_batch_size)
        self.max_bs = self.sizes[-1]
        device = kv_cache.k.device
        self.device = device
        pinned = device.type == "cuda"
        self.host = [torch.zeros((5, self.max_bs), dtype=torch.int64, pin_memory=pinned)
                     for _ in range(2)]
        self.inputs = torch.zeros((5, self.max_bs), dtype=torch.int64, device=device)
        self.slot_table = torch.full((self.max_bs, max_len), scratch_slot, dtype=torch.int64,
                                     device=device)
        attn.init_cuda_graph(self.sizes, max_len, model.config.num_heads, kv_cache)
        # Marks when the device has taken each host buffer's inputs, so a pinned buffer is
        # not rewritten under an in-flight copy.
        self._copied = [torch.cuda.Event() if pinned else None for _ in range(2)]
        self._turn = 0
        self.lora = lora
        if lora is not None:
            lora.graph_buffers(self.max_bs)
        # Keyed by (batch size, with adapters)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}  # hidden states [bs, d]
        if capture:
            self._capture_all()

    def padded_size(self, num_seqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    @torch.inference_mode()
    def forward(self, requests: Sequence[Request], input_ids: Sequence[int],
                positions: Sequence[int], rows: Sequence[int], kv_lens: Sequence[int],
                pending_tokens: torch.Tensor | None = None,
                adapters: bool = False) -> torch.Tensor:
        """Hidden states [len(requests), d] of one decode step (one new token per request, at
        positions[i] of request i, whose slot-table row is rows[i]). pending_tokens, a device
        tensor, replaces input_ids when the tokens are not on the host yet. adapters: the
        step uses LoRA adapters (as the slots' prepared step says)."""
        num = len(requests)
        bs = self.padded_size(num)
        page = self.page_size
        out_slots = [r.pages[p // page] * page + p % page for r, p in zip(requests, positions)]
        batch = self._stage(bs, input_ids, positions, kv_lens, out_slots, rows)
        if pending_tokens is not None:
            self.inputs[IDS, :num].copy_(pending_tokens)
        width = max(kv_lens)
        table_rows = self.inputs[TABLE_ROWS, :num]
        self.slot_table[:num, :width] = self.table.table[table_rows, :width]
        if self.followers is not None:
            self.followers.graph_step(self.inputs[:SENT_ROWS, :bs],
                                      self.slot_table[:num, :width], batch.kv_lens)
        return self._run(batch, num, adapters)

    @torch.inference_mode()
    def replay_received(self, inputs: torch.Tensor, table_rows: torch.Tensor,
                        kv_lens: list[int]) -> None:
        """A tensor-parallel rank's side of rank 0's `forward`: inputs [SENT_ROWS, bs] and
        the [num, width] slot-table rows as rank 0 staged them, and the padded kv_lens."""
        bs = inputs.shape[1]
        num, width = table_rows.shape
        self.inputs[:SENT_ROWS, :bs].copy_(inputs)
        self.slot_table[:num, :width].copy_(table_rows)
        batch = ForwardBatch(
            input_ids=self.inputs[IDS, :bs], positions=self.inputs[POSITIONS, :bs],
            q_lens=[1] * bs, kv_lens=kv_lens,
            out_slots=self.inputs[OUT_SLOTS, :bs], slot_table=self.slot_table[:bs],
            kv_cache=self.kv_cache)
        # The step's slots came just before (LoRASlots.follow), as rank 0 prepared them.
        self._run(batch, num, self.lora is not None and self.lora.step is not None)

    def _run(self, batch: ForwardBatch, num: int, adapters: bool = False) -> torch.Tensor:
        bs = len(batch.q_lens)
        self.attn.plan_cuda_graph(batch, self.inputs[KV_LENS, :bs])
        key = (bs, adapters)
        if key in self.graphs:
            if adapters:
                self.lora.stage_graph()
            self.graphs[key].replay()
            return self.outputs[key][:num]
        return self.model(batch, self.attn)[:num]

    def _stage(self, bs: int, input_ids: Sequence[int], positions: Sequence[int],
               kv_lens: Sequence[int], out_slots: Sequence[int],
               rows: Sequence[int]) -> ForwardBatch:
        """Pack the step, padded to bs, into the device inputs; return the padded batch."""
        pad = self.max_bs - len(kv_lens)
        fields = [list(input_ids) + [0] * pad, list(positions) + [0] * pad,
                  list(kv_lens) + [1] * pad, list(out_slots) + [self.scratch_slot] * pad,
                  list(rows) + [0] * pad]
        staged = torch.tensor(fields, dtype=torch.int64)
        self._turn ^= 1
        host, copied = self.host[self._turn], self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # two steps ago: long done unless the host ran far ahead
        host.copy_(staged)
        # Non-blocking from pinned memory: the host does not wait for the GPU's earlier work.
        self.inputs.copy_(host, non_blocking=True)
        if copied is not None:
            copied.record()
        padded_kv_lens = list(kv_lens) + [1] * (bs - len(kv_lens))
        return ForwardBatch(
            input_ids=self.inputs[IDS, :bs], positions=self.inputs[POSITIONS, :bs],
            q_lens=[1] * bs, kv_lens=padded_kv_lens, out_slots=self.inputs[OUT_SLOTS, :bs],
            slot_table=self.slot_table[:bs], kv_cache=self.kv_cache)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        variants = [False] if self.lora is None else [False, True]
        # Largest first: the smaller graphs then fit in the memory pool the largest left.
        for bs in reversed(self.sizes):
            batch = self._stage(bs, [0] * bs, [0] * bs, [1] * bs, [self.scratch_slot] * bs,
                                [0] * bs)
            self.attn.plan_cuda_graph(batch, self.inputs[KV_LENS, :bs])
            for adapters in variants:
                if adapters:  # every tile unused while capturing: the kernels only launch
                    self.lora.step = self.lora.graph_step(bs)
                try:
                    self._capture(bs, adapters, batch, pool, stream)
                finally:
                    if adapters:
                        self.lora.step = None
        torch.cuda.synchronize(self.device)

    def _capture(self, bs: int, adapters: bool, batch: ForwardBatch, pool: Any,
                 stream: torch.cuda.Stream) -> None:
        # A warm-up run outside the capture compiles the Triton / FlashInfer kernels for this
        # shape; nothing may compile or allocate host-synchronously while capturing.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.model(batch, self.attn)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.outputs[bs, adapters] = self.model(batch, self.attn)
        self.graphs[bs, adapters] = graph
