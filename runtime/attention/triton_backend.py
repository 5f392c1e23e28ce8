"""Attention on our own Triton kernels (radixlm.kernels.triton_attention). CUDA, or CPU under
the Triton interpreter (TRITON_INTERPRET=1, for tests).

`plan` sorts the step's sequences into decode (q_len == 1) and extend (q_len > 1), chooses the
decode split count and the extend block table from host-side lengths, and sends all per-step
index tensors to the device in one copy. `forward` then launches, per layer, the K/V store
(unless the model's fused rotary already stored them), the split-KV decode kernel (+ merge)
and the extend kernel, writing each token's output row in place: no gathers, no scatters and
no host sync. A float8 cache is written and read by the same kernels, with its per-layer
scales passed as scalars.

In a CUDA graph (decode steps padded to fixed batch sizes) the grid must not change between
capture and replay: the split count is fixed per batch size from the longest context the
engine allows (the kernel reads each sequence's real length from the device, so any count is
correct), and the per-step lengths come from a buffer the graph runner refills in place.

`deterministic=True` runs both decode and extend through the batch-invariant kernel
(radixlm.kernels.invariant_attention): keys reduced in fixed 256-token splits, one tile shape
for every step, so a query's output does not depend on its batch, its chunk or whether it is a
decode step. What varies with the batch is only how many programs share a sequence's splits
(`workers`), which changes where partial results are added, never how.
"""

from __future__ import annotations

import dataclasses

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    ForwardBatch,
    LayerAttention,
)
from radixlm.runtime.attention.kv_cache import KVCache

try:
    from radixlm.kernels import invariant_attention as ia
    from radixlm.kernels import triton_attention as ta
except ImportError as exc:  # triton missing: say what to install, not a bare ImportError
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


