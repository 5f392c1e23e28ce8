"""One Llama-style decoder covering Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3 (and Phi-3).

The families differ only in switches on `ModelConfig`: QKV bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling (Llama 3.1), tied embeddings and sliding windows (`layer_windows`: every
layer of Mistral and Phi-3 when the config has a window, Qwen's layers from max_window_layers
up when use_sliding_window is set), which each layer hands to the backend as its
`LayerAttention`. The forward takes one flat ragged batch of tokens ([T]) and returns hidden
states ([T, d]); logits are computed only where needed.

On CUDA the loader switches on our fused Triton kernels (`use_fused_kernels`): SiLU-and-mul,
in-place rotary that also writes K and V to the cache (the attention backend then skips its
store), and add + RMSNorm that carries the residual stream between layers, so each norm reads
the sublayer output and the stream once instead of an add kernel and a norm. They round where
the torch ops round, so the two paths agree to an ulp; CPU keeps the torch path.

With a QuantConfig (radixlm.runtime.models.quantization) the decoder's linears (qkv, o, gate_up,
down) are quantized; the embeddings and the output head always stay in float.

With a TPInfo of size > 1 the model is this rank's shard (Megatron-style): qkv and gate_up
are column-parallel (heads and intermediate channels split across ranks, KV heads replicated
when there are fewer than ranks), o and down row-parallel with an all-reduce, the embedding
and the output head vocab-parallel. Hidden states between layers are whole on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch, LayerAttention
from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.causal_lm import CausalLM
from radixlm.runtime.models.layers.embedding import VocabEmbedding
from radixlm.runtime.models.layers.linear import Linear, LinearShard, MergedLinear
from radixlm.runtime.models.layers.norm import RMSNorm
from radixlm.runtime.models.layers.rotary import RotaryEmbedding, apply_rotary
from radixlm.runtime.models.layers.self_attention import SelfAttention
from radixlm.runtime.models.quantization.quant_config import QuantConfig


class LlamaAttention(SelfAttention):
    """SelfAttention's layers, with the fused rotary + KV store when the fused kernels are
    on (q and k rotated side by side in one go)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        window = cfg.layer_windows[layer_id] if cfg.layer_windows else None
        super().__init__(cfg, layer_id, dtype, LayerAttention(sliding_window=window),
                         quant=quant, tp=tp)
        self.fused: Any = None  # radixlm.kernels.fused when the fused kernels are on

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # q and k sit side by side: rotate them in one go. The fused kernel rotates them in
        # place (inside qkv) and writes k and v to the KV cache in the same launch.
        stored = self.fused is not None
        if stored:
            cache = batch.kv_cache
            self.fused.rotary_and_store(qk, v, *rope, heads, *cache.layer(self.layer_id),
                                        batch.out_slots, *cache.scales(self.layer_id))
        else:
            qk = apply_rotary(qk, *rope)
        q, k = qk.split([heads, kv_heads], dim=1)
        out = attn.forward(q, k, v, self.layer_id, batch, self.attends,
                           kv_stored=stored)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__()
        start, size = 0, cfg.intermediate_size
        up_shard = down_shard = None
        if tp is not None:
            start, size = tp.split(cfg.intermediate_size, "intermediate_size")
            up_shard = LinearShard(part_starts=(start, start))
            down_shard = LinearShard(in_start=start)
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [size] * 2, bias=cfg.mlp_bias,
                                         dtype=dtype, quant=quant, shard=up_shard)
        self.down_proj = Linear(size, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype,
                                quant=quant, shard=down_shard)
        self.fused: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.down_proj(self.fused.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_id, dtype, quant, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, quant, tp)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, batch, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                      attn: AttentionBackend, fused: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the adds folded into the norms. `hidden` is the previous
        layer's MLP output and `residual` the stream it still has to be added to (None at the
        first layer, where hidden is the embeddings). Returns (MLP output, stream)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual = hidden
            x = fused.rms_norm(hidden, norm1.weight, norm1.eps)
        else:  # x = norm(hidden + residual), and the sum is the new stream
            x, residual = fused.rms_norm(hidden, norm1.weight, norm1.eps, residual=residual)
        out = self.self_attn(x, rope, batch, attn)
        x, residual = fused.rms_norm(out, norm2.weight, norm2.eps, residual=residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype, quant, tp) for i in cfg.held_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__(cfg, quant, tp)
        tp = self.tp
        self.model = LlamaModel(cfg, dtype, quant, tp)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling)

    def use_fused_kernels(self, enabled: bool) -> None:
        """Switch the Triton fused kernels (CUDA, or CPU under the Triton interpreter) on or
        off. CUDA graphs captured before a switch keep the path they were captured with."""
        fused = None
        if enabled:
            from radixlm.kernels import fused
        self.fused = fused
        for layer in self.model.layers:
            layer.self_attn.fused = layer.mlp.fused = fused

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden_size]. A pipeline stage starts from
        the previous stage's `hidden` and, unless it is the last, returns the residual stream
        its layers leave (see CausalLM.forward)."""
        if hidden is None:
            hidden = self.embed(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, hidden.dtype)
        fused = self.fused
        last = self.config.last_stage
        if fused is None:
            for layer in self.model.layers:
                hidden = layer(hidden, rope, batch, attn)
            return self.model.norm(hidden) if last else hidden
        residual = None
        for layer in self.model.layers:
            hidden, residual = layer.forward_fused(hidden, residual, rope, batch, attn, fused)
        if not last:  # the stream: the fused norm's add, rounded as it rounds
            return hidden if residual is None else hidden + residual
        norm = self.model.norm
        if residual is None:  # no layers
            return fused.rms_norm(hidden, norm.weight, norm.eps)
        return fused.rms_norm(hidden, norm.weight, norm.eps, residual=residual)[0]
