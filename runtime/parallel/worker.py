"""A tensor-parallel worker rank: `python -m radixlm.runtime.parallel.worker`.

Started by rank 0's engine for each other rank on its machine, or by hand (one per rank, with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set) for a launch across machines.
It joins the group, receives the engine config from rank 0, loads its shard of the model,
allocates its shard of the KV pool, captures the same decode CUDA graphs as rank 0 (at the same
time: the collectives inside pair up), then runs every forward, graph replay and logits call
rank 0 sends until told to stop. It keeps no requests, no slot table and samples nothing
(see tensor_parallel).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist

from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache, kv_storage_dtype
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.distributed.groups import (
    destroy_group,
    init_group,
    ordered_all_reduce,
    setup_all_reduce,
    split_layers,
    tp_group,
)
from radixlm.runtime.execution.cpu_decode import build as build_cpu_decode
from radixlm.runtime.execution.cuda_graph import SENT_ROWS, DecodeGraphs
from radixlm.runtime.models.loader import load_model
from radixlm.runtime.models.lora.adapter import load_adapter
from radixlm.runtime.models.lora.slots import follower_slots
from radixlm.runtime.parallel.pipeline import PipelineChannel
from radixlm.runtime.parallel.sequence import (
    ExchangingAttention,
    KVExchange,
    gather_rows,
    rank_batch,
    zigzag,
)
from radixlm.runtime.parallel.step_channel import (
    FORWARD,
    GRAPH,
    GREEDY,
    HEARTBEAT,
    KV_ROWS,
    LOGITS,
    LORA,
    LORA_LOAD,
    PARENT_ENV,
    SPLIT_FORWARD,
    STOP,
    TIER,
    TIER_SETTLE,
    TIER_STORE,
    StepChannel,
    agree,
    model_shape,
    settle_count,
)
from radixlm.runtime.scheduling.tiers import make_tier, tier_numerics

log = logging.getLogger("radixlm.runtime.parallel.worker")


def _device(config: EngineConfig, local_rank: int) -> torch.device:
    device = config.torch_device()
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def _watch_parent(pid: int) -> None:
    """Exit when the launching engine process is gone (it may have been killed)."""
    def watch() -> None:
        while True:
            if os.getppid() != pid:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@torch.inference_mode()
def serve(rank: int, world_size: int, local_rank: int) -> None:
    # The config is not known before joining: rank 0 passes the backend and its timeout
    # in the environment (set them by hand for a multi-node launch).
    timeout = float(os.environ.get("RADIXLM_TP_TIMEOUT", "600"))
    pp_size = int(os.environ.get("RADIXLM_PP_SIZE", "1"))
    backend = os.environ.get("RADIXLM_TP_BACKEND") or (
        "nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    tp = init_group(rank, world_size, backend, timeout, pp_size=pp_size)
    pipeline = tp.pipeline
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    config: EngineConfig = box[0]
    layer_range = (None if pipeline is None else
                   split_layers(model_shape(config).num_layers, pp_size)[pipeline.stage])
    device = _device(config, local_rank)
    if device.type == "cpu":
        # The ranks of one machine share its cores: oversubscribed intra-op threads make every
        # collective wait for a descheduled peer (10x slower steps on two cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dtype = config.torch_dtype(device)
    shard = None if config.sp_size > 1 else tp  # sequence-parallel ranks hold the whole model
    loaded = load_model(config.model, config.load_format, dtype, device,
                        max_positions=config.max_model_len, seed=config.seed,
                        quantization=config.quantization, tp=shard, layer_range=layer_range)
    mc, model = loaded.config, loaded.model
    dist.broadcast_object_list(box, src=0)
    start = box[0]
    setup_all_reduce(start["all_reduce"], start["all_reduce_numel"], dtype, device)
    kv_heads = mc.num_kv_heads if shard is None else shard.kv_heads(mc.num_kv_heads)[1]
    kv_cache = KVCache(len(mc.held_layers), start["num_slots"], kv_heads, mc.head_dim, dtype,
                       device,
                       config.page_size, kv_storage_dtype(config.kv_cache_dtype, dtype))
    if loaded.kv_scales is not None and kv_cache.quantized:
        kv_cache.set_scales(*loaded.kv_scales)
    # Deterministic mode: this shard runs the batch-invariant kernels too, set before any
    # graph is captured.
    deterministic = config.deterministic_on(device)
    if deterministic:
        model.use_batch_invariant(True)
    attn = create_backend(config.attention_backend, scale=mc.head_dim ** -0.5, device=device,
                          dtype=dtype, head_dim=mc.head_dim, deterministic=deterministic,
                          fp8_attention=config.fp8_attention)
    # The same adapters as rank 0's, this rank's share of each (after the KV pool, as
    # rank 0 sized it with the slots already allocated).
    lora = (None if start["lora"] is None
            else follower_slots(model, start["lora"], dtype, device))
    # Captured at the same time as rank 0's graphs: their all-reduces pair up.
    graphs = (None if start["graph_args"] is None else
              DecodeGraphs(model, attn, kv_cache, None, **start["graph_args"], lora=lora))
    # On the CPU every rank runs the forward kernel over its shard, or none does (rank 0's
    # TensorParallelGroup.cpu_kernel_everywhere).
    kernel = None
    if device.type == "cpu":
        kernel = (None if config.disable_cpu_kernel
                  else build_cpu_decode(model, attn, kv_cache,
                                        ordered_all_reduce if tp.size > 1 and shard
                                        else None))
        if not agree(kernel is not None, tp.host_group if pipeline is None
                     else pipeline.control):
            kernel = None
        elif lora is not None:
            kernel.lora = lora

    def forward(batch: ForwardBatch, hidden: torch.Tensor | None = None,
                exchange: KVExchange | None = None) -> torch.Tensor:
        if kernel is not None:
            return kernel.forward(batch, hidden, exchange)
        attn.plan(batch)
        return model(batch, attn if exchange is None else ExchangingAttention(attn, exchange),
                     hidden)

    # This rank's own lower tier of the prefix cache, over its shard of the KV; rank 0
    # mirrors its stores and loads here (sharded_tier.py).
    tier = make_tier(config, model, kv_cache.k, kv_cache.v, kv_cache.storage_dtype,
                     tier_numerics(mc, device, dtype, attn, config, tp_rank=rank))
    pipe = (None if pipeline is None else
            PipelineChannel(pipeline, tp.rank, mc.hidden_size, device, dtype))
    if pipeline is not None and pipeline.stage > 0:
        _serve_stage(pipe, kv_cache, forward)
        return
    channel = StepChannel(device, dtype, tp.host_group, tp_group())
    loads: dict[int, Future] = {}  # this rank's tier loads, by rank 0's numbers
    while True:
        header = channel.recv_header()
        command = header[0]
        if command == FORWARD:
            stream = forward(channel.recv_forward(header, kv_cache))
            if pipe is not None:
                pipe.send_hidden(stream)
        elif command == SPLIT_FORWARD:  # sequence parallelism: this rank's rows
            batch = channel.recv_forward(header, kv_cache)
            ranks = zigzag(batch.num_tokens, world_size)
            own = forward(rank_batch(batch, ranks[rank]), None, KVExchange(batch, ranks, rank))
            gather_rows(own, ranks)
        elif command == KV_ROWS:
            channel.recv_kv_rows(header, kv_cache)
        elif command == LORA:
            lora.follow(*channel.recv_lora(header))
        elif command == LORA_LOAD:
            _load_lora(lora, model, tp.host_group)
        elif command == GRAPH:
            graphs.replay_received(*channel.recv_graph_step(header, SENT_ROWS))
        elif command == LOGITS:
            model.compute_logits(channel.recv_hidden(header))
        elif command == GREEDY:
            model.greedy_tokens(channel.recv_hidden(header))
        elif command == TIER:
            _tier_command(tier, header, loads, tp.host_group)
        elif command == STOP:
            if tier is not None:
                tier.close()
            return
        elif command != HEARTBEAT:
            raise RuntimeError(f"unknown tensor-parallel command {command}")


def _serve_stage(pipe: PipelineChannel, kv_cache: KVCache,
                 forward: Callable[[ForwardBatch, torch.Tensor], torch.Tensor]) -> None:
    """A rank of a pipeline stage after the first: each step rank 0 describes, from the
    previous stage's output to this stage's (parallel/pipeline.py)."""
    while True:
        header = pipe.recv_header()
        command = header[0]
        if command == FORWARD:
            batch = pipe.recv_step(header, kv_cache)
            pipe.send_hidden(forward(batch, pipe.recv_hidden(batch.num_tokens)))
        elif command == STOP:
            pipe.flush()
            return
        elif command != HEARTBEAT:
            raise RuntimeError(f"unknown pipeline command {command}")


def _tier_command(tier: Any, header: list[int], loads: dict[int, Future],
                  host_group: Any) -> None:
    """A store or load rank 0 made in its tier, made here in this rank's; or the settling of
    a load: how many of its pages every rank has."""
    _, kind, number, count = header
    if kind == TIER_SETTLE:
        try:
            loaded = loads.pop(number).result()
        except Exception:  # noqa: BLE001 - a read that failed: those pages get computed
            log.exception("KV cache tier: a load failed")
            loaded = 0
        settle_count(min(loaded, count), host_group)
        return
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=host_group)
    names, pages = box[0]
    if kind == TIER_STORE:
        tier.store(names, pages)
    else:
        loads[number] = tier.load_async(names, pages)


def _load_lora(lora: Any, model: Any, host_group: Any) -> None:
    """Rank 0's load_lora: this rank's share of the adapter at the same catalog index, kept
    only if every rank could load it."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    index, name, path = box[0]
    try:
        adapter = load_adapter(name, path, model)
    except Exception:  # noqa: BLE001 - reported to rank 0 through the agreement
        log.exception("LoRA adapter %r could not be loaded from %s", name, path)
        adapter = None
    if agree(adapter is not None, host_group):
        lora.set_catalog(index, adapter)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-worker %(message)s")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if PARENT_ENV in os.environ:
        _watch_parent(int(os.environ[PARENT_ENV]))
    try:
        serve(rank, world_size, local_rank)
    except Exception:
        log.exception("rank %d failed", rank)
        sys.exit(1)
    finally:
        destroy_group()


if __name__ == "__main__":
    main()
