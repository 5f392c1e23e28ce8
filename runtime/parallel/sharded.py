"""Tensor parallelism across processes: rank 0 drives, ranks 1..N-1 follow.

Rank 0 is the engine's own process: it schedules, owns the radix cache and page allocator,
samples, and computes its shard of every forward. Before each forward it broadcasts the step
(`StepChannel`, step_channel.py): the flat token ids, positions, lengths, and the KV slots the
step writes and reads, all already resolved from rank 0's slot table, so the other ranks keep
no table of their own; they only hold their shard of the weights and of the KV pool (the same
number of slots). Pipeline stages after the first and sequence-parallel ranks follow the
same protocol with their own messages (pipeline.py, sequence.py).
With LoRA adapters, each forward is preceded by its rows' adapter slots and the slots to
fill (every rank loaded the same adapters at start, each its own share of them, and fills its
slots as rank 0 does; an adapter loaded while serving reaches every rank between two steps).
Before each logits computation it broadcasts the hidden rows to score:
the vocab-parallel output head gathers every rank's logits, and only rank 0 samples from them.
A step whose rows all take the plain argmax (greedy, nothing that changes logits, no logprobs)
gathers only each rank's (max, index) per row instead.

Startup: rank 0 launches `python -m radixlm.runtime.parallel.worker` per rank with the env://
variables, joins the process group, and broadcasts the engine config; every rank loads its own
shard. Failure: collectives time out after `tp_timeout` seconds, and rank 0 checks that its
workers are alive before each broadcast, so a dead rank fails the running requests with an
error instead of hanging. Once a rank is lost the group is broken and every later step fails
at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.distributed.groups import (
    TPInfo,
    backend_for,
    destroy_group,
    init_group,
    rendezvous_env,
    split_layers,
    tp_group,
    valid_tp_sizes,
)
from radixlm.runtime.execution.cpu_decode import load_kernel as load_cpu_kernel
from radixlm.runtime.execution.step_result import PendingHidden
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.loader import ARCHITECTURE_PRESETS, resolve_model
from radixlm.runtime.parallel.pipeline import PipelineChannel
from radixlm.runtime.parallel.sequence import (
    ExchangingAttention,
    KVExchange,
    gather_rows,
    rank_batch,
    zigzag,
)
from radixlm.runtime.parallel.step_channel import (
    GREEDY,
    HEARTBEAT,
    LOGITS,
    LORA_LOAD,
    PARENT_ENV,
    SPLIT_FORWARD,
    STOP,
    TIER,
    TIER_SETTLE,
    StepChannel,
    agree,
    model_shape,
    settle_count,
)

log = logging.getLogger(__name__)



class TensorParallelGroup:
    """Rank 0's handle on the group: the worker processes and the step channels. With
    pipeline parallelism (config.pp_size > 1) the group is every rank of every stage;
    `channel` then reaches stage 0's other ranks and `pipe` the later stages
    (parallel/pipeline.py)."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        # The workers run in rank 0's activation dtype, as resolved here (a GGUF model's
        # "auto" depends on what the file declares).
        config = dataclasses.replace(_resolved(config),
                                     dtype=str(dtype).removeprefix("torch."))
        shape = model_shape(config)
        _check_sizes(config, shape)  # before any process starts
        self.config = config
        self.tp_size = config.tp_size
        self.sp_size = config.sp_size
        self.size = config.tp_size * config.pp_size * config.sp_size
        # Each stage's [first, end) layers; this process holds the first stage's.
        self.layer_ranges = split_layers(shape.num_layers, config.pp_size)
        self.error: str | None = None  # set once a rank is lost; the group is then broken
        self._last_message = time.monotonic()
        self._threads: int | None = None  # this process's CPU threads before the group
        self.split_steps = 0  # sequence parallelism: steps split across the ranks
        backend = backend_for(device)
        external = os.environ.get("RADIXLM_TP_EXTERNAL_WORKERS") == "1"
        on_ray = config.distributed_executor_backend == "ray" and not external
        self._placement: Any = None  # the Ray placement group of the workers, with Ray
        if on_ray:
            from radixlm.runtime.parallel import ray_workers
        env = rendezvous_env(self.size, ray_workers.join_cluster() if on_ray else "127.0.0.1")
        # The workers learn the rest of the config from rank 0 once they have joined.
        env.update(RADIXLM_TP_BACKEND=backend, RADIXLM_TP_TIMEOUT=str(config.tp_timeout),
                   RADIXLM_PP_SIZE=str(config.pp_size))
        # Local processes, or Ray actors (parallel/ray_workers.py: subprocess.Popen's poll,
        # wait and kill); none when started by hand.
        self.workers: dict[int, Any] = {}
        if on_ray:
            self.workers, self._placement = ray_workers.launch(
                list(range(1, self.size)), env, device.type == "cuda")
        elif not external:
            self.workers = {rank: _launch_worker(rank, env) for rank in range(1, self.size)}
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # NCCL's objects go to the current device
        elif device.type == "cpu":
            # The ranks of one machine share its cores, rank 0 as much as the workers (see
            # worker.serve): with pipeline stages they compute at the same time. Restored
            # at shutdown: the process may go on to other work.
            self._threads = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))
            if not config.disable_cpu_kernel:
                # Built (the first time on this machine) before the ranks start, so that
                # they load it from the cache well within their startup timeouts.
                load_cpu_kernel()
        try:
            self.info: TPInfo = init_group(0, self.size, backend, config.tp_timeout, env,
                                           config.pp_size)
            self.channel = StepChannel(device, dtype, self.info.host_group, tp_group())
            pipeline = self.info.pipeline
            self.pipe = (None if pipeline is None else
                         PipelineChannel(pipeline, 0, shape.hidden_size, device, dtype))
            # Agreements need every rank, of every stage.
            self._everyone = self.info.host_group if pipeline is None else pipeline.control
            # What the model is built with: sequence-parallel ranks hold it whole.
            self.shard = None if self.sp_size > 1 else self.info
            dist.broadcast_object_list([config], src=0)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def start(self, num_slots: int, graph_args: dict | None, all_reduce: str,
              all_reduce_numel: int, lora: dict | None = None) -> None:
        """Tell the workers how many KV slots to allocate (rank 0 sized the pool), which
        all-reduce to set up for activations of up to all_reduce_numel elements, how to
        capture decode graphs (None: no graphs) and which LoRA slots and adapters to hold
        (models.lora.slots.describe; None: none). Then every rank sets up its all-reduce, and
        the workers capture alongside rank 0 and wait for steps."""
        message = {"num_slots": num_slots, "graph_args": graph_args, "all_reduce": all_reduce,
                   "all_reduce_numel": all_reduce_numel, "lora": lora}
        self._broadcast(lambda: dist.broadcast_object_list([message], src=0))

    def forward(self, batch: ForwardBatch) -> None:
        def send() -> None:
            if self.tp_size > 1:
                self.channel.send_forward(batch)
            if self.pipe is not None:
                self.pipe.send_step(batch)
        self._broadcast(send)

    def hand_on(self, stream: torch.Tensor) -> PendingHidden:
        """Send stage 0's output to stage 1; the last stage's output, once it comes back."""
        pipe = self.pipe
        self._broadcast(lambda: pipe.send_hidden(stream))
        rows = stream.shape[0]
        return PendingHidden(lambda: self.run(lambda: pipe.recv_hidden(rows, pipe.last_rank)))

    def sequence_step(self, batch: ForwardBatch,
                      compute: Callable[[ForwardBatch, KVExchange | None], torch.Tensor]
                      ) -> torch.Tensor:
        """A step under sequence parallelism (sequence.py): split across the ranks when it
        is long enough, `compute` running rank 0's rows with the exchange; else computed
        here alone and its K and V sent to the others."""
        if batch.num_tokens < max(self.config.sp_min_tokens, self.size):
            hidden = self.run(lambda: compute(batch, None))
            self._broadcast(lambda: self.channel.send_kv_rows(batch.kv_cache, batch.out_slots))
            return hidden
        self._broadcast(lambda: self.channel.send_forward(batch, SPLIT_FORWARD))
        self.split_steps += 1
        ranks = zigzag(batch.num_tokens, self.size)
        own = self.run(lambda: compute(rank_batch(batch, ranks[0]),
                                       KVExchange(batch, ranks, 0)))
        return self.run(lambda: gather_rows(own, ranks))

    def _send_header(self, command: int) -> None:
        if self.tp_size > 1 or self.sp_size > 1:
            self.channel.send_header(command)
        if self.pipe is not None:
            self.pipe.send_header(command)

    def graph_step(self, inputs: torch.Tensor, table_rows: torch.Tensor,
                   kv_lens: list[int]) -> None:
        self._broadcast(lambda: self.channel.send_graph_step(inputs, table_rows, kv_lens))

    def lora_step(self, per_row: list[int], fills: list[tuple[int, int]]) -> None:
        self._broadcast(lambda: self.channel.send_lora(per_row, fills))

    def lora_load(self, index: int, name: str, path: str) -> bool:
        """Every other rank loads the adapter at `path` as catalog entry `index`; whether all
        of them could (they agree on it, so no rank keeps what another could not load)."""
        def send() -> None:
            self.channel.send_header(LORA_LOAD)
            dist.broadcast_object_list([(index, name, path)], src=0)
        self._broadcast(send)
        return self.run(lambda: agree(True, self.info.host_group))

    def tier_call(self, kind: int, load: int = 0, names: list[str] | None = None,
                  pages: list[int] | None = None) -> None:
        """The other ranks store `pages` (TIER_STORE) or start loading them (TIER_LOAD, as
        load number `load`) in their tiers, under `names`."""
        def send() -> None:
            self.channel.send_header(TIER, kind, load)
            dist.broadcast_object_list([(names, pages)], src=0, group=self.info.host_group)
        self._broadcast(send)

    def tier_settle(self, load: int, loaded: int) -> int:
        """How many pages of load `load` every rank loaded (`loaded`: rank 0's count); the
        other ranks wait for their load first."""
        self._broadcast(lambda: self.channel.send_header(TIER, TIER_SETTLE, load, loaded))
        return self.run(lambda: settle_count(loaded, self.info.host_group))

    def cpu_kernel_everywhere(self, here: bool) -> bool:
        """Whether every rank runs the CPU forward kernel (`here`: whether rank 0 can);
        called right after `start`, as the workers build theirs. One that cannot (no
        compiler on its host) makes every rank run the eager path: the two reduce
        differently, so the ranks must agree."""
        return self.run(lambda: agree(here, self._everyone))

    def hidden_for_logits(self, hidden: torch.Tensor, command: int = LOGITS) -> None:
        """Stage 0's other ranks score the same rows (each holds a shard of the head)."""
        if self.tp_size > 1:  # (sequence-parallel ranks hold the whole head: rank 0 scores)
            self._broadcast(lambda: self.channel.send_hidden(hidden, command))

    def heartbeat(self, interval: float) -> None:
        """Keep idle workers' pending receive from timing out."""
        if self.error is None and time.monotonic() - self._last_message >= interval:
            try:
                self._broadcast(lambda: self._send_header(HEARTBEAT))
            except RuntimeError as exc:
                log.error("tensor parallelism: %s", exc)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank. `graceful=False` (startup failed, the ranks may be anywhere in
        their startup): kill the workers rather than tell them. Stragglers are killed."""
        stopped = False
        if graceful and self.error is None:
            try:
                self._broadcast(lambda: self._send_header(STOP))
                stopped = True
            except RuntimeError:
                pass
        # Told to stop, workers exit on their own; a broken group's may be stuck in a
        # collective until its timeout: kill those at once.
        deadline = time.monotonic() + 10
        for proc in self.workers.values() if stopped else ():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill_workers()
        destroy_group()
        if self._placement is not None:
            from radixlm.runtime.parallel import ray_workers

            ray_workers.release(self._placement)
            self._placement = None
        if self._threads is not None:
            torch.set_num_threads(self._threads)

    def run(self, call: Any) -> Any:
        """Rank 0's part of a call the other ranks run too. If it fails, the ranks are out of
        step (or one is lost): the group is broken from then on."""
        try:
            return call()
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> NoReturn:
        # A peer's dropped connection can be seen before its exit is: give a dying rank a
        # moment, to name it in the error.
        deadline = time.monotonic() + 1.0
        while True:
            try:
                self._check_alive()
            except RuntimeError as lost:
                raise RuntimeError(f"{lost}; the step failed: {exc}") from exc
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.error = f"tensor-parallel step failed: {exc}"
        raise RuntimeError(self.error) from exc

    def _broadcast(self, send: Any) -> None:
        self._check_alive()
        try:
            send()
        except Exception as exc:
            self._fail(exc)
        self._last_message = time.monotonic()

    def _check_alive(self) -> None:
        if self.error is None:
            for rank, proc in self.workers.items():
                code = proc.poll()
                if code is not None:
                    self.error = f"tensor-parallel rank {rank} exited (code {code})"
                    break
        if self.error is not None:
            raise RuntimeError(self.error)

    def _kill_workers(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class ShardedModel:
    """Rank 0's stand-in for its model shard: each forward and logits call is first sent to
    the other ranks, which run the same call on their shards (the collectives inside the
    layers then pair up)."""

    def __init__(self, model: Any, group: TensorParallelGroup) -> None:
        self.model = model
        self.group = group
        self.config = model.config

    def __call__(self, batch: ForwardBatch, attn: Any) -> torch.Tensor | PendingHidden:
        """The hidden states to score; with pipeline stages after this one, the pending
        output of the last."""
        if self.group.sp_size > 1:
            def compute(rows: ForwardBatch, exchange: KVExchange | None) -> torch.Tensor:
                attn.plan(rows)
                return self.model(rows, attn if exchange is None
                                  else ExchangingAttention(attn, exchange))
            return self.group.sequence_step(batch, compute)
        self.group.forward(batch)
        hidden = self.group.run(lambda: self.model(batch, attn))
        return hidden if self.group.pipe is None else self.group.hand_on(hidden)

    def use_batch_invariant(self, enabled: bool) -> None:
        """Rank 0's shard (the other ranks set theirs from the config at start)."""
        self.model.use_batch_invariant(enabled)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.hidden_for_logits(hidden)
        return self.group.run(lambda: self.model.compute_logits(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.hidden_for_logits(hidden, GREEDY)
        return self.group.run(lambda: self.model.greedy_tokens(hidden))


class ShardedKernel:
    """Rank 0's CPU forward kernel (execution.cpu_decode) over its shard: each step is
    first sent to the other ranks, whose kernels run it over theirs (their reduces pair up
    with rank 0's)."""

    def __init__(self, kernel: Any, group: TensorParallelGroup) -> None:
        self.kernel = kernel
        self.group = group

    @property
    def lora(self) -> Any:
        return self.kernel.lora

    @lora.setter
    def lora(self, slots: Any) -> None:
        self.kernel.lora = slots

    def forward(self, batch: ForwardBatch) -> torch.Tensor | PendingHidden:
        if self.group.sp_size > 1:
            return self.group.sequence_step(
                batch, lambda rows, exchange: self.kernel.forward(rows, stored=exchange))
        self.group.forward(batch)
        hidden = self.group.run(lambda: self.kernel.forward(batch))
        return hidden if self.group.pipe is None else self.group.hand_on(hidden)


def _resolved(config: EngineConfig) -> EngineConfig:
    """The config with the model as a folder, so workers never race to convert or download
    the same model."""
    if config.load_format == "dummy" and config.model in ARCHITECTURE_PRESETS:
        return config
    return dataclasses.replace(config, model=str(resolve_model(config.model, config.revision)))


def _check_sizes(config: EngineConfig, shape: ModelConfig) -> None:
    split_layers(shape.num_layers, config.pp_size)
    valid = valid_tp_sizes(shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    if config.tp_size not in valid:
        raise ValueError(f"tp_size {config.tp_size} does not split this model ({shape.num_heads} "
                         f"attention heads, {shape.num_kv_heads} KV heads, "
                         f"{shape.intermediate_size} MLP columns); sizes that do: "
                         f"{', '.join(map(str, valid))}")


def _launch_worker(rank: int, env: dict[str, str]) -> subprocess.Popen:
    worker_env = dict(os.environ, **env, RANK=str(rank), LOCAL_RANK=str(rank),
                      **{PARENT_ENV: str(os.getpid())})
    return subprocess.Popen([sys.executable, "-m", "radixlm.runtime.parallel.worker"],
                            env=worker_env, stdin=subprocess.DEVNULL)
