"""Model architecture description, read from a Hugging Face `config.json`.

We parse the JSON ourselves rather than through `transformers.AutoConfig` so that older and newer
spellings (`rope_scaling` vs `rope_parameters`) both work and unsupported features fail loudly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architecture name in config.json -> the per-family switches of our one Llama-style model.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"attention_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        switches = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or rope or None
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Mistral/Qwen configs carry a sliding window that is only active when enabled.
        window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", switches.get("attention_bias", False))),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=switches.get("qk_norm", False),
            rope_scaling=rope_scaling,
            sliding_window=window,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        return cls.from_dict(json.loads(path.read_text()))
