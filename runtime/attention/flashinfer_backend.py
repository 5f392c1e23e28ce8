"""Attention on FlashInfer's paged kernels (CUDA only; fp16/bf16 models, with KV caches of
the model's dtype or float8, which FlashInfer's kernels widen as they load).

Our per-layer cache [num_slots, Hkv, D] with slot = page * page_size + offset *is* FlashInfer's
"NHD" paged layout once viewed as [num_pages, page_size, Hkv, D] (KVCache.layer_pages). A
sequence's pages are the page ids of its slot table taken every page_size positions:

    kv_len = 37, page_size = 16:  pages = slot_table[i, [0, 16, 32]] // 16
    indptr[i+1] - indptr[i] = 3,  last_page_len = 37 - 2 * 16 = 5

A step of only decode tokens goes to BatchDecodeWithPagedKVCacheWrapper; any other step (prefill
chunks with or without cached prefixes, mixed with decode tokens) goes whole to
BatchPrefillWithPagedKVCacheWrapper with a causal mask, which FlashInfer aligns bottom-right
(query j of a chunk sees keys 0 .. kv_len - q_len + j), exactly our rule. So queries and
outputs stay in the step's token order: no gathers, no scatters.

FlashInfer plans on the host. indptr and last_page_len are built on the host from the lengths
the scheduler already knows and the page ids on the device, so planning never waits for the
GPU. The wrapper's plan needs the number of query heads, which the batch does not carry: it
runs at the first layer's forward of each step and is reused by the others.

CUDA graphs (decode only): FlashInfer's decode wrapper fixes its batch size and index buffers
when built with use_cuda_graph=True, so there is one wrapper per padded batch size, all
viewing one set of buffers. `plan_cuda_graph` plans the step into them before capture and
before each replay (the plan stays on the host, outside the graph).

A float8 cache with a 16-bit query runs on FlashInfer's FA2 kernels, named explicitly: its
"auto" choice on Hopper (this FlashInfer version) is FA3, whose kernels need a float8 query
too and return wrong outputs for this pair.

Layers that attend differently (`LayerAttention`: scale, sliding window, soft-cap) each get
their own wrappers, since FlashInfer fixes those at plan time (window_left = window - 1: the
keys before the query's own). A step plans a kind of layer when its first layer of that kind
runs. Graph wrappers are per (batch size, kind): the warm-up run before each capture meets
every kind the model has, and each replay's plan re-plans all of them.
"""

from __future__ import annotations

from typing import Any

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    ForwardBatch,
    LayerAttention,
)
from radixlm.runtime.attention.kv_cache import KVCache

WORKSPACE_BYTES = 128 * 1024 * 1024


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            "attention_backend='flashinfer' needs FlashInfer (pip install flashinfer-python; "
            "CUDA only). Use attention_backend='triton' or 'torch' without it.") from exc
    return flashinfer


