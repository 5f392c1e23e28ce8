"""Quantizing a loaded float model, layer by layer: RTN, AWQ or GPTQ (`radixlm quantize`).

`quantize_model` returns the quantized integers of every decoder linear and leaves the model
computing with their dequantized values (AWQ's scales folded into the norms and linears), so a
forward of the model *is* the quantized model: that is what the next layer calibrates on, and
what a test can compare the written checkpoint with. checkpoint.py writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from radixlm.runtime.models.quantization.rtn import GroupQuantized, dequantize_groups, rtn_quantize
from radixlm.runtime.quantize import awq_quantizer
from radixlm.runtime.quantize.calibration import LayerwiseRunner, record_inputs
from radixlm.runtime.quantize.gptq_quantizer import accumulate_hessian, gptq_quantize

METHODS = ("rtn", "awq", "gptq")
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "awq"
    bits: int = 4
    group_size: int = 128
    sym: bool = False  # symmetric grid (no zero point)
    desc_act: bool = False  # GPTQ act-order
    damp: float = 0.01  # GPTQ dampening, relative to the Hessian's mean diagonal
    n_grid: int = 20  # AWQ scale and clip grid
    search_tokens: int = 2048  # AWQ: calibration tokens the searches evaluate on
    clip_tokens: int = 512
    micro_batch: int = 4  # calibration sequences per forward

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.desc_act and self.method != "gptq":
            raise ValueError("desc_act (act-order) is a GPTQ option")


class QuantizedLinear(NamedTuple):
    weight: GroupQuantized  # rows = the layer's output channels (all parts of a merged layer)
    g_idx: torch.Tensor | None  # GPTQ act-order: the group of each input channel


def quantize_model(model: nn.Module, calibration: torch.Tensor | None,
                   options: QuantizeOptions) -> dict[str, QuantizedLinear]:
    """Quantize every decoder linear of a float model; calibration [S, L] token ids (unused by
    RTN). Returns {module name: QuantizedLinear}, e.g. "model.layers.0.mlp.down_proj"."""
    layers = model.model.layers
    runner = None
    if options.method != "rtn":
        if calibration is None:
            raise ValueError(f"{options.method} needs calibration text")
        runner = LayerwiseRunner(model, calibration, options.micro_batch)
    results: dict[str, QuantizedLinear] = {}
    for index, layer in enumerate(tqdm(layers, desc=f"{options.method} quantize", unit="layer")):
        linears = {name: layer.get_submodule(name) for name in LINEARS}
        if options.method == "rtn":
            done = {name: QuantizedLinear(_rtn(module.weight, options), None)
                    for name, module in linears.items()}
        elif options.method == "gptq":
            done = _gptq_layer(layer, linears, runner, options)
        else:
            done = _awq_layer(model, layer, linears, runner, options)
        for name, result in done.items():
            _set_dequantized(linears[name], result, options.group_size)
            results[f"model.layers.{index}.{name}"] = result
        if runner is not None:  # the next layer calibrates on this quantized layer's output
            runner.run(layer, advance=True)
    return results


def _rtn(weight: torch.Tensor, options: QuantizeOptions) -> GroupQuantized:
    return rtn_quantize(weight.data, options.bits, options.group_size, options.sym)


def _set_dequantized(module: nn.Module, result: QuantizedLinear, group_size: int) -> None:
    w = dequantize_groups(result.weight, group_size, result.g_idx)
    module.weight.data.copy_(w)


def _gptq_layer(layer: nn.Module, linears: dict[str, nn.Module], runner: LayerwiseRunner,
                options: QuantizeOptions) -> dict[str, QuantizedLinear]:
    hessians: dict[str, torch.Tensor | None] = dict.fromkeys(linears)

    def observe(name: str, x: torch.Tensor) -> None:
        hessians[name] = accumulate_hessian(hessians[name], x)

    handles = record_inputs(linears, observe)
    try:
        runner.run(layer, advance=False)
    finally:
        for handle in handles:
            handle.remove()
    done = {}
    for name, module in linears.items():
        weight, g_idx = gptq_quantize(module.weight.data, hessians[name], options.bits,
                                      options.group_size, options.sym, options.desc_act,
                                      options.damp)
        done[name] = QuantizedLinear(weight, g_idx if options.desc_act else None)
    return done


class _ActivationStats:
    """Mean |x| per input channel over all calibration tokens, and an evenly strided sample
    of the inputs themselves for the searches."""

    def __init__(self, total_tokens: int, sample_tokens: int) -> None:
        self.stride = max(1, total_tokens // sample_tokens)
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.samples: dict[str, list[torch.Tensor]] = {}

    def observe(self, name: str, x: torch.Tensor) -> None:
        x = x.float()
        total = x.abs().sum(0)
        self.abs_sum[name] = self.abs_sum[name] + total if name in self.abs_sum else total
        self.count[name] = self.count.get(name, 0) + x.shape[0]
        self.samples.setdefault(name, []).append(x[::self.stride])

    def mean(self, name: str) -> torch.Tensor:
        return self.abs_sum[name] / self.count[name]

    def sample(self, name: str) -> torch.Tensor:
        return torch.cat(self.samples[name])


def _awq_layer(model: nn.Module, layer: nn.Module, linears: dict[str, nn.Module],
               runner: LayerwiseRunner, options: QuantizeOptions) -> dict[str, QuantizedLinear]:
    stats = _ActivationStats(runner.num_tokens, options.search_tokens)
    handles = record_inputs(linears, stats.observe)
    try:
        runner.run(layer, advance=False)
    finally:
        for handle in handles:
            handle.remove()
    cfg = model.config
    qkv, o_proj = linears["self_attn.qkv_proj"], linears["self_attn.o_proj"]
    gate_up, down = linears["mlp.gate_up_proj"], linears["mlp.down_proj"]
    search = dict(bits=options.bits, group_size=options.group_size, sym=options.sym,
                  n_grid=options.n_grid)
    inputs = {name: stats.sample(name) for name in linears}

    def scale_into(name: str, module: nn.Module, s: torch.Tensor) -> None:
        module.weight.data.mul_(s.to(module.weight.dtype))  # columns: W diag(s)
        inputs[name] = inputs[name] / s  # and the inputs the clip search will see

    # RMSNorm -> qkv and RMSNorm -> gate_up: the norm's weight absorbs 1 / s.
    for name, module, norm in (("self_attn.qkv_proj", qkv, layer.input_layernorm),
                               ("mlp.gate_up_proj", gate_up, layer.post_attention_layernorm)):
        s = awq_quantizer.search_scales(module.weight.data, inputs[name], stats.mean(name),
                                        **search)
        norm.weight.data.div_(s.to(norm.weight.dtype))
        scale_into(name, module, s)
    # v -> o: o's input channel (h, d) is attention over v of KV head h // (H / Hkv), so one
    # scale per KV channel, shared by the query heads of the group, is what v's rows absorb.
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rep = heads // kv_heads

    def expand_kv(s: torch.Tensor) -> torch.Tensor:
        return s.view(kv_heads, 1, dim).expand(kv_heads, rep, dim).reshape(-1)

    o_mean = stats.mean("self_attn.o_proj").view(kv_heads, rep, dim).mean(1).reshape(-1)
    s = awq_quantizer.search_scales(o_proj.weight.data, inputs["self_attn.o_proj"], o_mean,
                                    expand=expand_kv, **search)
    v_rows = slice(qkv.offsets[2], qkv.offsets[3])
    s_kv = s.view(kv_heads, rep, dim)[:, 0].reshape(-1)
    _scale_rows(qkv, v_rows, s_kv)
    scale_into("self_attn.o_proj", o_proj, s)
    # up -> down: silu(gate) * up is linear in up, so up's rows absorb 1 / s.
    s = awq_quantizer.search_scales(down.weight.data, inputs["mlp.down_proj"],
                                    stats.mean("mlp.down_proj"), **search)
    _scale_rows(gate_up, slice(gate_up.offsets[1], gate_up.offsets[2]), s)
    scale_into("mlp.down_proj", down, s)

    done = {}
    for name, module in linears.items():
        w = module.weight.data.float()
        # Clip every row but q's and k's (attention scores amplify their errors).
        first = qkv.offsets[2] if module is qkv else 0
        x = inputs[name]
        x = x[::max(1, x.shape[0] // options.clip_tokens)][:options.clip_tokens]
        limits = awq_quantizer.search_clip(w[first:], x, options.bits, options.group_size,
                                           options.sym, options.n_grid)
        w[first:] = awq_quantizer.apply_clip(w[first:], limits, options.group_size)
        done[name] = QuantizedLinear(rtn_quantize(w, options.bits, options.group_size,
                                                  options.sym), None)
    return done


def _scale_rows(module: nn.Module, rows: slice, s: torch.Tensor) -> None:
    """Divide output rows (and their bias) by s: the producer side of an AWQ scale."""
    module.weight.data[rows].div_(s.to(module.weight.dtype)[:, None])
    if module.bias is not None:
        module.bias.data[rows].div_(s.to(module.bias.dtype))
