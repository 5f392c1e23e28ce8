"""What a config's weights need, and whether a checkpoint agrees with the config, known before
anything is allocated: a config that states more layers, heads or channels than its checkpoint
holds (or more parameters than memory holds) is refused naming the field, instead of building
layers until memory runs out.
"""

from __future__ import annotations

import re
from typing import Mapping

from radixlm.runtime.models.architecture.families import FAMILIES
from radixlm.runtime.models.architecture.model_config import ModelConfig

_MOE_MODEL = "moe:MoEForCausalLM"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def parameter_count(cfg: ModelConfig) -> int:
    """The model's parameters as its config states them (norms and biases left out: they are
    a rounding error): embedding, untied head, and per layer attention and MLP or experts."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    attention = hidden * head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    dense = 3 * hidden * cfg.intermediate_size
    total = cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)
    sparse_layers, sparse = _sparse_layers(cfg), 0
    if sparse_layers:
        raw = cfg.raw
        experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
        expert_size = (cfg.intermediate_size if cfg.architecture == "MixtralForCausalLM"
                       else raw.get("moe_intermediate_size") or 0)
        shared = raw.get("shared_expert_intermediate_size") or 0
        sparse = experts * (3 * hidden * expert_size + hidden) + 3 * hidden * shared
    return (total + cfg.num_layers * attention + sparse_layers * sparse
            + (cfg.num_layers - sparse_layers) * dense)


def rotary_bytes(cfg: ModelConfig, positions: int) -> int:
    """The cos/sin tables (float32, [positions, head_dim / 2] each); Gemma keeps two sets."""
    tables = 2 if cfg.architecture.startswith("Gemma") else 1
    return tables * positions * cfg.head_dim * 4


def _sparse_layers(cfg: ModelConfig) -> int:
    """How many layers are mixture-of-experts blocks (the rest are dense MLPs), as moe.py's
    MoEConfig decides it."""
    if FAMILIES[cfg.architecture].model != _MOE_MODEL:
        return 0
    raw = cfg.raw
    if cfg.architecture == "MixtralForCausalLM":
        return cfg.num_layers
    if not (raw.get("num_experts") or raw.get("num_local_experts")):
        return 0
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or ())
    return sum(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers))


def check_checkpoint_shapes(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]],
                            packed: frozenset[str] = frozenset()) -> None:
    """Refuse a config that the checkpoint's tensors (name -> shape, read from the file's
    header) contradict, naming the config field. `packed`: tensors stored as rows of
    quantized blocks, whose second dimension is bytes, not channels."""
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.search(name))}
    found = max(layers) + 1 if layers else 0
    if cfg.num_layers > found:
        raise ValueError(f"num_hidden_layers is {cfg.num_layers} in config.json, but the "
                         f"checkpoint has {found} layers"
                         + (f" (layers.0 to layers.{found - 1})" if found else ""))
    embed = shapes.get("model.embed_tokens.weight")
    if embed is not None and len(embed) == 2:
        _agree("vocab_size", cfg.vocab_size, embed[0], "model.embed_tokens.weight", embed)
        if "model.embed_tokens.weight" not in packed:
            _agree("hidden_size", cfg.hidden_size, embed[1], "model.embed_tokens.weight",
                   embed)
    rows = {
        "self_attn.q_proj": ("num_attention_heads * head_dim", cfg.num_heads * cfg.head_dim),
        "self_attn.k_proj": ("num_key_value_heads * head_dim", cfg.num_kv_heads * cfg.head_dim),
        "mlp.gate_proj": ("intermediate_size", cfg.intermediate_size),
    }
    for module, (field, want) in rows.items():
        name = f"model.layers.0.{module}.weight"
        shape = shapes.get(name)
        if shape is not None and len(shape) == 2:
            _agree(field, want, shape[0], name, shape)


def _agree(field: str, stated: int, found: int, tensor: str, shape: tuple[int, ...]) -> None:
    if stated != found:
        raise ValueError(f"{field} is {stated} in config.json, but the checkpoint's {tensor} "
                         f"has shape {list(shape)} (it holds {found})")


def check_fits(cfg: ModelConfig, bytes_per_weight: float, positions: int,
               available: int | None, where: str, shards: int = 1) -> None:
    """Refuse a model whose weights alone (a lower bound: `bytes_per_weight` is the smallest
    the run may store them in) exceed `available` bytes of `where`'s memory (None: unknown,
    not checked). With `shards` > 1 each rank holds about 1/shards of the weights."""
    if available is None:
        return
    params = parameter_count(cfg)
    need = int(params * bytes_per_weight / shards) + rotary_bytes(cfg, positions)
    if need > available:
        raise ValueError(
            f"this model needs about {_size(need)} for its weights ({params / 1e9:.3g}B "
            f"parameters of {cfg.num_layers} layers (num_hidden_layers), hidden_size "
            f"{cfg.hidden_size}, intermediate_size {cfg.intermediate_size}, vocab_size "
            f"{cfg.vocab_size}, at {bytes_per_weight:g} bytes each"
            + (f", over {shards} ranks" if shards > 1 else "")
            + f"), but {where} has {_size(available)} available")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