class FlashInferAttention(AttentionBackend):
    supports_cuda_graph = True
    graph_plan_reads_host_lens = True  # FlashInfer plans on the host

    def __init__(self, scale: float, decode_tensor_cores: bool = False) -> None:
        """decode_tensor_cores: run decode on FlashInfer's tensor-core (prefill) kernels. Off:
        on an H200 they were 2.8-3.7x slower than its CUDA-core decode for 32 q / 8 KV heads
        (benchmarks/attention_kernels.py), against FlashInfer's advice for groups of 4+."""
        self.flashinfer = import_flashinfer()
        self.scale = scale
        self.decode_tensor_cores = decode_tensor_cores
        self._workspace: torch.Tensor | None = None
        self._prefill: dict[tuple[torch.dtype, LayerAttention], Any] = {}
        self._decode: dict[tuple[torch.dtype, bool, LayerAttention], Any] = {}
        self._graph_wrappers: dict[tuple[int, LayerAttention], Any] = {}
        self._graph_kinds: set[LayerAttention] = set()  # layer kinds met in graph steps
        self._graph_bs: int | None = None  # the padded batch size, during a graph step
        self._stepped: dict[LayerAttention, Any] = {}  # this step's planned wrappers
        # FlashInfer plans into a pinned host buffer and copies it to the device without
        # blocking. With overlap scheduling the next plan can come before that copy ran, so
        # each plan first waits for the previous one's copy (normally long done).
        self._planned: torch.cuda.Event | None = None

    def plan(self, batch: ForwardBatch) -> None:
        cache = batch.kv_cache
        if cache.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend='flashinfer' supports float16 and bfloat16 "
                             f"models, not {cache.dtype}; use 'triton' or 'torch'")
        device = batch.slot_table.device
        if device.type != "cuda":
            raise ValueError("attention_backend='flashinfer' runs on CUDA only")
        page_size = cache.page_size
        pages = [-(-n // page_size) for n in batch.kv_lens]
        indptr = [0]
        for n in pages:
            indptr.append(indptr[-1] + n)
        qo_indptr = [0]
        for n in batch.q_lens:
            qo_indptr.append(qo_indptr[-1] + n)
        host = dict(dtype=torch.int32)
        self.indptr = torch.tensor(indptr, **host)
        self.qo_indptr = torch.tensor(qo_indptr, **host)
        self.last_page_len = torch.tensor(
            [n - (p - 1) * page_size for n, p in zip(batch.kv_lens, pages)], **host)
        # Page ids on the device: flat page k of sequence i is its page number
        # k - indptr[i], whose first slot sits at position (k - indptr[i]) * page_size.
        total = indptr[-1]
        counts = to_device(pages, torch.int64, device)
        rows = torch.repeat_interleave(torch.arange(len(pages), device=device), counts,
                                       output_size=total)  # [total]
        starts = self.indptr[:-1].to(device, non_blocking=True).long()
        cols = (torch.arange(total, device=device) - starts[rows]) * page_size
        self.indices = (batch.slot_table[rows, cols] // page_size).int()
        self.decode_only = all(n == 1 for n in batch.q_lens)
        self.dtype, self.kv_dtype = cache.dtype, cache.storage_dtype
        self.page_size = page_size
        self._stepped = {}
        self._graph_bs = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, layer: LayerAttention = FULL_ATTENTION,
                kv_stored: bool = False) -> torch.Tensor:
        cache = batch.kv_cache
        if not kv_stored:
            cache.store(layer_id, batch.out_slots, k, v)
        wrapper = self._stepped.get(layer)
        if wrapper is None:
            if self._graph_bs is not None:  # a warm-up run before capture meets this kind
                self._graph_kinds.add(layer)
                wrapper = self._plan_graph_wrapper(self._graph_bs, layer)
            else:
                wrapper = self._plan_wrapper(q.shape[1], k.shape[1], q.shape[2], q.device,
                                             layer)
        # A float8 cache's scales: FlashInfer folds K's into the softmax scale and multiplies
        # the output by V's.
        k_scale, v_scale = cache.scales(layer_id) if cache.quantized else (None, None)
        return wrapper.run(q.contiguous(), cache.layer_pages(layer_id), k_scale=k_scale,
                           v_scale=v_scale)

    def init_cuda_graph(self, batch_sizes: list[int], max_len: int, num_heads: int,
                        kv_cache: KVCache) -> None:
        device = kv_cache.k.device
        max_bs = max(batch_sizes)
        # A padded row holds one page; a real one up to max_len tokens' worth.
        max_pages = max_bs * -(-max_len // kv_cache.page_size)
        int32 = dict(dtype=torch.int32, device=device)
        indptr = torch.zeros(max_bs + 1, **int32)
        indices = torch.zeros(max_pages, **int32)
        last_page_len = torch.ones(max_bs, **int32)
        self._graph_heads = (num_heads, kv_cache.k.shape[2], kv_cache.k.shape[3])
        self._graph_buffers = (indptr, indices, last_page_len)
        self._workspace_on(device)
        self._graph_kinds = {FULL_ATTENTION}

    def plan_cuda_graph(self, batch: ForwardBatch, kv_lens: torch.Tensor) -> None:
        self.plan(batch)  # host indptr / last_page_len, device page ids
        bs = len(batch.q_lens)
        for layer in self._graph_kinds:
            self._plan_graph_wrapper(bs, layer)
        self._graph_bs = bs

    def _plan_graph_wrapper(self, bs: int, layer: LayerAttention) -> Any:
        wrapper = self._graph_wrappers.get((bs, layer))
        if wrapper is None:
            indptr, indices, last_page_len = self._graph_buffers
            wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=indptr[: bs + 1], paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:bs], backend=self._kernels())
            self._graph_wrappers[(bs, layer)] = wrapper
        num_heads, num_kv_heads, head_dim = self._graph_heads
        self._wait_previous_plan()
        wrapper.plan(self.indptr, self.indices, self.last_page_len, num_heads, num_kv_heads,
                     head_dim, self.page_size, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                     **self._layer_args(layer))
        self._mark_planned()
        self._stepped[layer] = wrapper
        return wrapper

    def _layer_args(self, layer: LayerAttention) -> dict[str, Any]:
        window = layer.sliding_window
        return dict(sm_scale=self.scale if layer.scale is None else layer.scale,
                    window_left=-1 if window is None else window - 1,
                    logits_soft_cap=layer.logit_softcap)

    def _kernels(self) -> str:
        """FlashInfer's backend for this cache (see the module docstring)."""
        return "fa2" if self.kv_dtype != self.dtype else "auto"

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _plan_wrapper(self, num_heads: int, num_kv_heads: int, head_dim: int,
                      device: torch.device, layer: LayerAttention) -> Any:
        """Plan this step for one kind of layer, at its first layer of the step."""
        self._workspace_on(device)
        self._wait_previous_plan()
        common = dict(q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                      **self._layer_args(layer))
        if self.decode_only:
            key = (self.kv_dtype, self.decode_tensor_cores, layer)
            wrapper = self._decode.get(key)
            if wrapper is None:
                wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=self.decode_tensor_cores,
                    backend=self._kernels())
                self._decode[key] = wrapper
            wrapper.plan(self.indptr, self.indices, self.last_page_len, num_heads,
                         num_kv_heads, head_dim, self.page_size, **common)
        else:
            wrapper = self._prefill.get((self.kv_dtype, layer))
            if wrapper is None:
                wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD", backend=self._kernels())
                self._prefill[(self.kv_dtype, layer)] = wrapper
            wrapper.plan(self.qo_indptr, self.indptr, self.indices, self.last_page_len,
                         num_heads, num_kv_heads, head_dim, self.page_size, causal=True,
                         **common)
        self._mark_planned()
        self._stepped[layer] = wrapper
        return wrapper

    def _wait_previous_plan(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def _mark_planned(self) -> None:
        if self._planned is None:
            self._planned = torch.cuda.Event()
        self._planned.record()
