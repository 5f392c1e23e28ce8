"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

They are Llama-style decoders whose MLP is, in all or some layers, a sparse block: a router
(a linear to E logits) picks each token's top-k experts, and the token's output is the
weighted sum of those experts' gated MLPs (layers/moe.py). The families differ in switches:

    Mixtral      8 experts, top-2, weights renormalised; attention like Mistral
    Qwen2-MoE    many small experts, top-k, optional renormalisation (norm_topk_prob), plus a
                 shared expert every token goes through, scaled by sigmoid(shared_expert_gate);
                 QKV bias; dense MLP layers where decoder_sparse_step / mlp_only_layers say
    Qwen3-MoE    as Qwen2-MoE without the shared expert, with per-head q/k RMSNorm

Checkpoint names: Mixtral's `block_sparse_moe.experts.<e>.w1|w3|w2` and Qwen's
`mlp.experts.<e>.gate_proj|up_proj|down_proj` both land in our stacked experts under `mlp`.

Quantization (fp8, int8) covers the experts (quantization/experts.py: weight-only, per-channel
scales) and every other decoder linear as in the dense families; the routers stay in float.
A block-wise FP8 checkpoint loads as a float model (quantization/block_fp8.py), experts too.
A GGUF model's experts are float (dequantized by the converter); its other decoder linears
run its blocks as in the dense families.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch, LayerAttention
from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.causal_lm import CausalLM, Routed
from radixlm.runtime.models.layers.embedding import VocabEmbedding
from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.layers.mlp import GatedMLP
from radixlm.runtime.models.layers.moe import FusedMoE, route_top_k
from radixlm.runtime.models.layers.norm import RMSNorm
from radixlm.runtime.models.layers.rotary import RotaryEmbedding
from radixlm.runtime.models.layers.self_attention import SelfAttention
from radixlm.runtime.models.quantization.experts import expert_quant
from radixlm.runtime.models.quantization.quant_config import QuantConfig


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate channels
    renormalize: bool  # rescale the top-k weights to sum to one
    shared_expert_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block (else a dense MLP)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "MoEConfig":
        raw = cfg.raw
        if cfg.architecture == "MixtralForCausalLM":
            return cls(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
                       expert_size=cfg.intermediate_size, renormalize=True,
                       shared_expert_size=0, sparse_layers=(True,) * cfg.num_layers)
        num_experts = raw.get("num_experts") or raw.get("num_local_experts", 0)
        step = raw.get("decoder_sparse_step", 1) or 1
        dense = set(raw.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0
                       for i in range(cfg.num_layers))
        return cls(num_experts=num_experts, top_k=raw["num_experts_per_tok"],
                   expert_size=raw["moe_intermediate_size"],
                   renormalize=bool(raw.get("norm_topk_prob", False)),
                   shared_expert_size=raw.get("shared_expert_intermediate_size") or 0,
                   sparse_layers=sparse)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, dtype: torch.dtype,
                 quant: QuantConfig | None, tp: TPInfo | None) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        # The router is small and replicated: every rank routes every token the same way.
        # It stays in float, as checkpoints keep it: a rounding there changes the routing.
        self.gate = Linear(cfg.hidden_size, moe.num_experts, dtype=dtype)
        self.experts = FusedMoE(moe.num_experts, cfg.hidden_size, moe.expert_size, dtype, tp,
                                expert_quant(quant, cfg.architecture))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_expert_size, "silu",
                                          dtype, quant=quant, tp=tp)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_top_k(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, layer_id: int, dtype: torch.dtype,
                 quant: QuantConfig | None, tp: TPInfo | None) -> None:
        super().__init__()
        window = cfg.layer_windows[layer_id] if cfg.layer_windows else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(cfg, layer_id, dtype, LayerAttention(
            sliding_window=window), quant=quant, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: nn.Module = (
            SparseMoeBlock(cfg, moe, dtype, quant, tp) if moe.sparse_layers[layer_id] else
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", dtype, quant=quant, tp=tp))

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, batch, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class MoEModel(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: MoEConfig, dtype: torch.dtype,
                 quant: QuantConfig | None, tp: TPInfo | None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(MoEDecoderLayer(cfg, moe, i, dtype, quant, tp)
                                    for i in cfg.held_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MoEForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantConfig | None = None, tp: TPInfo | None = None) -> None:
        super().__init__(cfg, quant, tp)
        expert_quant(quant, cfg.architecture)  # refuse what experts cannot be stored in, early
        self.moe = MoEConfig.from_model_config(cfg)
        self.model = MoEModel(cfg, self.moe, dtype, quant, self.tp)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype, self.tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            hidden = self.embed(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, rope, batch, attn)
        return self.model.norm(hidden) if self.config.last_stage else hidden

    def route(self, name: str, tensor: Any) -> Iterator[Routed]:
        # Mixtral's sparse block is `block_sparse_moe`; ours is `mlp` in every family.
        return super().route(name.replace(".block_sparse_moe.", ".mlp."), tensor)
