"""Self-attention for the families outside the Llama module: fused QKV, optional per-head
q/k norms, rotary, and the layer's own way of attending (`LayerAttention`: scale, sliding
window, soft-cap), which it hands to the backend with every call.

The rotary tables come from the model per step, since layers of one model may rotate with
different tables (Gemma 3: one theta for local layers, another for global ones). Tensor
parallelism splits heads like the Llama attention does.
"""

from __future__ import annotations

import torch
from torch import nn

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch, LayerAttention
from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.layers.linear import Linear, LinearShard, QKVLinear
from radixlm.runtime.models.layers.norm import RMSNorm
from radixlm.runtime.models.layers.rotary import apply_rotary
from radixlm.runtime.models.quantization.quant_config import QuantConfig


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype,
                 attends: LayerAttention, norm: type[RMSNorm] = RMSNorm,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__()
        # The layer's place in this process's KV cache: with pipeline parallelism a stage
        # holds only its own layers' KV.
        self.layer_id = layer_id - cfg.held_layers.start
        self.attends = attends
        d = self.head_dim = cfg.head_dim
        qkv_shard = o_shard = None
        if tp is None:
            self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        else:
            q0, self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
            kv0, self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)
            qkv_shard = LinearShard(part_starts=(q0 * d, kv0 * d, kv0 * d))
            o_shard = LinearShard(in_start=q0 * d)
        self.qkv_proj = QKVLinear(cfg.hidden_size, d, self.num_heads, self.num_kv_heads,
                                  bias=cfg.attention_bias, dtype=dtype, quant=quant,
                                  shard=qkv_shard)
        self.o_proj = Linear(self.num_heads * d, cfg.hidden_size, bias=False, dtype=dtype,
                             quant=quant, shard=o_shard)
        self.q_norm = norm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = norm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attn.forward(q, k, v, self.layer_id, batch, self.attends)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, heads * self.head_dim))
