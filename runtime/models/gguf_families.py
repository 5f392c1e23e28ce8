"""The Gemma 2 ("gemma2"), Gemma 3 text ("gemma3") and Phi-3 ("phi3") part of converting a GGUF
file: their config fields, tensor names and the values llama.cpp's converter changed on the way
in, read back into the checkpoints of their transformers models (models/gemma.py, phi3.py).

Gemma (both). llama.cpp's RMSNorm computes x * w where transformers' Gemma computes
x * (1 + w), so its converter stores every norm weight with 1 added (the four per layer, the
final norm and Gemma 3's q/k norms); 1 is subtracted here. The per-layer norms:

    attn_norm -> input_layernorm          post_attention_norm -> post_attention_layernorm
    ffn_norm  -> pre_feedforward_layernorm   post_ffw_norm   -> post_feedforward_layernorm

Metadata -> config.json: attention.sliding_window (required), attn_logit_softcapping and
final_logit_softcapping (Gemma 2 without them: llama.cpp's defaults 50 and 30, transformers'
too), rope.freq_base_swa (Gemma 3's local layers; absent: 10000, as llama.cpp hard-codes).
Which layers are local is llama.cpp's pattern (Gemma 2: every other layer from the first,
Gemma 3: five of six), or attention.sliding_window_pattern where the file has it; it is
written out as layer_types. GGUF has no key for query_pre_attn_scalar: llama.cpp scales
scores by head_dim ** -0.5, except for the 27B models (46 layers for Gemma 2, 62 for Gemma 3)
by (hidden / heads) ** -0.5; attention.scale, where present, overrides.

Phi-3. llama.cpp keeps transformers' fused projections: attn_qkv ([q | k | v] rows) and
ffn_up ([gate | up] rows, llama.cpp's fused SwiGLU takes the gate from the first half). The
converter cuts them into q/k/v_proj and gate/up_proj (whole rows, so block-quantized tensors
keep their blocks; models/phi3.py loads either form). LongRoPE is stored as the tensors
rope_factors_long / rope_factors_short (one factor per rotary frequency) with
rope.scaling.original_context_length and rope.scaling.attn_factor; they become rope_scaling
{"rope_type": "longrope", ...}. Refused: one set of factors without the other, partial rotary
(rope.dimension_count below head_dim, as Phi-4-mini's) and rope scalings our rotary cannot run.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["HF_CLASSES", "config_tensors", "expected_shapes", "family_config", "hf_values",
           "layer_tensors", "split_fused"]

# GGUF architecture -> (HF architectures entry, HF model_type).
HF_CLASSES = {
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
_GEMMA = ("gemma2", "gemma3")
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# llama.cpp's default local-layer pattern (set_swa_pattern) and the 27B models' layer counts.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_ROPE_LONG, _ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
# Phi-3's fused tensors -> the parts they are cut into, in row order.
_FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}


def layer_tensors(arch: str) -> dict[str, str]:
    """GGUF base name -> HF module under model.layers.N that differ from the Llama table."""
    if arch in _GEMMA:
        return dict(_GEMMA_NORMS)
    if arch == "phi3":
        return {"attn_qkv": "self_attn.qkv_proj"}  # emitted cut, by split_fused
    return {}


def config_tensors(arch: str) -> frozenset[str]:
    """Tensors of this family's files that are config, not checkpoint: read by family_config,
    not converted (any other family refuses them as unknown tensors)."""
    return frozenset((_ROPE_LONG, _ROPE_SHORT)) if arch == "phi3" else frozenset()


def family_config(arch: str, meta: Callable[..., Any], config: dict[str, Any],
                  tensors: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of this family, on top of the common ones in `config`.
    `meta(key, default)` reads {arch}.key; `tensors` maps GGUF names to the reader's tensors."""
    if arch in _GEMMA:
        return _gemma_config(arch, meta, config)
    if arch == "phi3":
        return _phi3_config(meta, config, tensors)
    return {}


