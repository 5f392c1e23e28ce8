"""How the model runs for an EngineCore, decided once at start-up: CUDA decode graphs or not,
the tensor-parallel all-reduce, the graphs' sizes. `ExecutionSetup` then builds what follows
from those decisions: the KV tensors, the model runner (with the CPU decode kernel, the decode
graphs and the other tensor-parallel ranks started alongside) and the speculator.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.kv_cache import KVCache, kv_storage_dtype
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.distributed.groups import (
    check_nccl_in_graphs,
    choose_all_reduce,
    ordered_all_reduce,
    setup_all_reduce,
)
from radixlm.runtime.execution.cpu_decode import build as build_cpu_decode
from radixlm.runtime.execution.cuda_graph import DecodeGraphs
from radixlm.runtime.execution.model_runner import ModelRunner
from radixlm.runtime.execution.speculative.draft_model import DraftModel
from radixlm.runtime.execution.speculative.speculator import Speculator
from radixlm.runtime.models.loader import LoadedModel
from radixlm.runtime.models.lora.slots import LoRASlots, describe
from radixlm.runtime.parallel.sharded import ShardedKernel, ShardedModel
from radixlm.runtime.scheduling.kv_manager import KVManager
from radixlm.runtime.scheduling.pages import ReqToTokenTable

log = logging.getLogger(__name__)


class ExecutionSetup:
    """The start-up decisions for a target model with `num_pages` KV pages and contexts of up
    to `max_len` tokens; `graphs`: decode steps replay CUDA graphs. Checks that the
    all-reduce can run inside graphs before anything big is allocated."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device,
                 dtype: torch.dtype, num_pages: int, max_len: int, graphs: bool) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.num_pages = num_pages
        self.graphs = graphs
        self.deterministic = config.deterministic_on(device)
        if self.deterministic:
            # Before any graph is captured: graphs keep the kernels they were captured with.
            loaded.model.use_batch_invariant(True)
        # Tensor parallelism: rank 0's model is the stand-in that sends each call to the other
        # ranks; graphs capture the shard itself, and send each replay (see cuda_graph).
        self.tp_group = loaded.model.group if isinstance(loaded.model, ShardedModel) else None
        # Symmetric memory spans every rank: pipeline stages reduce within their own. In
        # deterministic mode the ranks' partial sums are gathered and added in rank order (a
        # library all-reduce orders its additions by the message's size, that is the batch's).
        self.all_reduce = ("none" if self.tp_group is None
                           else "ordered" if self.deterministic
                           else "nccl" if config.pp_size > 1 or config.sp_size > 1
                           else choose_all_reduce(config.tp_all_reduce, device))
        check_nccl_in_graphs(self.all_reduce, graphs, device)  # before the KV pool is allocated
        # Verify steps replay as one decode row per token: up to 1 + k rows per request.
        self.rows = config.max_running_requests * (1 + (config.num_speculative_tokens
                                                         if config.speculative else 0))
        self.graph_args = (dict(scratch_slot=num_pages * config.page_size,
                                max_batch_size=self.rows, max_len=max_len,
                                capture=device.type == "cuda")
                           if graphs else None)

    def kv_cache(self, loaded: LoadedModel) -> KVCache:
        """The target model's KV tensors, one slot per token of the page pool."""
        mc, config = loaded.config, self.config
        # With CUDA graphs, one page past the allocator's: padded rows write their K/V there.
        scratch_pages = 1 if self.graphs else 0
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        kv_cache = KVCache(len(mc.held_layers),
                           (self.num_pages + scratch_pages) * config.page_size,
                           mc.num_kv_heads, mc.head_dim, self.dtype, self.device,
                           config.page_size, kv_dtype)
        if loaded.kv_scales is not None and kv_cache.quantized:
            kv_cache.set_scales(*loaded.kv_scales)
        return kv_cache

    def runner(self, loaded: LoadedModel, attn: Any, kv_cache: KVCache,
               table: ReqToTokenTable, lora: LoRASlots | None = None) -> ModelRunner:
        """The model runner, with the CPU decode kernel or the decode graphs where they apply;
        with tensor parallelism, the other ranks allocate their KV and capture alongside.
        lora: the adapters' slots, when the engine serves any."""
        config, device, tp_group = self.config, self.device, self.tp_group
        runner = ModelRunner(loaded.model, attn, kv_cache, table, device)
        kernel = None
        if device.type == "cpu" and not config.disable_cpu_kernel:
            kernel = (build_cpu_decode(loaded.model, attn, kv_cache) if tp_group is None
                      else build_cpu_decode(loaded.model.model, attn, kv_cache,
                                            ordered_all_reduce if tp_group.tp_size > 1
                                            else None))
        if tp_group is not None:
            numel = self.rows * loaded.config.hidden_size  # a decode step's activations
            tp_group.start(kv_cache.num_slots, self.graph_args, self.all_reduce, numel,
                           None if lora is None else describe(lora))
            log.info("tensor parallelism: %d ranks, %s all-reduce", tp_group.size,
                     setup_all_reduce(self.all_reduce, numel, self.dtype, device))
            # Every rank runs the kernel over its shard, or none does (parallel/worker.py).
            if device.type == "cpu" and tp_group.cpu_kernel_everywhere(kernel is not None):
                kernel = ShardedKernel(kernel, tp_group)
            else:
                kernel = None
        runner.cpu_decode = kernel
        if self.graphs:
            runner.cuda_graphs = DecodeGraphs(
                loaded.model.model if tp_group else loaded.model, attn, kv_cache,
                table, **self.graph_args, followers=tp_group, lora=lora)
        if lora is not None:
            runner.use_lora(lora)
            lora.followers = tp_group  # every step's slots go to the other ranks
        return runner

    def speculator(self, draft: LoadedModel | None, runner: ModelRunner, kv: KVManager,
                   vocab_size: int) -> Speculator:
        """The speculator for config.speculative; a draft model, when given, gets KV tensors
        over the same slots as the target's and becomes the runner's `draft`."""
        config, device, dtype = self.config, self.device, self.dtype
        draft_model = None
        if draft is not None:
            dc = draft.config
            attn = create_backend(config.attention_backend, scale=dc.head_dim ** -0.5,
                                  device=device, dtype=dtype, head_dim=dc.head_dim,
                                  deterministic=self.deterministic,
                                  fp8_attention=config.fp8_attention)
            if self.deterministic:  # its proposals feed the sampled acceptance rule
                draft.model.use_batch_invariant(True)
            # Same slots as the target's pool (scratch page included): see draft_model.
            target_kv = runner.kv_cache
            kv_cache = KVCache(dc.num_layers, target_kv.k.shape[1], dc.num_kv_heads,
                               dc.head_dim, dtype, device, config.page_size,
                               target_kv.storage_dtype)
            if draft.kv_scales is not None and kv_cache.quantized:
                kv_cache.set_scales(*draft.kv_scales)
            draft_model = DraftModel(draft.model, attn, kv_cache, runner.table, vocab_size)
            if self.graph_args is not None:
                draft_model.cuda_graphs = DecodeGraphs(draft.model, attn, kv_cache,
                                                       runner.table, **self.graph_args)
            runner.draft = draft_model
        return Speculator(config.speculative, config.num_speculative_tokens, kv,
                          config.max_num_batched_tokens, draft_model,
                          config.speculative_adaptive)
