"""One Llama-style decoder covering Llama 2/3/3.1, Mistral, Qwen2/2.5 and Qwen3.

The families differ only in switches on `ModelConfig`: QKV bias (Qwen2), per-head q/k RMSNorm
(Qwen3), rope scaling (Llama 3.1) and tied embeddings. The forward takes one flat ragged batch
of tokens ([T]) and returns hidden states ([T, d]); logits are computed only where needed.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.attention.base import AttentionBackend, ForwardBatch
from radixlm.runtime.layers.embedding import VocabEmbedding
from radixlm.runtime.layers.linear import Linear, MergedLinear, QKVLinear
from radixlm.runtime.layers.norm import RMSNorm
from radixlm.runtime.layers.rotary import RotaryEmbedding, apply_rotary
from radixlm.runtime.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                  bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                             bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # q and k sit side by side: rotate them in one go.
        q, k = apply_rotary(qk, *rope).split([heads, kv_heads], dim=1)
        out = attn.forward(q, k, v, self.layer_id, batch)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                         bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, batch, attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


# Checkpoint name fragment -> (our fused parameter fragment, shard id).
_FUSED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else VocabEmbedding(
            cfg.vocab_size, cfg.hidden_size, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                      cfg.rope_scaling)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden_size]."""
        hidden = self.model.embed_tokens(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, rope, batch, attn)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, vocab] float32 logits."""
        weight = (self.model.embed_tokens.weight if self.lm_head is None
                  else self.lm_head.weight)
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names) through each owning layer's
        weight_loader; return the keys that were set (see `expected_weight_keys`)."""
        owned = self._parameters_with_owner()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            target, shard = name, None
            for fragment, (fused, shard_id) in _FUSED.items():
                if fragment in name:
                    target, shard = name.replace(fragment, fused), shard_id
                    break
            if target not in owned:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            module, param = owned[target]
            module.weight_loader(param, tensor, shard)
            loaded.add(target if shard is None else f"{target}:{shard}")
        return loaded

    def expected_weight_keys(self) -> set[str]:
        """Every key a complete checkpoint sets: fused parameters once per shard."""
        keys = set()
        for name, (module, _) in self._parameters_with_owner().items():
            if isinstance(module, MergedLinear):
                keys.update(f"{name}:{shard}" for shard in module.shard_names)
            else:
                keys.add(name)
        return keys

    def _parameters_with_owner(self) -> dict[str, tuple[nn.Module, nn.Parameter]]:
        return {f"{module_name}.{name}": (module, param)
                for module_name, module in self.named_modules()
                for name, param in module.named_parameters(recurse=False)}
