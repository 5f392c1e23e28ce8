"""A LoRA adapter in PEFT's format (or llama.cpp's GGUF, gguf_adapter.py), read and checked
against the model it will run on.

A PEFT adapter is a folder with `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`,
`target_modules`, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]). Each
module is mapped onto our layers with the model's own checkpoint routing (`CausalLM.route`):
q_proj lands in part "q" of the fused qkv_proj, gate_proj in part 0 of gate_up_proj, and so on,
so every family whose checkpoint loads loads its adapters the same way.

The product a module adds is B @ (A @ x) * scaling, scaling = lora_alpha / r (lora_alpha /
sqrt(r) with rslora); the scaling is folded into B here. Everything an adapter may hold that
we do not run (DoRA, bias terms, modules_to_save, embedding or output-head targets) is refused
with a ValueError naming the field, never silently dropped: its outputs would be wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open

from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.lora.gguf_adapter import read_gguf_adapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# base_model.model.<module>.lora_A.weight, or with the adapter's name before .weight as some
# exports keep it (lora_A.default.weight).
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])"
                     r"(?:\.[A-Za-z0-9_-]+)?\.weight$")
# Module names whose LoRA we run: the decoder's projections.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "qkv_proj", "gate_up_proj")
# Adapter options that change what the model computes in ways we do not run: refused when set.
_UNSUPPORTED = {
    "use_dora": "DoRA adapters are not supported",
    "lora_bias": "LoRA bias terms are not supported",
    "modules_to_save": "fully trained modules (e.g. embeddings or the head) are not supported",
    "fan_in_fan_out": "transposed (Conv1D) weights are not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "trainable_token_indices": "trained token embeddings are not supported",
    "layer_replication": "replicated layers are not supported",
    "target_parameters": "LoRA on parameters (e.g. MoE experts) is not supported",
    "use_qalora": "QALoRA adapters are not supported",
}
# An adapter larger than this is refused before it is read (a few GB at most for 70B models).
MAX_ADAPTER_BYTES = 8 << 30


@dataclass(frozen=True)
class LoRAPart:
    """One module's low-rank update inside one of our linears: output rows [row_start,
    row_start + B.shape[0]) of the linear's part `part` get B @ (A @ x)."""

    part: int
    row_start: int
    a: torch.Tensor  # [r, in], the file's dtype
    b: torch.Tensor  # [rows, r], the scaling folded in


@dataclass(eq=False)
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest rank of its modules
    # What KV computed under it is filed under: the hash of its files, so the same adapter
    # finds its cached prefixes again (after a reload, or a restart with the disk tier) and a
    # different one under a reused name never does.
    digest: str
    # {linear module name: its parts}
    modules: dict[str, list[LoRAPart]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for parts in self.modules.values() for p in parts)


def load_adapter(name: str, path: str | Path, model: torch.nn.Module) -> LoRAAdapter:
    """Read the LoRA adapter at `path` for `model` (a CausalLM): a PEFT folder, or a GGUF
    adapter file of llama.cpp's; ValueError naming the field or tensor when it cannot run on
    it."""
    source = Path(path)
    if source.suffix == ".gguf" and source.is_file():
        config = {}
        if source.stat().st_size > MAX_ADAPTER_BYTES:
            raise ValueError(f"lora {name!r}: {source.name} is larger than "
                             f"{MAX_ADAPTER_BYTES >> 30} GiB")
        pairs, alpha = read_gguf_adapter(name, source, model.config.num_heads,
                                         model.config.num_kv_heads)
        digest = hashlib.blake2b(source.read_bytes(), digest_size=16).hexdigest()

        def scaling(module_name: str, rank: int) -> float:
            return alpha / rank if alpha else 1.0  # llama.cpp's rule
    else:
        config, pairs, digest = _read_peft(name, source)

        def scaling(module_name: str, rank: int) -> float:
            return _scaling(config, module_name, rank)
    if not pairs:
        raise ValueError(f"lora {name!r}: {source.name} holds no LoRA weights")
    adapter = LoRAAdapter(name=name, path=str(source), rank=0, digest=digest)
    modules = dict(model.named_modules())
    for module_name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora {name!r}: module {module_name!r} has lora_"
                             f"{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ValueError(f"lora {name!r}: {module_name}: lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)} are not [r, in] and [out, r]")
        b = b * scaling(module_name, rank)
        for part_module, part_b in _parts_to_place(module_name, b, model, modules, name):
            _add_module(adapter, name, part_module, a, part_b, model, modules, config)
        adapter.rank = max(adapter.rank, rank)
    return adapter


