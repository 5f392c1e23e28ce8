"""Model architecture description, read from a Hugging Face `config.json`.

We parse the JSON ourselves rather than through `transformers.AutoConfig` so that older and newer
spellings (`rope_scaling` vs `rope_parameters`) both work and unsupported features fail loudly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixlm.runtime.models.architecture.families import FAMILIES

# Architecture name in config.json -> its family (the class and the switches read below).
SUPPORTED_ARCHITECTURES = FAMILIES
# rope_parameters keyed by layer type (Gemma 3): the global layers' entry is the model's rope.
_GLOBAL_ROPE = "full_attention"
# Bounds on the sizes a config may state: well above every public model (the largest have
# ~130 layers, 128 heads, a 16k hidden size, 262k-token vocabularies, 10M positions), far
# below what would exhaust memory by the count alone (a billion layers built one by one).
SIZE_LIMITS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
}
# Sizes with a default (derived from the others, or 4096 positions).
_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# Mixture-of-experts sizes, checked where a config states them (0: no experts).
MOE_LIMITS = {
    "num_local_experts": 4096,
    "num_experts": 4096,
    "num_experts_per_tok": 4096,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
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
    # Per layer, the window it attends within (None: full attention), for families that apply
    # windows; None for those that do not (their configured window caps the sequence length).
    layer_windows: tuple[int | None, ...] | None = None
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Pipeline parallelism: the [first, end) layers this process holds (a stage); None: all.
    layer_range: tuple[int, int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def held_layers(self) -> range:
        """The layers this process builds and keeps KV for (global indices)."""
        return range(*(self.layer_range or (0, self.num_layers)))

    @property
    def first_stage(self) -> bool:
        """Whether this process embeds the tokens and holds the output head."""
        return self.held_layers.start == 0

    @property
    def last_stage(self) -> bool:
        """Whether this process applies the final norm."""
        return self.held_layers.stop == self.num_layers

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.activations[0]
        if act not in family.activations:
            raise ValueError(f"unsupported hidden_act {act!r} for {arch}; supported: "
                             f"{', '.join(family.activations)}")
        check_fields(cfg)
        num_heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope.get(_GLOBAL_ROPE), dict):
            rope = rope[_GLOBAL_ROPE]
        rope_scaling = cfg.get("rope_scaling") or rope or None
        kind = rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind == "default":
            rope_scaling = None
        elif kind in ("longrope", "su"):  # Phi-3 keeps these two beside rope_scaling
            rope_scaling = {
                "original_max_position_embeddings": cfg.get("original_max_position_embeddings"),
                "max_position_embeddings": cfg.get("max_position_embeddings"), **rope_scaling}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Mistral/Qwen configs carry a sliding window that is only active when enabled.
        window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            window = None
        window = window or None  # some configs write 0 for none
        layer_windows = None
        if family.sliding_layers is not None:
            types = cfg.get("layer_types")
            if types and (not isinstance(types, list) or len(types) != cfg["num_hidden_layers"]):
                raise ValueError(f"layer_types must list one type per layer "
                                 f"({cfg['num_hidden_layers']}, num_hidden_layers), got "
                                 f"{len(types) if isinstance(types, list) else repr(types)}")
            sliding = ([t == "sliding_attention" for t in types] if types else
                       [family.sliding_layers(i, cfg) for i in range(cfg["num_hidden_layers"])])
            layer_windows = tuple(window if s else None for s in sliding)
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
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family.qk_norm,
            rope_scaling=rope_scaling,
            sliding_window=window,
            layer_windows=layer_windows,
            hidden_act=act,
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


def check_fields(cfg: dict[str, Any]) -> None:
    """Refuse sizes that are missing, not positive integers, beyond SIZE_LIMITS or
    inconsistent with each other, naming the config.json field: a bad value must fail here,
    not as a ZeroDivisionError or an allocation that exhausts memory."""
    for name, limit in SIZE_LIMITS.items():
        if name in _OPTIONAL and cfg.get(name) is None:
            continue
        if name not in cfg:
            raise ValueError(f"config.json lacks {name}")
        _check_int(name, cfg[name], 1, limit)
    for name, limit in MOE_LIMITS.items():
        if cfg.get(name) is not None:
            _check_int(name, cfg[name], 0, limit)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or 0
    head_dim = cfg.get("head_dim")
    if head_dim is None and cfg["hidden_size"] % heads:
        raise ValueError(f"hidden_size ({cfg['hidden_size']}) does not split into "
                         f"num_attention_heads ({heads}) heads, and there is no head_dim")
    if (head_dim or cfg["hidden_size"] // heads) % 2:
        raise ValueError(f"head_dim ({head_dim or cfg['hidden_size'] // heads}) must be even "
                         f"(rotary embeddings rotate pairs of channels)")
    if kv_heads and heads % kv_heads:
        raise ValueError(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                         f"({heads})")
    for name in ("rms_norm_eps", "rope_theta"):
        value = cfg.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    window = cfg.get("sliding_window")
    if window:  # None and 0 both mean no window
        _check_int("sliding_window", window, 1, 1 << 31)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r} "
                         f"(config.json)")
