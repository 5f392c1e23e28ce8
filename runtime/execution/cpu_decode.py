"""Forward steps on the CPU in one C++ call (radixlm/kernels/cpu_decode.cpp): the CPU's
counterpart of CUDA graphs, and what makes the CPU path deterministic.

At batch 1 on a small model a decode step is ~40 tensor ops per layer, most of them a few
microseconds of work behind several microseconds of Python dispatch; the kernel runs the whole
layer stack in C++. It runs every step of a model it covers (decode, prefill chunks,
speculative verification, prompt logprobs), each token row by the same code whatever the rest
of the step holds, so that a request's tokens and logprobs are the same bit for bit whatever
its batch, chunking, cache hits or speculation (docs/deterministic.md). Models and settings it
does not cover (`unsupported`) run the eager path, without that guarantee. The engine turns it
off with `disable_cpu_kernel`.

With tensor parallelism every rank runs the kernel over its shard, and the row-parallel
layers' partial sums go through the `reduce` it is given between layers: a sum in a fixed
order of ranks (distributed.groups.ordered_all_reduce), so that for one TP size a row's
result still does not depend on the rest of the step.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Callable

import torch

from radixlm.kernels import cpu_decode as cpu_decode_kernel
from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.models.causal_lm import CausalLM
from radixlm.runtime.models.gemma import GemmaForCausalLM
from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.layers.mlp import ACTIVATIONS as MLP_ACTIVATIONS
from radixlm.runtime.models.layers.norm import OffsetRMSNorm, RMSNorm
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.moe import MoEForCausalLM, SparseMoeBlock
from radixlm.runtime.models.quantization import host_memory
from radixlm.runtime.models.quantization.cpu_weights import CpuWeights
from radixlm.runtime.models.quantization.gguf_experts import StackedLinear, dense_stack

log = logging.getLogger(__name__)

ACTIVATIONS = (torch.bfloat16, torch.float32)
# A tensor-parallel rank's sum over the ranks of a row-parallel layer's partial outputs.
Reduce = Callable[[torch.Tensor], torch.Tensor]


def unsupported(model: torch.nn.Module, attn: AttentionBackend, kv_cache: KVCache,
                reduce: Reduce | None = None) -> str | None:
    """Why the kernel cannot run this model (None when it can)."""
    # Phi-3's loads differently and runs as Llama; Gemma 2 and 3 have their own flags.
    if not isinstance(model, (LlamaForCausalLM, GemmaForCausalLM, MoEForCausalLM)):
        return (f"{type(model).__name__} is neither a Llama-family decoder, a mixture of "
                f"experts of one, nor Gemma")
    if not isinstance(attn, TorchNativeAttention):
        return "the attention backend is not torch"
    dtype = model.model.embed_tokens.weight.dtype
    if (kv_cache.k.device.type != "cpu" or dtype not in ACTIVATIONS
            or kv_cache.k.dtype != dtype):
        return "the model and its KV cache are not both bfloat16 or both float32 on the CPU"
    cfg = model.config
    if cfg.mlp_bias:
        return "MLP biases are not covered"
    if model.tp is not None and reduce is None:
        return "tensor parallelism needs the ranks' reduce"
    if cfg.num_heads // cfg.num_kv_heads > 64:
        return "more than 64 query heads per KV head"
    if len({layer.self_attn.attends.scale for layer in model.model.layers}) > 1 or len(
            {layer.self_attn.attends.logit_softcap for layer in model.model.layers}) > 1:
        return "the layers' attention scales or soft caps differ"
    if _activation(model.model.layers[0]) not in ("silu", "gelu_pytorch_tanh"):
        return "the MLP's activation is neither SiLU nor GELU (tanh)"
    if not all(_coverable(linear, dtype) for layer in model.model.layers
               for linear in _linears(layer) + _routers(layer) if linear is not None):
        return "a linear layer is neither float nor in the CPU kernel's tiles (cpu_weights)"
    blocks = [b for b in map(_sparse, model.model.layers) if b is not None]
    if any(b.experts.gguf is None and b.experts.quant is not None for b in blocks):
        return "the experts are quantized (fp8 or int8)"
    return None


def load_kernel() -> ModuleType | None:
    """The compiled kernel (built on first use, then cached); None where it cannot build."""
    return cpu_decode_kernel.load()


def build(model: torch.nn.Module, attn: AttentionBackend, kv_cache: KVCache,
          reduce: Reduce | None = None) -> CpuDecode | None:
    """The kernel for this model (a tensor-parallel rank's shard with `reduce`), when it
    covers the model and builds here; None otherwise (the eager path runs)."""
    reason = unsupported(model, attn, kv_cache, reduce)
    if reason is None:
        kernel = load_kernel()
        if kernel is not None:
            return CpuDecode(model, kv_cache, kernel, reduce)
        reason = "it did not build"
    log.debug("CPU decode kernel off: %s", reason)
    return None


class CpuDecode:
    def __init__(self, model: CausalLM, kv_cache: KVCache, kernel: ModuleType,
                 reduce: Reduce | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kernel = kernel
        self.reduce = reduce
        cfg = model.config
        dtype = model.model.embed_tokens.weight.dtype
        first = model.model.layers[0]
        attention = first.self_attn  # this rank's heads
        attends = attention.attends
        self.shape = (kv_cache.page_size, attention.num_heads, attention.num_kv_heads,
                      cfg.head_dim, cfg.rms_norm_eps,
                      cfg.head_dim ** -0.5 if attends.scale is None else attends.scale,
                      attends.logit_softcap or 0.0, _activation(first) == "gelu_pytorch_tanh")
        self.layers, self.specs, self.widths = [], [], []
        self.experts: list[list[torch.Tensor]] = []  # per layer; empty for a dense one
        self.expert_specs: list[list[int]] = []
        self.windows = [layer.self_attn.attends.sliding_window or 0
                        for layer in model.model.layers]
        none = torch.empty(0, dtype=dtype)
        for layer in model.model.layers:
            attention = layer.self_attn
            qkv = attention.qkv_proj
            tensors = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm),
                       none if qkv.bias is None else qkv.bias]
            tensors += ([none, none] if attention.q_norm is None
                        else [_norm(attention.q_norm), _norm(attention.k_norm)])
            tensors += ([_norm(layer.pre_feedforward_layernorm),
                         _norm(layer.post_feedforward_layernorm)]
                        if hasattr(layer, "pre_feedforward_layernorm") else [none, none])
            for linear in _linears(layer):
                planes, width, stored = (-1, 0, []) if linear is None else _tiled(linear, dtype)
                self.specs.append(planes)
                self.widths.append(width)
                tensors.extend(stored)
            self.layers.append(tensors)
            experts, spec = _sparse_args(_sparse(layer), dtype)
            self.experts.append(experts)
            self.expert_specs.append(spec)
        self.final_norm = _norm(model.model.norm) if cfg.last_stage else none
        if cfg.first_stage:  # later pipeline stages do not score
            _tile_head(model, dtype)
        host_memory.return_freed_heap()  # the eager copies of what was tiled here
        self.lora = None  # the adapters' slots (models.lora.slots.LoRASlots), when served
        self._lora_tensors: list[torch.Tensor] | None = None
        self._no_lora: tuple[list[torch.Tensor], torch.Tensor] = ([], torch.empty(0,
                                                                       dtype=torch.int64))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                stored: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, d], of any step. A pipeline stage starts
        from the previous stage's `hidden` and, unless it is the last, returns the residual
        stream (as CausalLM.forward does). `stored`: called with each layer's index once the
        step's K and V are in the cache, before attention (sequence parallelism's
        exchange)."""
        model, kv = self.model, self.kv_cache
        page = kv.page_size
        if hidden is None:
            hidden = model.embed(batch.input_ids)
        cos, sin = model.rotary.cos[batch.positions], model.rotary.sin[batch.positions]
        local = getattr(model, "local_rotary", model.rotary)  # Gemma 3's windowed layers
        local_cos, local_sin = ((cos, sin) if local is model.rotary
                                else (local.cos[batch.positions], local.sin[batch.positions]))
        width = -(-int(max(batch.kv_lens)) // page) * page
        pages = (batch.slot_table[:, :width:page] // page).contiguous()  # [S, P]
        token_seq = torch.repeat_interleave(torch.arange(len(batch.q_lens)),
                                            torch.tensor(batch.q_lens))
        return self.kernel.forward(hidden, cos, sin, local_cos, local_sin, self.layers,
                                   self.specs, self.widths,
                                   self.windows, kv.k, kv.v, batch.out_slots, token_seq,
                                   batch.positions, pages, self.final_norm, *self.shape,
                                   *self._adapters(), self.experts, self.expert_specs,
                                   self.reduce, stored)

    def _adapters(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The kernel's LoRA arguments for this step: A, B and the part columns of each
        layer's four linears, then the slots' ranks; and each row's slot; none when no row of
        the step has an adapter."""
        step = None if self.lora is None else self.lora.step
        if step is None:
            return self._no_lora
        if self._lora_tensors is None:  # the slots' tensors never move: listed once
            names = {id(module): name for name, module in self.model.named_modules()}
            linears = self.lora.linears
            none = [torch.empty(0)] * 3  # a linear without adapters (an MoE's shared expert)
            self._lora_tensors = [
                t for layer in self.model.model.layers for linear in _linears(layer)
                for slot in (None if linear is None else linears.get(names[id(linear)]),)
                for t in (none if slot is None else (slot.a, slot.b, slot.part_cols))
            ] + [self.lora.ranks]
        return self._lora_tensors, step.token_slots


def _norm(norm: RMSNorm) -> torch.Tensor:
    """A norm's weight as the kernel reads it: Gemma's as (1 + w) in float32."""
    if isinstance(norm, OffsetRMSNorm):
        return (1.0 + norm.weight.detach().float()).contiguous()
    return norm.weight


def _activation(layer: torch.nn.Module) -> str:
    """The name of the MLP's activation (Llama's MLP is always SiLU)."""
    act = getattr(layer.mlp, "act", None)
    if act is None:
        return "silu"
    return next((name for name, fn in MLP_ACTIVATIONS.items() if fn is act), repr(act))


def _linears(layer: torch.nn.Module) -> list[Linear | None]:
    """A layer's four linears in the kernel's order: qkv, o, gate_up, down (a sparse
    layer's shared expert's, None without one)."""
    mlp = layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        mlp = mlp.shared_expert
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj,
            None if mlp is None else mlp.gate_up_proj, None if mlp is None else mlp.down_proj]


def _sparse(layer: torch.nn.Module) -> SparseMoeBlock | None:
    return layer.mlp if isinstance(layer.mlp, SparseMoeBlock) else None


def _routers(layer: torch.nn.Module) -> list[Linear]:
    """A sparse layer's router, and its shared expert's gate where it has one."""
    block = _sparse(layer)
    if block is None:
        return []
    return [block.gate] + ([] if block.shared_expert_gate is None
                           else [block.shared_expert_gate])


def _sparse_args(block: SparseMoeBlock | None,
                 dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]]:
    """A sparse layer's tensors and specs as the kernel reads them (sparse_mlp in
    cpu_decode.cpp): the router, the experts' stacked gate_up and down, the shared expert's
    gate; nothing for a dense layer. Float experts are tiled here once and their eager
    copies released, as `_tiled` does for a float linear."""
    if block is None:
        return [], []
    experts = block.experts
    if experts.gguf is not None:
        stacks = experts.gguf.linears
    else:
        if not hasattr(experts, "cpu_stacks"):
            float32 = dtype == torch.float32
            experts.cpu_stacks = {"gate_up": dense_stack(experts.w13.detach(), float32),
                                  "down": dense_stack(experts.w2.detach(), float32)}
            for name in ("w13", "w2"):
                setattr(experts, name, torch.nn.Parameter(torch.empty(0, dtype=dtype),
                                                          requires_grad=False))
        stacks = experts.cpu_stacks
    tensors: list[torch.Tensor] = []
    spec = [experts.num_experts, block.top_k, int(block.renormalize)]
    parts: list[tuple[int, int, list[torch.Tensor]] | StackedLinear] = [
        _tiled(block.gate, dtype), stacks["gate_up"], stacks["down"]]
    if block.shared_expert_gate is not None:
        parts.append(_tiled(block.shared_expert_gate, dtype))
    for segments, width, stored in parts:
        spec += [segments, width]
        tensors += stored
    if block.shared_expert_gate is None:
        spec += [-1, 0]
    return tensors, spec


def _coverable(linear: Linear, dtype: torch.dtype) -> bool:
    if linear.quant_method is None:
        return hasattr(linear, "cpu_tiles") or linear.weight.dtype == dtype
    cpu = dict(linear.named_children()).get("cpu_weights")
    return isinstance(cpu, CpuWeights) and cpu.kernel_form() is not None


def _tiled(linear: Linear, dtype: torch.dtype) -> tuple[int, int, list[torch.Tensor]]:
    """(planes, N, tensors) as the kernel reads a linear (one `_coverable`): a quantized
    linear's tiles (quantization.cpu_weights), or a float weight of the model's dtype, tiled
    here once."""
    if linear.quant_method is None:
        if not hasattr(linear, "cpu_tiles"):
            linear.cpu_tiles = CpuWeights(dense=linear.weight.detach(),
                                          float32=dtype == torch.float32)
            # The kernel runs every step of this model from now on: the eager layout's copy
            # of the weights would only double the model's memory.
            linear.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        return linear.cpu_tiles.kernel_form()
    return dict(linear.named_children())["cpu_weights"].kernel_form()


def _tile_head(model: CausalLM, dtype: torch.dtype) -> None:
    """Give a float output head the kernel's tiles too: torch's float32 GEMM sums in an order
    that depends on the number of rows."""
    head = model._head()  # with tensor parallelism, this rank's shard of the vocabulary
    if head.packed_logits is None:
        head.packed_logits = CpuWeights(dense=head.weight.detach(),
                                        float32=dtype == torch.float32)
