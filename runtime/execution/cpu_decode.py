"""Decode steps on the CPU in one C++ call (radixlm/kernels/cpu_decode.cpp): the CPU's
counterpart of CUDA graphs.

At batch 1 on a small model a decode step is ~40 tensor ops per layer, most of them a few
microseconds of work behind several microseconds of Python dispatch; the kernel runs the whole
layer stack in C++, calling torch's own matmuls (dense bfloat16, or the int4 planes of GGUF
blocks) and attention products, and does the per-row work (norms, rotary, residual adds, SiLU)
in plain loops. Steps where every sequence has one new token and no prompt logprobs come here;
every other step, and every model or setting the kernel does not cover (`unsupported`), runs
the eager path. The engine turns it off with `disable_cpu_kernel`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.quantization.cpu_weights import DENSE_ROWS, CpuWeights


def unsupported(model: torch.nn.Module, attn: AttentionBackend, kv_cache: KVCache) -> str | None:
    """Why the kernel cannot run this model (None when it can)."""
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a Llama-family decoder"
    if not isinstance(attn, TorchNativeAttention):
        return "the attention backend is not torch"
    if kv_cache.k.device.type != "cpu" or kv_cache.k.dtype != torch.bfloat16:
        return "the KV cache is not bfloat16 on the CPU"
    cfg = model.config
    if model.tp is not None or cfg.qk_norm or cfg.mlp_bias or cfg.sliding_window:
        return "tensor parallelism, q/k norms, MLP biases and sliding windows are not covered"
    if any(_stored(linear) is None for layer in model.model.layers
           for linear in _linears(layer)):
        return "a linear layer is neither bfloat16 nor repacked for the CPU (cpu_weights)"
    return None


class CpuDecode:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, kernel: ModuleType) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kernel = kernel
        cfg = model.config
        self.shape = (kv_cache.page_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.rms_norm_eps, cfg.head_dim ** -0.5)
        # (layer tensors, (planes, group) per linear) for steps of few rows, and for batched
        # steps (the linears' bfloat16 batch copies where they have them).
        self.weights = {batched: self._gather(batched) for batched in (False, True)}

    def _gather(self, batched: bool) -> tuple[list[list[torch.Tensor]], list[int]]:
        layers, specs = [], []
        no_bias = torch.empty(0, dtype=torch.bfloat16)
        for layer in self.model.model.layers:
            qkv = layer.self_attn.qkv_proj
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                       no_bias if qkv.bias is None else qkv.bias]
            for linear in _linears(layer):
                planes, group, stored = _stored(linear, batched)
                specs.extend((planes, group))
                tensors.extend(stored)
            layers.append(tensors)
        return layers, specs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm, [B, d], of a step of B one-token sequences."""
        model, kv = self.model, self.kv_cache
        page = kv.page_size
        hidden = model.model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary.cos[batch.positions], model.rotary.sin[batch.positions]
        kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int64)
        width = -(-int(max(batch.kv_lens)) // page) * page
        pages = (batch.slot_table[:, :width:page] // page).contiguous()  # [B, P]
        layers, specs = self.weights[len(batch.kv_lens) >= DENSE_ROWS]
        return self.kernel.decode(hidden, cos, sin, layers, specs, kv.k, kv.v,
                                  batch.out_slots, pages, kv_lens, model.model.norm.weight,
                                  *self.shape)


def _linears(layer: torch.nn.Module) -> list[Linear]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj]


def _stored(linear: Linear, batched: bool = False
            ) -> tuple[int, int, list[torch.Tensor]] | None:
    """(planes, group, tensors) as the kernel reads a linear: a dense bfloat16 weight, or a
    quantized linear's CPU form (quantization.cpu_weights); None for anything else."""
    if linear.quant_method is None:
        return (0, 0, [linear.weight]) if linear.weight.dtype == torch.bfloat16 else None
    cpu = dict(linear.named_children()).get("cpu_weights")
    return cpu.kernel_form(batched) if isinstance(cpu, CpuWeights) else None