def targeted_linears(model: Any, targets: Sequence[str]) -> set[str]:
    """Our decoder linears (module names) that adapters of these PEFT module names may train:
    "q_proj" names every layer's fused qkv_proj, "all" every supported module. ValueError
    naming lora_target_modules for a name we do not run."""
    unknown = [t for t in targets if t != "all" and t not in SUPPORTED_TARGETS]
    if unknown:
        raise ValueError(f"lora_target_modules: {unknown} are not supported (supported: "
                         f"{', '.join(SUPPORTED_TARGETS)}, or all)")
    wanted = SUPPORTED_TARGETS if "all" in targets else tuple(targets)
    chosen = set()
    for name, module in model.named_modules():
        if not (isinstance(module, Linear) and adaptable(name)):
            continue
        parent, _, leaf = name.rpartition(".")
        # PEFT names a projection beside our fused layer (self_attn.q_proj for
        # self_attn.qkv_proj); the checkpoint routing says which of ours it lands in.
        if any(leaf == t or next(iter(model.route(f"{parent}.{t}.weight", None)),
                                 (None,))[0] == f"{name}.weight" for t in wanted):
            chosen.add(name)
    return chosen


def adaptable(module_name: str) -> bool:
    """The decoder layers' linears (not the MoE experts, embeddings or head)."""
    return ".layers." in module_name and ".experts" not in module_name


def _parts_to_place(module_name: str, b: torch.Tensor, model: Any,
                    modules: dict[str, torch.nn.Module], name: str
                    ) -> list[tuple[str, torch.Tensor]]:
    """The module as it is, or, for a module trained on a fused layer (Phi-3's `qkv_proj`)
    whose parts this tensor-parallel rank holds shares of, one module per part (each with
    A whole and its rows of B), so each is cut as that part's weights are."""
    target, part = _our_linear(name, module_name, model, modules)
    linear = modules[target]
    fused_parts = getattr(model, "fused_parts", None)
    if (part is not None or len(linear.output_sizes) == 1 or linear.shard is None
            or linear.shard.part_starts is None or fused_parts is None):
        return [(module_name, b)]
    parts = fused_parts(module_name + ".weight", b.shape[0])
    if parts is None or parts[-1][1] + parts[-1][2] != b.shape[0]:
        return [(module_name, b)]  # the shape check names the mismatch
    return [(part_name.removesuffix(".weight"), b[start:start + rows])
            for part_name, start, rows in parts]


def _add_module(adapter: LoRAAdapter, name: str, module_name: str, a: torch.Tensor,
                b: torch.Tensor, model: Any, modules: dict[str, torch.nn.Module],
                config: dict[str, Any]) -> None:
    """Place one module's A and B (scaling folded in) on our linear, as this rank's share."""
    target, part = _our_linear(name, module_name, model, modules)
    linear = modules[target]
    a, b = _my_share(name, module_name, linear, part, a, b)
    rows = linear.offsets[part + 1] - linear.offsets[part] if part is not None \
        else linear.out_features
    if a.shape[1] != linear.in_features or b.shape[0] != rows:
        raise ValueError(
            f"lora {name!r}: {module_name} maps {a.shape[1]} inputs to {b.shape[0]} "
            f"outputs, the model's layer {linear.in_features} to {rows}: the adapter was "
            f"trained for another base model "
            f"(base_model_name_or_path: {config.get('base_model_name_or_path')!r})")
    # Kept in the file's dtype (a bfloat16 adapter takes half the host memory of float32).
    dtype = a.dtype if a.is_floating_point() else torch.float32
    row_start = linear.offsets[part] if part is not None else 0
    adapter.modules.setdefault(target, []).append(
        LoRAPart(part=part or 0, row_start=row_start, a=a.to(dtype).contiguous(),
                 b=b.to(dtype).contiguous()))


