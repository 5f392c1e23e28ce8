"""Model families by architecture name (the `architectures` entry of config.json).

Each entry says which class builds the model and the switches `ModelConfig` reads for it. The
class is named, not imported (the loader imports it), so that reading a config never imports
every family's code. To add a family: write its module under models/, add its architectures
here (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Which layers use the sliding window when config.json has no `layer_types` list (older
# checkpoints): (layer index, config) -> sliding?
SlidingLayers = Callable[[int, dict[str, Any]], bool]


def _every_layer(i: int, cfg: dict[str, Any]) -> bool:
    return True


def _gemma2_layers(i: int, cfg: dict[str, Any]) -> bool:
    return i % 2 == 0  # local, global, local, ...


def _gemma3_layers(i: int, cfg: dict[str, Any]) -> bool:
    # Five local layers, then a global one (sliding_window_pattern = 6).
    return (i + 1) % cfg.get("sliding_window_pattern", 6) != 0


def _qwen_layers(i: int, cfg: dict[str, Any]) -> bool:
    # Qwen keeps full attention below max_window_layers, and windows only when enabled.
    return bool(cfg.get("use_sliding_window")) and i >= cfg.get("max_window_layers", 0)


@dataclass(frozen=True)
class Family:
    model: str  # "module:Class" under radixlm.runtime.models
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head (Qwen3, Gemma 3)
    activations: tuple[str, ...] = ("silu",)  # accepted hidden_act / hidden_activation
    # None: the family does not apply a sliding window (a configured one then caps the
    # sequence length, see engine/kv_sizing.py); else which layers use it.
    sliding_layers: SlidingLayers | None = None


_LLAMA = "llama:LlamaForCausalLM"
_MOE = "moe:MoEForCausalLM"
_GEMMA = "gemma:GemmaForCausalLM"
_GELU_TANH = ("gelu_pytorch_tanh",)

FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_LLAMA),
    "MistralForCausalLM": Family(_LLAMA, sliding_layers=_every_layer),
    "Qwen2ForCausalLM": Family(_LLAMA, attention_bias=True, sliding_layers=_qwen_layers),
    "Qwen3ForCausalLM": Family(_LLAMA, qk_norm=True, sliding_layers=_qwen_layers),
    "MixtralForCausalLM": Family(_MOE, sliding_layers=_every_layer),
    "Qwen2MoeForCausalLM": Family(_MOE, attention_bias=True, sliding_layers=_qwen_layers),
    "Qwen3MoeForCausalLM": Family(_MOE, qk_norm=True, sliding_layers=_qwen_layers),
    "Gemma2ForCausalLM": Family(_GEMMA, activations=_GELU_TANH, sliding_layers=_gemma2_layers),
    "Gemma3ForCausalLM": Family(_GEMMA, qk_norm=True, activations=_GELU_TANH,
                                sliding_layers=_gemma3_layers),
    # transformers' Phi-3 applies config.sliding_window (when set) on every layer.
    "Phi3ForCausalLM": Family("phi3:Phi3ForCausalLM", sliding_layers=_every_layer),
}