def _gemma_config(arch: str, meta: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    window = meta("attention.sliding_window")
    if not window:
        raise ValueError(f"{arch} GGUF without attention.sliding_window: the local layers' "
                         "window is not known")
    layers = config["num_hidden_layers"]
    pattern = meta("attention.sliding_window_pattern", _SWA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer
        if len(pattern) != layers:
            raise ValueError(f"{arch} GGUF: attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {layers} layers")
        sliding = [bool(s) for s in pattern]
    else:  # llama.cpp's rule: within each group of n layers, all but the last are local
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    scale = meta("attention.scale")
    if scale:
        scalar = float(scale) ** -2
    elif layers == _LAYERS_27B[arch]:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    out: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "final_logit_softcapping": meta("final_logit_softcapping",
                                        30.0 if arch == "gemma2" else None),
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = meta("attn_logit_softcapping", 50.0)
    else:
        out["attn_logit_softcapping"] = None  # Gemma 3 does not soft-cap attention
        out["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
    return out


def _phi3_config(meta: Callable[..., Any], config: dict[str, Any],
                 tensors: dict[str, Any]) -> dict[str, Any]:
    import gguf

    rope_dims = meta("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config["head_dim"]:
        raise ValueError(f"phi3 GGUF with rope.dimension_count {rope_dims} < head_dim "
                         f"{config['head_dim']} (partial rotary): unsupported")
    window = meta("attention.sliding_window")
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}
    present = [name for name in (_ROPE_LONG, _ROPE_SHORT) if name in tensors]
    if not present:
        rope_type = meta("rope.scaling.type")
        if rope_type not in (None, "none", "linear"):
            raise ValueError(f"phi3 GGUF with rope.scaling.type {rope_type!r} and no "
                             "rope_factors tensors: unsupported (longrope needs the factors)")
        return out
    if len(present) == 1:
        raise ValueError(f"phi3 GGUF with {present[0]} but not the other LongRoPE factors")
    original = meta("rope.scaling.original_context_length")
    if original is None:
        raise ValueError("phi3 GGUF with LongRoPE factors but no "
                         "rope.scaling.original_context_length")

    def factors(name: str) -> list[float]:
        t = tensors[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        if values.size != config["head_dim"] // 2:
            raise ValueError(f"{name}: {values.size} factors for {config['head_dim'] // 2} "
                             "rotary frequencies")
        return [float(v) for v in values]

    scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors(_ROPE_LONG),
                               "short_factor": factors(_ROPE_SHORT)}
    attn_factor = meta("rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return out | {"rope_scaling": scaling, "original_max_position_embeddings": int(original)}


def expected_shapes(arch: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape (as numpy reads it) of this family's own tensors, from the converted config."""
    hidden = config["hidden_size"]
    if arch in _GEMMA:
        return {base: (hidden,) for base in ("post_attention_norm", "post_ffw_norm")}
    if arch == "phi3":
        rows = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * config[
            "head_dim"]
        return {"attn_qkv": (rows, hidden), "ffn_up": (2 * config["intermediate_size"], hidden)}
    return {}


def hf_values(arch: str, base: str, data: np.ndarray) -> np.ndarray:
    """A float tensor with transformers' values: Gemma's norms without llama.cpp's +1."""
    if arch in _GEMMA and base.endswith("norm"):
        return data - np.float32(1.0)
    return data


def split_fused(arch: str, base: str, data: np.ndarray,
                config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(base name, rows) of each part of a Phi-3 fused tensor (float rows or rows of blocks;
    copies, as safetensors refuses tensors that share memory); any other tensor as it is."""
    if arch != "phi3" or base not in _FUSED:
        yield base, data
        return
    if base == "attn_qkv":
        q = config["num_attention_heads"] * config["head_dim"]
        kv = config["num_key_value_heads"] * config["head_dim"]
        sizes = (q, kv, kv)
    else:
        sizes = (config["intermediate_size"],) * 2
    start = 0
    for part, rows in zip(_FUSED[base], sizes):
        yield part, data[start:start + rows].copy()
        start += rows
