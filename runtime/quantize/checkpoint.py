"""Writing a quantized model as a standard Hugging Face folder in the AWQ or GPTQ format.

The folder holds config.json (the source model's, with a `quantization_config` as AutoAWQ or
AutoGPTQ write it), model.safetensors with the public tensor names and layouts (packing.py),
and the source folder's tokenizer files. Our fused qkv / gate_up linears are written back as the
separate q/k/v and gate/up projections that every reader expects. Embeddings, norms and the
output head are written in float16 (the dtype these formats pair with), scales too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.quantization.packing import pack_awq, pack_gptq_weight, pack_gptq_zeros
from radixlm.runtime.quantize.model_quantizer import QuantizedLinear, QuantizeOptions

FORMATS = ("awq", "gptq")
# Our fused linear -> the checkpoint linears of its parts, in part order.
PART_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template",
                   "generation_config", "added_tokens")


def save_quantized(model: nn.Module, results: dict[str, QuantizedLinear],
                   options: QuantizeOptions, fmt: str, source: Path | None, out: Path,
                   dtype: torch.dtype = torch.float16) -> Path:
    """Write `model` (float parts) and `results` (its quantized linears) to folder `out`."""
    from safetensors.torch import save_file

    _check_format(fmt, options, results)
    v1 = not any(bool((r.weight.zeros == 0).any()) for r in results.values())
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        result = results.get(module_name)
        for name, param in module.named_parameters(recurse=False):
            if result is not None and name == "weight":
                continue  # written packed, below
            for part_name, rows in _parts(module_name, module):
                tensors[f"{part_name}.{name}"] = param.data[rows].to(dtype).contiguous()
        if result is None:
            continue
        for part_name, rows in _parts(module_name, module):
            q, scales, zeros = (t[rows] for t in result.weight)  # [n, K], [n, G], [n, G]
            if fmt == "awq":
                tensors[f"{part_name}.qweight"] = pack_awq(q.t())
                tensors[f"{part_name}.qzeros"] = pack_awq(zeros.t())
            else:
                tensors[f"{part_name}.qweight"] = pack_gptq_weight(q.t(), options.bits)
                tensors[f"{part_name}.qzeros"] = pack_gptq_zeros(zeros.t(), options.bits, v1)
                g_idx = result.g_idx
                if g_idx is None:
                    g_idx = torch.arange(q.shape[1], device=q.device) // _group(options, q)
                tensors[f"{part_name}.g_idx"] = g_idx.to(torch.int32).clone()
            tensors[f"{part_name}.scales"] = scales.t().to(torch.float16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    save_file({k: v.cpu() for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it owner-only
    config = dict(model.config.raw)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config["quantization_config"] = _quantization_config(fmt, options, v1)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source is not None:
        for f in source.iterdir():
            if f.is_file() and f.name.startswith(TOKENIZER_FILES):
                shutil.copy(f, out / f.name)
    return out


def _parts(module_name: str, module: nn.Module) -> list[tuple[str, slice]]:
    """The checkpoint names of a module's parts and their output rows: one for most modules,
    q/k/v or gate/up for our fused linears."""
    prefix, _, last = module_name.rpartition(".")
    if isinstance(module, Linear) and last in PART_NAMES:
        return [(f"{prefix}.{part}", slice(module.offsets[i], module.offsets[i + 1]))
                for i, part in enumerate(PART_NAMES[last])]
    return [(module_name, slice(None))]


def _group(options: QuantizeOptions, q: torch.Tensor) -> int:
    return q.shape[1] if options.group_size <= 0 else options.group_size


def _check_format(fmt: str, options: QuantizeOptions,
                  results: dict[str, QuantizedLinear]) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "awq":
        if options.bits != 4:
            raise ValueError("the AWQ format holds 4-bit weights only; use --format gptq")
        if any(r.g_idx is not None for r in results.values()):
            raise ValueError("act-order (desc_act) needs g_idx, which only the GPTQ format has")


def _quantization_config(fmt: str, options: QuantizeOptions, v1: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": options.group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None,
                "quantizer": f"radixlm-{options.method}"}
    # v1 ("gptq") cannot store a zero point of 0 (it stores zero - 1): then write v2.
    return {"quant_method": "gptq", "bits": options.bits, "group_size": options.group_size,
            "desc_act": options.desc_act, "sym": options.sym, "damp_percent": options.damp,
            "true_sequential": False, "static_groups": False, "lm_head": False,
            "checkpoint_format": "gptq" if v1 else "gptq_v2",
            "quantizer": f"radixlm-{options.method}"}
