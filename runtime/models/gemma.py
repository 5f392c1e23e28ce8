"""Gemma 2 and Gemma 3 (text): Llama-style decoders with these differences.

- Embeddings are scaled by sqrt(hidden_size) (rounded to the activation dtype first).
- Every norm is (1 + w)-RMSNorm, and each sublayer is wrapped in two of them: a pre-norm on
  its input and a post-norm on its output before the residual add (four per layer).
- The MLP gate is GELU (tanh approximation).
- Attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- Local layers attend within a sliding window, global layers to everything; which is which
  comes from `layer_types` (or the family's pattern: Gemma 2 alternates, Gemma 3 has five
  local layers per global one; ModelConfig.layer_windows).
- Gemma 2 soft-caps attention scores (attn_logit_softcapping) and the final logits
  (final_logit_softcapping): x -> cap * tanh(x / cap).
- Gemma 3 adds (1 + w)-RMSNorm over each q and k head, and rotates local layers with their own
  theta (rope_local_base_freq, unscaled) while global layers keep rope_theta and its scaling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch, LayerAttention
from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.causal_lm import CausalLM
from radixlm.runtime.models.layers.embedding import VocabEmbedding
from radixlm.runtime.models.layers.mlp import GatedMLP
from radixlm.runtime.models.layers.norm import OffsetRMSNorm
from radixlm.runtime.models.layers.rotary import RotaryEmbedding
from radixlm.runtime.models.layers.self_attention import SelfAttention
from radixlm.runtime.models.quantization.quant_config import QuantConfig


@dataclass(frozen=True)
class GemmaConfig:
    query_pre_attn_scalar: float
    attn_softcap: float | None
    final_softcap: float | None
    local_rope_theta: float  # the local layers' theta (Gemma 2: the same as the global one)
    local_rope_scaling: dict[str, Any] | None

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "GemmaConfig":
        raw = cfg.raw
        gemma3 = cfg.architecture == "Gemma3ForCausalLM"
        local_theta, local_scaling = cfg.rope_theta, cfg.rope_scaling
        if gemma3:
            local = (raw.get("rope_parameters") or {}).get("sliding_attention")
            if isinstance(local, dict):  # rope_parameters keyed by layer type
                local_theta = local.get("rope_theta", 10000.0)
                kind = local.get("rope_type", local.get("type", "default"))
                local_scaling = None if kind == "default" else local
            else:  # older spelling: the local layers are unscaled
                local_theta, local_scaling = raw.get("rope_local_base_freq", 10000.0), None
        return cls(
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar") or cfg.head_dim,
            # Gemma 3's attention ignores attn_logit_softcapping, as the reference does.
            attn_softcap=None if gemma3 else raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
        )


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, gemma: GemmaConfig, layer_id: int, dtype: torch.dtype,
                 quant: QuantConfig | None, tp: TPInfo | None) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        assert cfg.layer_windows is not None  # Gemma's registry entry applies windows
        self.window = cfg.layer_windows[layer_id]
        attends = LayerAttention(scale=gemma.query_pre_attn_scalar ** -0.5,
                                 sliding_window=self.window, logit_softcap=gemma.attn_softcap)
        self.input_layernorm = OffsetRMSNorm(d, eps, dtype)
        self.self_attn = SelfAttention(cfg, layer_id, dtype, attends, norm=OffsetRMSNorm,
                                       quant=quant, tp=tp)
        self.post_attention_layernorm = OffsetRMSNorm(d, eps, dtype)
        self.pre_feedforward_layernorm = OffsetRMSNorm(d, eps, dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, cfg.hidden_act, dtype, quant=quant, tp=tp)
        self.post_feedforward_layernorm = OffsetRMSNorm(d, eps, dtype)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(hidden), rope, batch, attn)
        hidden = hidden + self.post_attention_layernorm(out)
        out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(out)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, gemma: GemmaConfig, dtype: torch.dtype,
                 quant: QuantConfig | None, tp: TPInfo | None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, gemma, i, dtype, quant, tp)
                                    for i in cfg.held_layers)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class GemmaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__(cfg, quant, tp)
        self.gemma = GemmaConfig.from_model_config(cfg)
        self.model = GemmaModel(cfg, self.gemma, dtype, quant, self.tp)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, self.tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling)
        local = (self.gemma.local_rope_theta, self.gemma.local_rope_scaling)
        self.local_rotary = (self.rotary if local == (cfg.rope_theta, cfg.rope_scaling) else
                             RotaryEmbedding(cfg.head_dim, max_positions, *local))

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            hidden = self.embed(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, hidden.dtype)
        local_rope = (rope if self.local_rotary is self.rotary
                      else self.local_rotary.cos_sin(batch.positions, hidden.dtype))
        for layer in self.model.layers:
            hidden = layer(hidden, local_rope if layer.window is not None else rope, batch,
                           attn)
        return self.model.norm(hidden) if self.config.last_stage else hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # sqrt(d) is rounded to the activation dtype before the multiply, as in the reference.
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.gemma.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
