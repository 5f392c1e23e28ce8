"""Which quantization a model runs with: detected from `config.json`, or asked for by the user.

A checkpoint declares its format in `quantization_config` (written by AutoAWQ, AutoGPTQ /
GPTQModel, llm-compressor's FP8 export, or our `radixlm quantize`). The user may also force a
method with `quantization=...`. Two rules:

- a forced method must agree with what the checkpoint declares (or the checkpoint declares
  nothing and the method can quantize float weights after loading: fp8, int8);
- anything we cannot run exactly as its writer meant (a kernel-specific layout, per-module
  overrides) fails here, naming the field, instead of loading into a model that silently
  computes something else.

A block-wise FP8 checkpoint (`weight_block_size`) has no block-scaled kernel here: the loader
dequantizes its weights into float ones (block_fp8.py), so it resolves like a float
checkpoint: no QuantConfig, or fp8 / int8 requantizing those weights per channel on load.

A GGUF file (converted by `gguf_loader`) declares "gguf": its blocks run packed through torch's
CPU int4 kernel where that kernel runs (`gguf_packable`: CPU, bfloat16 activations, one
process), and are dequantized into float weights everywhere else, or with quantization="none".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.models.quantization.block_fp8 import block_fp8_format

QUANTIZATION_METHODS = ("fp8", "int8", "awq", "gptq", "gguf")
# What the user may ask for (EngineConfig's list): a method, or "none" for float weights.
QUANTIZATIONS = (*QUANTIZATION_METHODS, "none")
# Methods that can quantize a float checkpoint on load, and those that need packed tensors.
ONLINE_METHODS = ("fp8", "int8")
# The linears we quantize, by their checkpoint names (lm_head and embeddings stay float).
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")


@dataclass(frozen=True)
class QuantConfig:
    method: str  # one of QUANTIZATION_METHODS
    bits: int = 8
    # Input channels sharing one scale (and zero point); -1: one group spans the whole input.
    group_size: int = -1
    zero_point: bool = True  # asymmetric grid (a zero point per group); False: symmetric
    desc_act: bool = False  # gptq: columns quantized in activation order (g_idx permutes)
    # True: the checkpoint holds quantized tensors; False: float weights quantized on load.
    prequantized: bool = False
    # gptq "gptq" (v1) stores each zero point minus one; "gptq_v2" stores it as is.
    checkpoint_format: str = "gptq"

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}; "
                             f"got {self.method!r}")

    def group_for(self, in_features: int) -> int:
        """The group size for a linear with this many input channels."""
        return in_features if self.group_size in (-1, 0) else self.group_size


def resolve_quant_config(forced: str | None, hf_config: dict[str, Any],
                         dummy: bool = False, gguf_packable: bool = False
                         ) -> QuantConfig | None:
    """The quantization to load a model with, from the user's `quantization` option and the
    model's config.json. `dummy`: random weights (load_format="dummy"), so awq/gptq may be
    asked for without a checkpoint: their packed tensors are random RTN-quantized weights.
    `gguf_packable`: this run can use GGUF blocks packed (CPU, bfloat16, tp_size 1)."""
    if forced is not None and forced not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; "
                         f"got {forced!r}")
    declared = hf_config.get("quantization_config")
    method = (str(declared.get("quant_method", "")).lower() if isinstance(declared, dict)
              else None)
    if method == "gguf":
        return _resolve_gguf(forced, gguf_packable)
    if block_fp8_format(declared) is not None:
        return _resolve_block_fp8(forced, declared)
    if forced == "none":
        if declared is not None:
            raise ValueError(f"quantization='none': this checkpoint holds {method} tensors, "
                             "which are not dequantized on load; use a float checkpoint")
        return None
    if forced == "gguf":
        raise ValueError("quantization='gguf' needs a GGUF model (a .gguf file)")
    if declared is None:
        if forced is None:
            return None
        if forced in ONLINE_METHODS:
            return QuantConfig(forced, bits=8)
        if dummy:
            return QuantConfig(forced, bits=4, group_size=128, zero_point=forced == "awq",
                               prequantized=True)
        raise ValueError(
            f"quantization={forced!r} needs a {forced.upper()} checkpoint (config.json with "
            f"quantization_config.quant_method = {forced!r}); this model has no "
            f"quantization_config. Quantize it first: radixlm quantize --method {forced} ...")
    if not isinstance(declared, dict):
        raise ValueError("config.json quantization_config must be an object")
    parse = {"awq": _parse_awq, "gptq": _parse_gptq, "fp8": _parse_fp8,
             "compressed-tensors": _parse_compressed_tensors}.get(method)
    if parse is None:
        raise ValueError(f"unsupported config.json quantization_config.quant_method {method!r}; "
                         f"supported: awq, gptq, fp8, compressed-tensors (FP8)")
    config = parse(declared)
    if forced is not None and forced != config.method:
        raise ValueError(f"quantization={forced!r} conflicts with the checkpoint: config.json "
                         f"quantization_config.quant_method is {method!r}")
    return config


def _resolve_gguf(forced: str | None, packable: bool) -> QuantConfig | None:
    """A GGUF model: packed blocks where the kernel runs, float weights elsewhere; int8/fp8
    quantize the dequantized weights on load like any float checkpoint."""
    if forced in (None, "gguf") and packable:
        return QuantConfig("gguf", bits=4, group_size=32, prequantized=True)
    if forced == "gguf":
        raise ValueError("quantization='gguf' runs GGUF blocks with torch's CPU int4 kernel: "
                         "it needs device cpu, dtype bfloat16 and tp_size 1 (elsewhere the "
                         "blocks are dequantized: leave quantization unset)")
    if forced in ONLINE_METHODS:
        return QuantConfig(forced, bits=8)
    if forced in (None, "none"):
        return None
    raise ValueError(f"quantization={forced!r} conflicts with the checkpoint: a GGUF model "
                     f"holds GGUF blocks")


def _resolve_block_fp8(forced: str | None, declared: dict[str, Any]) -> QuantConfig | None:
    """Block-wise FP8: the loader dequantizes the weights (block_fp8.py), so the model is a
    float one; fp8 and int8 requantize its decoder linears per channel on load, which would
    also quantize the ones the checkpoint keeps in float: such a list is refused then."""
    if forced in (None, "none"):
        return None
    if forced not in ONLINE_METHODS:
        raise ValueError(f"quantization={forced!r} conflicts with the checkpoint: config.json "
                         "quantization_config declares block-wise FP8 (weight_block_size), "
                         "whose weights load as float; only fp8 and int8 can requantize them")
    for field in ("modules_to_not_convert", "ignored_layers"):
        kept = [str(m) for m in declared.get(field) or () if _names_decoder_linear(str(m))]
        if kept:
            raise ValueError(
                f"quantization={forced!r} would requantize every decoder linear of this "
                f"block-wise FP8 checkpoint, but quantization_config.{field} keeps {kept[0]!r} "
                "in float; leave quantization unset to run the checkpoint dequantized")
    return QuantConfig(forced, bits=8)


def _parse_awq(qc: dict[str, Any]) -> QuantConfig:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4:
        raise ValueError(f"quantization_config.bits = {bits}: AWQ checkpoints are 4-bit")
    if version != "gemm":
        raise ValueError(f"quantization_config.version = {version!r}: only the AWQ GEMM layout "
                         "is supported (gemv, marlin and exllama layouts pack differently)")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point = false: AWQ GEMM checkpoints "
                         "without zero points are not supported")
    _check_not_converted(qc.get("modules_to_not_convert"), "modules_to_not_convert")
    return QuantConfig("awq", bits=4, group_size=group, zero_point=True, prequantized=True)


def _parse_gptq(qc: dict[str, Any]) -> QuantConfig:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits = {bits}: GPTQ 4- and 8-bit are supported")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format = {fmt!r}: only 'gptq' and "
                         "'gptq_v2' are supported (marlin, bitblas... pack differently)")
    if qc.get("dynamic"):
        raise ValueError("quantization_config.dynamic: per-module GPTQ overrides are not "
                         "supported")
    if qc.get("lm_head"):
        raise ValueError("quantization_config.lm_head = true: a quantized lm_head is not "
                         "supported (we keep it in float)")
    _check_not_converted(qc.get("modules_to_not_convert"), "modules_to_not_convert")
    return QuantConfig("gptq", bits=bits, group_size=int(qc.get("group_size", 128)),
                       zero_point=not qc.get("sym", True), desc_act=bool(qc.get("desc_act")),
                       prequantized=True, checkpoint_format=fmt)


def _parse_fp8(qc: dict[str, Any]) -> QuantConfig:
    """Per-tensor or per-channel `weight_scale` (block-wise ones resolve before this)."""
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme = {scheme!r}: expected "
                         "'dynamic' or 'static'")
    _check_not_converted(qc.get("ignored_layers"), "ignored_layers")
    return QuantConfig("fp8", bits=8, prequantized=True)


# MoE routers (`mlp.gate`, `block_sparse_moe.gate`, `shared_expert_gate`): float in our models
# whatever the checkpoint, so a list may name them.
_FLOAT_ROUTER = re.compile(r"(^|\.)(gate|shared_expert_gate)$")


def _parse_compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    """llm-compressor's FP8 exports ("float-quantized"): e4m3 weights with a per-channel or
    per-tensor `weight_scale` and FP8 activations, the layout of quant_method fp8. Anything
    else that format describes (integer packing, groups, blocks, weight-only FP8) is refused."""
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config.format = {fmt!r}: of compressed-tensors, only "
                         "'float-quantized' (FP8) checkpoints are supported")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quantization_config.config_groups is empty")
    for group in groups:
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        want = {"type": "float", "num_bits": 8, "symmetric": True}
        if any(weights.get(k) != v for k, v in want.items()) or weights.get(
                "strategy") not in ("channel", "tensor") or weights.get("block_structure"):
            raise ValueError(f"quantization_config.config_groups weights = {weights}: only "
                             "8-bit float weights scaled per channel or per tensor are "
                             "supported (not groups or blocks)")
        if not inputs or inputs.get("type") != "float" or inputs.get("num_bits") != 8:
            raise ValueError(f"quantization_config.config_groups input_activations = {inputs}:"
                             " only FP8 activations (W8A8) are supported; weight-only FP8 "
                             "would run with quantized activations here")
        if group.get("output_activations"):
            raise ValueError("quantization_config.config_groups output_activations: not "
                             "supported")
    _check_not_converted(qc.get("ignore"), "ignore")
    return QuantConfig("fp8", bits=8, prequantized=True)


# One name of each decoder linear we quantize: a "re:" pattern of an ignore list must match
# none of them.
_LINEAR_PROBES = tuple(f"model.layers.0.{name}" for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.experts.0.gate_proj",
    "mlp.experts.0.up_proj", "mlp.experts.0.down_proj", "mlp.shared_expert.gate_proj",
    "block_sparse_moe.experts.0.w1", "block_sparse_moe.experts.0.w2",
    "block_sparse_moe.experts.0.w3"))


def _check_not_converted(modules: Any, field: str) -> None:
    """Checkpoints may keep some modules in float. We run every decoder linear quantized, so
    only lists that name none of them (e.g. ["lm_head"], MoE routers) can be honoured."""
    for name in map(str, modules or ()):
        if not _names_decoder_linear(name):
            continue
        if name.startswith("re:"):
            raise ValueError(f"quantization_config.{field} lists {name!r}, which matches "
                             "decoder linears: checkpoints that keep some of them in float "
                             "are not supported")
        raise ValueError(f"quantization_config.{field} lists {name!r}: checkpoints that "
                         "keep some decoder linears in float are not supported")


def _names_decoder_linear(name: str) -> bool:
    """Whether a not-converted entry (a module name, or a "re:" pattern) covers any decoder
    linear we quantize; routers do not count (they are float in our models anyway)."""
    if name.startswith("re:"):
        pattern = re.compile(name[3:])
        return any(pattern.match(probe) for probe in _LINEAR_PROBES)
    if _FLOAT_ROUTER.search(name):
        return False
    return any(part in name for part in ("layers", "self_attn", "mlp", *QUANTIZED_LINEARS))