def _read_peft(name: str, folder: Path
               ) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]], str]:
    """(adapter_config.json, {module: {"A", "B"}}, digest of the files) of a PEFT folder."""
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise ValueError(f"lora {name!r}: no {CONFIG_FILE} in {str(folder)!r} (a PEFT LoRA "
                         "adapter folder, or a GGUF adapter file, is expected)")
    if not weights_path.is_file():
        hint = " (adapter_model.bin is not read: save with safe_serialization)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise ValueError(f"lora {name!r}: no {WEIGHTS_FILE} in {str(folder)!r}{hint}")
    if weights_path.stat().st_size > MAX_ADAPTER_BYTES:
        raise ValueError(f"lora {name!r}: {WEIGHTS_FILE} is larger than "
                         f"{MAX_ADAPTER_BYTES >> 30} GiB")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"lora {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora {name!r}: {CONFIG_FILE} must hold a JSON object")
    _check_config(name, config)
    digest = hashlib.blake2b(config_path.read_bytes() + weights_path.read_bytes(),
                             digest_size=16).hexdigest()
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            match = _TENSOR.match(key)
            if match is None:
                raise ValueError(f"lora {name!r}: tensor {key!r} is not a LoRA A or B weight "
                                 "(embedding LoRA, bias and DoRA magnitudes are not supported)")
            pairs.setdefault(match["module"], {})[match["which"]] = f.get_tensor(key)
    return config, pairs, digest


def _my_share(name: str, module_name: str, linear: Linear, part: int | None,
              a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B for this tensor-parallel rank's share of the layer, as its weights are split:
    a column-parallel layer holds some output rows of each part (B's rows; A whole), a
    row-parallel one some input columns (A's columns, whose update is then a partial sum
    all-reduced with the layer's; B whole)."""
    shard = linear.shard
    if shard is None:
        return a, b
    if shard.in_start is not None:
        if a.shape[1] < shard.in_start + linear.in_features:
            return a, b  # the shape check names the mismatch
        return a[:, shard.in_start:shard.in_start + linear.in_features], b
    if part is None and len(linear.output_sizes) > 1:
        raise ValueError(f"lora {name!r}: {module_name} spans the parts of a fused layer, "
                         "which is not supported with tensor parallelism")
    p = part or 0
    first, rows = shard.part_starts[p], linear.output_sizes[p]
    if b.shape[0] < first + rows:
        return a, b
    return a, b[first:first + rows]


def _check_config(name: str, config: dict[str, Any]) -> None:
    def refuse(field_name: str, why: str) -> None:
        raise ValueError(f"lora {name!r}: {CONFIG_FILE} {field_name}: {why}")

    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        refuse("peft_type", f"{peft_type!r} is not a LoRA adapter")
    if config.get("bias", "none") != "none":
        refuse("bias", "adapters that train biases are not supported; use bias='none'")
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            refuse(key, why)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS]
        if unknown:
            refuse("target_modules", f"{unknown} are not supported (supported: "
                                     f"{', '.join(SUPPORTED_TARGETS)})")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            refuse(key, f"must be a positive number, got {value!r}")


def _our_linear(name: str, module_name: str, model: Any,
                modules: dict[str, torch.nn.Module]) -> tuple[str, int | None]:
    """(our linear's module name, its part index or None for all of it) for a PEFT module."""
    if module_name.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS:
        raise ValueError(f"lora {name!r}: module {module_name!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_TARGETS)})")
    routed = list(model.route(module_name + ".weight", None))
    target, shard = routed[0][0].rpartition(".")[0], routed[0][1]
    linear = modules.get(target)
    if not isinstance(linear, Linear):
        raise ValueError(f"lora {name!r}: module {module_name!r} is not a layer of this model "
                         "(an adapter for another architecture or more layers?)")
    if shard is None:
        return target, None
    return target, linear.shard_names.index(shard)


def _scaling(config: dict[str, Any], module_name: str, rank: int) -> float:
    """lora_alpha / r (or / sqrt(r) with use_rslora), with per-module alphas from
    alpha_pattern (PEFT matches a pattern against the module name's end)."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module_name):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
