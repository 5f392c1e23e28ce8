"""What every model family shares: the output head, and loading checkpoint tensors through
each owning layer's weight loader (the Llama module included).

A family subclasses `CausalLM`, builds `self.model` (with `embed_tokens`, `layers` and `norm`)
and `self.lm_head`, writes `forward`, and maps checkpoint names that differ from its parameter
names in `route` (a fused tensor to its parts, an expert's tensor to its slice of the stacked
experts). The runner only ever calls `forward`, `compute_logits` (or `greedy_tokens`) and
reads `config`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.layers.embedding import VocabEmbedding
from radixlm.runtime.models.layers.linear import Linear, MergedLinear, use_batch_invariant_linears
from radixlm.runtime.models.layers.moe import FusedMoE
from radixlm.runtime.models.layers.norm import OffsetRMSNorm, RMSNorm
from radixlm.runtime.models.quantization.quant_config import QuantConfig

# A checkpoint tensor as the loader routes it: (our parameter name, shard id, tensor).
Routed = tuple[str, Any, Any]

# Separate q/k/v and gate/up projections -> our fused layers, with the part they fill.
_FUSED_PARTS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
# One expert's projection: experts.<e>.<part>.weight, under the names two conventions use, and
# an FP8 checkpoint's weight_scale (and input_scale, read past: experts keep float inputs).
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
                     r"(weight|weight_scale|input_scale)$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}
# A float8-KV checkpoint's per-layer cache scales (vLLM's layout: self_attn.k_scale and
# v_scale, or one kv_scale for both in older exports); kept for the KV cache, not parameters.
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None,
                 tp: TPInfo | None) -> None:
        super().__init__()
        self.config = cfg
        self.quant = quant
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.fused: Any = None
        self.model: nn.Module
        self.lm_head: VocabEmbedding | None = None
        # {layer: {"k_scale": s, "v_scale": s}} from the checkpoint, if it has any
        self.checkpoint_kv_scales: dict[int, dict[str, float]] = {}
        # Deterministic inference: (hidden, weight, out dtype) -> logits through a
        # batch-invariant matmul (use_batch_invariant); None: the head's own matmul.
        self.invariant_head: Callable[..., torch.Tensor] | None = None

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden_size].

        A pipeline stage (config.layer_range) runs only its layers: from the previous
        stage's `hidden` rather than the embedded tokens (all but the first stage), and up
        to the residual stream its last layer leaves rather than the final norm (all but
        the last stage). The stream is one tensor, rounded where one process's run rounds
        it, so a split run computes the same bits."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for these tokens: [T] -> [T, hidden_size]."""
        return self.model.embed_tokens(input_ids)

    def use_fused_kernels(self, enabled: bool) -> None:
        """Switch the fused MoE kernel (CUDA) on or off; the other layers stay in torch."""
        kernel = None
        if enabled:
            from radixlm.kernels import fused_moe as kernel
        self.fused = kernel
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.kernel = kernel

    def use_batch_invariant(self, enabled: bool) -> None:
        """Deterministic inference on CUDA (EngineConfig.deterministic): the decoder's linears,
        the output head and the plain RMSNorms through kernels that compute each row the same
        way whatever the number of rows (radixlm.kernels.invariant_matmul, fused.rms_norm).
        Switch before CUDA graphs are captured; they keep the path they were captured with.
        A sharded model's all-reduces must then add the ranks' sums in a fixed order too
        (distributed.groups' "ordered" all-reduce, which deterministic mode sets up)."""
        use_batch_invariant_linears(self, enabled)
        matmul = norm = None
        if enabled:
            from radixlm.kernels.fused import rms_norm as norm
            from radixlm.kernels.invariant_matmul import invariant_matmul as matmul
        self.invariant_head = matmul
        for module in self.modules():
            if isinstance(module, RMSNorm) and not isinstance(module, OffsetRMSNorm):
                module.kernel = norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N, vocab] float32 logits (gathered from every rank's vocab shard)."""
        if self.invariant_head is not None:  # float32 out: no rounding to the weights' dtype
            return self.final_logits(self.invariant_head(hidden, self._head().weight,
                                                         torch.float32))
        return self.final_logits(self._head().logits(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, d] -> [N] int64: the argmax of `compute_logits(hidden)` (see
        VocabEmbedding.greedy: with tensor parallelism no [N, vocab] logits are gathered)."""
        if self.invariant_head is not None:
            return self.compute_logits(hidden).argmax(dim=-1)
        # a family that keeps the base class's (identity) final_logits needs no float32 copy
        plain = type(self).final_logits is CausalLM.final_logits
        return self._head().greedy(hidden, None if plain else self.final_logits)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What a family does to the head's float32 logits (Gemma caps them); elementwise, so
        it applies to a vocab shard alike."""
        return logits

    def _head(self) -> VocabEmbedding:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    # -- loading ---------------------------------------------------------------------------

    def route(self, name: str, tensor: Any) -> Iterator[Routed]:
        """Where a checkpoint tensor goes; families extend this for their own names."""
        expert = _EXPERT.search(name)
        if expert is not None:
            if expert[3] == "input_scale":
                return
            target = name[: expert.start()] + ".experts." + (
                "w2" if _EXPERT_PART[expert[2]] == "down" else "w13") + (
                "_scale" if expert[3] == "weight_scale" else "")
            yield target, (int(expert[1]), _EXPERT_PART[expert[2]]), tensor
            return
        for fragment, (fused, part) in _FUSED_PARTS.items():
            if fragment in name:
                yield name.replace(fragment, fused), part, tensor
                return
        yield name, None, tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names) through each owning layer's
        weight_loader; return the keys that were set (see `expected_weight_keys`)."""
        owned = self._parameters_with_owner()
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            scale = _KV_SCALE.match(name)
            if scale is not None:
                layer, kind = int(scale.group(1)), scale.group(2)
                value = float(torch.as_tensor(tensor[:] if hasattr(tensor, "get_shape")
                                              else tensor).float().reshape(-1)[0])
                kinds = ("k_scale", "v_scale") if kind == "kv_scale" else (kind,)
                self.checkpoint_kv_scales.setdefault(layer, {}).update(
                    dict.fromkeys(kinds, value))
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            for target, shard, part in self.route(name, tensor):
                if target not in owned:
                    module_name, _, param_name = target.rpartition(".")
                    module = modules.get(module_name)
                    if isinstance(module, Linear) and module.ignores_checkpoint_tensor(
                            param_name):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
                module, param = owned[target]
                module.weight_loader(param, part, shard)
                loaded.add(target if shard is None else f"{target}:{shard}")
        return loaded

    def kv_cache_scales(self) -> tuple[list[float], list[float]] | None:
        """Per-layer (K, V) scales for a float8 KV cache, from the checkpoint (1.0 for a
        layer it leaves out); None when it has none."""
        if not self.checkpoint_kv_scales:
            return None
        layers = range(len(self.config.held_layers))  # this stage's, as its KV cache holds
        return ([self.checkpoint_kv_scales.get(i, {}).get("k_scale", 1.0) for i in layers],
                [self.checkpoint_kv_scales.get(i, {}).get("v_scale", 1.0) for i in layers])

    def expected_weight_keys(self) -> set[str]:
        """Every key a complete checkpoint sets: fused parameters once per part."""
        keys = set()
        for name, (module, param) in self._parameters_with_owner().items():
            param_name = name.rpartition(".")[2]
            if isinstance(module, VocabEmbedding) and param.numel() == 0:
                continue  # a later pipeline stage's: it neither embeds nor scores
            if isinstance(module, Linear) and not module.required_in_checkpoint(param_name):
                continue
            if isinstance(module, MergedLinear):
                keys.update(f"{name}:{shard}" for shard in module.shard_names)
            elif isinstance(module, FusedMoE):
                keys.update(f"{name}:{shard}" for shard in module.checkpoint_shards(param_name))
            else:
                keys.add(name)
        return keys

    def _parameters_with_owner(self) -> dict[str, tuple[nn.Module, nn.Parameter]]:
        return {f"{module_name}.{name}": (module, param)
                for module_name, module in self.named_modules()
                for name, param in module.named_parameters(recurse=False)}
