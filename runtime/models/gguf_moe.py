"""The mixture-of-experts part of converting a GGUF file: Mixtral (llama.cpp's "llama" with
`expert_count` > 0), Qwen2-MoE ("qwen2moe") and Qwen3-MoE ("qwen3moe"), read into the config
fields and checkpoint names of their transformers models (which models/moe.py loads).

llama.cpp stacks a layer's experts, one slice per expert (shapes as numpy reads them):

    blk.N.ffn_gate_exps [E, I, d]  -> experts.<e>.gate_proj  (Mixtral: w1)  [I, d] each
    blk.N.ffn_up_exps   [E, I, d]  -> experts.<e>.up_proj    (Mixtral: w3)  [I, d] each
    blk.N.ffn_down_exps [E, d, I]  -> experts.<e>.down_proj  (Mixtral: w2)  [d, I] each
    blk.N.ffn_gate_inp  [E, d]     -> the router, mlp.gate   (Mixtral: block_sparse_moe.gate)

and Qwen2-MoE's shared expert as a dense MLP (ffn_{gate,up,down}_shexp) scaled by the sigmoid
of ffn_gate_inp_shexp [d] (transformers: mlp.shared_expert_gate [1, d]). Experts of the block
types our CPU kernel runs keep their blocks, one [rows, bytes] slice per expert (the loader
decides per run whether they run packed, quantization/gguf_experts.py, or are dequantized);
the routers are always converted to float32.

Metadata ({arch}.*) -> config.json:

    expert_count                       num_local_experts (Mixtral) / num_experts (Qwen)
    expert_used_count                  num_experts_per_tok
    expert_feed_forward_length         Mixtral's intermediate_size / Qwen's moe_intermediate_size
                                       (absent: the expert tensors' shape)
    expert_shared_feed_forward_length  shared_expert_intermediate_size (absent: the tensors')
    expert_weights_norm                norm_topk_prob (absent: what llama.cpp hard-codes for the
                                       architecture: Mixtral and Qwen3-MoE yes, Qwen2-MoE no)

GGUF has no key for decoder_sparse_step or mlp_only_layers; the tensors say it instead: a layer
with a router is sparse, one with ffn_gate/ffn_up/ffn_down is dense, written as mlp_only_layers
(decoder_sparse_step 1). Refused because our models cannot run them as the file means:
an `expert_gating_func` other than softmax, an `expert_weights_scale` other than 1, a Mixtral
with dense layers or without renormalised weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["EXPERT_TENSORS", "FLOAT_TENSORS", "MIXTRAL", "MOE_TYPES", "expected_shapes",
           "hf_layout", "layer_tensors", "moe_config"]

# The HF class of llama.cpp's "llama" architecture when the file has experts.
MIXTRAL = ("MixtralForCausalLM", "mixtral")

_ROUTER = "ffn_gate_inp"
_SHARED_GATE = "ffn_gate_inp_shexp"
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    _SHARED_GATE: "mlp.shared_expert_gate",
}
EXPERT_TENSORS = frozenset(_EXPERTS)  # stacked [E, rows, columns]
# Converted to float32 whatever their GGUF type: the routers (our models keep them in float:
# a rounding there changes which experts run).
FLOAT_TENSORS = frozenset((_ROUTER, _SHARED_GATE))


@dataclass(frozen=True)
class _Family:
    block: str  # the sparse block's module under model.layers.N
    projections: tuple[str, str, str]  # an expert's gate, up, down in the HF checkpoint
    renormalize: bool  # llama.cpp's top-k weight normalisation for the architecture
    shared_expert: bool


# HF model_type -> how its checkpoint names and routes the experts.
_FAMILIES = {
    "mixtral": _Family("block_sparse_moe", ("w1", "w3", "w2"), True, False),
    "qwen2_moe": _Family("mlp", ("gate_proj", "up_proj", "down_proj"), False, True),
    "qwen3_moe": _Family("mlp", ("gate_proj", "up_proj", "down_proj"), True, False),
}
MOE_TYPES = frozenset(_FAMILIES)


def layer_tensors(model_type: str) -> dict[str, str]:
    """GGUF base name -> HF module under model.layers.N, for the MoE tensors of this family
    ({} for a dense one). Stacked experts name one module per expert: "{expert}" in it."""
    family = _FAMILIES.get(model_type)
    if family is None:
        return {}
    names = {_ROUTER: f"{family.block}.gate"}
    names.update({base: f"{family.block}.experts.{{expert}}.{projection}"
                  for base, projection in zip(_EXPERTS, family.projections)})
    if family.shared_expert:
        names.update(_SHARED_EXPERT)
    return names


def moe_config(model_type: str, meta: Callable[..., Any], shapes: dict[str, list[int]],
               num_layers: int) -> dict[str, Any]:
    """The config.json fields of the experts. `meta(key, default)` reads {arch}.key; `shapes`
    holds every tensor's GGUF dimensions (innermost first)."""
    family = _FAMILIES[model_type]
    experts, top_k = int(meta("expert_count", 0) or 0), int(meta("expert_used_count", 0) or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"{model_type} GGUF: expert_count {experts} and expert_used_count "
                         f"{top_k} do not describe a mixture of experts")
    _check_routing(meta)
    sparse = [i for i in range(num_layers) if f"blk.{i}.{_ROUTER}.weight" in shapes]
    dense = [i for i in range(num_layers) if i not in sparse]
    if not sparse:
        raise ValueError(f"{model_type} GGUF: expert_count {experts}, but no layer has a "
                         f"router ({_ROUTER})")
    first = f"blk.{sparse[0]}"
    expert_size = meta("expert_feed_forward_length") or _dim(shapes, f"{first}.ffn_up_exps", 1)
    norm = meta("expert_weights_norm")
    renormalize = family.renormalize if norm is None else bool(norm)
    config: dict[str, Any] = {"num_experts_per_tok": top_k}
    if model_type == "mixtral":
        if dense or not renormalize:
            raise ValueError("Mixtral GGUF (llama with experts): "
                             + (f"layers {dense} have no experts" if dense else
                                "expert_weights_norm is false") + "; MixtralForCausalLM routes "
                             "every layer through renormalised top-k experts")
        return config | {"num_local_experts": experts, "intermediate_size": int(expert_size)}
    config |= {"num_experts": experts, "moe_intermediate_size": int(expert_size),
               "norm_topk_prob": renormalize, "decoder_sparse_step": 1,
               "mlp_only_layers": dense}
    if family.shared_expert:
        shared = meta("expert_shared_feed_forward_length")
        if shared is None and f"{first}.ffn_up_shexp.weight" in shapes:
            shared = _dim(shapes, f"{first}.ffn_up_shexp", 1)
        config["shared_expert_intermediate_size"] = int(shared or 0)
    return config


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape (as numpy reads it) of each MoE tensor, from the converted config."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        return {}
    hidden = config["hidden_size"]
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared = config.get("shared_expert_intermediate_size") or 0
    return {
        _ROUTER: (experts, hidden),
        "ffn_gate_exps": (experts, size, hidden),
        "ffn_up_exps": (experts, size, hidden),
        "ffn_down_exps": (experts, hidden, size),
        "ffn_gate_shexp": (shared, hidden),
        "ffn_up_shexp": (shared, hidden),
        "ffn_down_shexp": (hidden, shared),
        _SHARED_GATE: (1, hidden),
    }


def hf_layout(base: str, data: np.ndarray) -> np.ndarray:
    """A float tensor in the layout of its HF counterpart: llama.cpp stores the shared
    expert's gate as a vector [d], transformers as a one-row linear [1, d]."""
    return data.reshape(1, -1) if base == _SHARED_GATE else data


def _check_routing(meta: Callable[..., Any]) -> None:
    from gguf import ExpertGatingFuncType

    gating = meta("expert_gating_func")
    if gating is not None and int(gating) != ExpertGatingFuncType.SOFTMAX:
        raise ValueError(f"GGUF expert_gating_func {gating}: only softmax routing (1) is "
                         "supported for these architectures")
    scale = meta("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"GGUF expert_weights_scale {scale}: routing weights scaled after the "
                         "top-k are not supported for these architectures")


def _dim(shapes: dict[str, list[int]], tensor: str, index: int) -> int:
    dims = shapes.get(f"{tensor}.weight")
    if dims is None:
        raise ValueError(f"GGUF mixture of experts without {tensor}.weight")
    return dims[index]