class TritonAttention(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, scale: float, num_splits: int | None = None,
                 decode_config: ta.DecodeConfig | None = None,
                 extend_config: ta.ExtendConfig | None = None,
                 deterministic: bool = False, fp8_qk: bool = False) -> None:
        """num_splits fixes the decode KV split count, and the configs the kernels' tiles
        (tests, tuning); None picks them per step from the shapes. In deterministic mode
        num_splits fixes the decode workers per sequence instead (tests). fp8_qk: decode
        multiplies q.k in float8 over an e4m3 cache (DecodeConfig.fp8_qk)."""
        if _IMPORT_ERROR is not None:
            raise ImportError("attention_backend='triton' needs the triton package "
                              f"(pip install triton): {_IMPORT_ERROR}") from _IMPORT_ERROR
        self.scale = scale
        self.fixed_splits = num_splits
        self.fixed_decode_cfg = decode_config
        self.fixed_extend_cfg = extend_config
        self.deterministic = deterministic
        self.fp8_qk = fp8_qk
        self.max_splits = 1  # deterministic decode: the workspace's splits per sequence
        self._num_sms: dict[torch.device, int] = {}

    def plan(self, batch: ForwardBatch) -> None:
        device = batch.slot_table.device
        dtype, head_dim = batch.kv_cache.dtype, batch.kv_cache.k.shape[-1]
        num_kv_heads = batch.kv_cache.k.shape[2]
        q_lens, kv_lens = batch.q_lens, batch.kv_lens
        q_starts = [0] * len(q_lens)
        for i in range(1, len(q_lens)):
            q_starts[i] = q_starts[i - 1] + q_lens[i - 1]
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        extend = [i for i, n in enumerate(q_lens) if n > 1]
        self._choose_configs(dtype, head_dim)
        block_m = ia.BLOCK_TOKENS if self.deterministic else self.extend_cfg.block_m
        block_rows, block_m0 = ta.extend_blocks(q_lens, extend, block_m)
        self.num_splits = 1
        if decode:
            max_kv = max(kv_lens[i] for i in decode)
            choose = ia.decode_workers if self.deterministic else ta.choose_num_splits
            self.num_splits = self.fixed_splits or choose(
                len(decode), num_kv_heads, max_kv, self._sm_count(device))
            self.max_splits = -(-max_kv // ia.SPLIT)

        # One host->device copy: [q_starts | q_lens | kv_lens | decode rows | decode token
        # rows | extend block rows | extend block first queries], then views into it. Each part
        # is padded to an even length so that every view starts 16-byte aligned: Triton
        # compiles a kernel variant per pointer alignment, and odd lengths would flip the
        # views' alignment from step to step (each new combination: a compile, 1-2 s on the
        # H200, in the middle of serving).
        parts = [q_starts, q_lens, kv_lens, decode, [q_starts[i] for i in decode], block_rows,
                 block_m0]
        padded = [part + [0] * (len(part) % 2) for part in parts]
        meta = to_device([x for part in padded for x in part], torch.int64, device)
        views = [view[: len(part)]
                 for view, part in zip(meta.split([len(p) for p in padded]), parts)]
        (self.q_starts, self.q_lens, self.kv_lens, self.decode_rows, self.decode_q_rows,
         self.block_rows, self.block_m0) = views

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, layer: LayerAttention = FULL_ATTENTION,
                kv_stored: bool = False) -> torch.Tensor:
        k_cache, v_cache = batch.kv_cache.layer(layer_id)
        k_scale, v_scale = batch.kv_cache.scales(layer_id)
        if not kv_stored:
            ta.store_kv(k, v, batch.out_slots, k_cache, v_cache, k_scale, v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scale = self.scale if layer.scale is None else layer.scale
        window, softcap = layer.sliding_window, layer.logit_softcap
        if self.deterministic:
            ia.invariant_decode(q, k_cache, v_cache, out, batch.slot_table, self.kv_lens,
                                self.decode_rows, self.decode_q_rows, scale, self.num_splits,
                                self.max_splits, window, softcap, k_scale, v_scale)
            ia.invariant_extend(q, k_cache, v_cache, out, batch.slot_table, self.q_starts,
                                self.q_lens, self.kv_lens, self.block_rows, self.block_m0,
                                scale, window, softcap, k_scale, v_scale)
            return out
        ta.decode_attention(q, k_cache, v_cache, out, batch.slot_table, self.kv_lens,
                            self.decode_rows, self.decode_q_rows, scale, self.num_splits,
                            self.decode_cfg, window, softcap, k_scale, v_scale)
        ta.extend_attention(q, k_cache, v_cache, out, batch.slot_table, self.q_starts,
                            self.q_lens, self.kv_lens, self.block_rows, self.block_m0,
                            scale, self.extend_cfg, window, softcap, k_scale, v_scale)
        return out

    def init_cuda_graph(self, batch_sizes: list[int], max_len: int, num_heads: int,
                        kv_cache: KVCache) -> None:
        device = kv_cache.k.device
        num_kv_heads = kv_cache.k.shape[2]
        sms = self._sm_count(device)
        choose = ia.decode_workers if self.deterministic else ta.choose_num_splits
        self._graph_splits = {
            bs: self.fixed_splits or choose(bs, num_kv_heads, max_len, sms)
            for bs in batch_sizes}
        # Deterministic decode: workspace for the longest context a graph may replay.
        self._graph_max_splits = -(-max_len // ia.SPLIT)
        # Decode sequence i is batch row i and token row i: one arange serves both maps.
        self._graph_rows = torch.arange(max(batch_sizes), dtype=torch.int64, device=device)
        self._graph_none = torch.zeros(0, dtype=torch.int64, device=device)

    def _choose_configs(self, dtype: torch.dtype, head_dim: int) -> None:
        decode = self.fixed_decode_cfg or ta.decode_config(dtype, head_dim)
        self.decode_cfg = dataclasses.replace(decode, fp8_qk=True) if self.fp8_qk else decode
        self.extend_cfg = self.fixed_extend_cfg or ta.extend_config(dtype, head_dim)

    def plan_cuda_graph(self, batch: ForwardBatch, kv_lens: torch.Tensor) -> None:
        num = len(batch.q_lens)
        dtype, head_dim = batch.kv_cache.dtype, batch.kv_cache.k.shape[-1]
        self._choose_configs(dtype, head_dim)
        self.num_splits = self._graph_splits[num]
        self.max_splits = self._graph_max_splits
        self.kv_lens = kv_lens
        self.decode_rows = self.decode_q_rows = self._graph_rows[:num]
        # No extend blocks: extend_attention returns before launching anything.
        self.q_starts = self.q_lens = self.block_rows = self.block_m0 = self._graph_none

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else 8)
        return self._num_sms[device]
