"""Mixture-of-experts: top-k routing and the experts' gated MLPs, all experts in two tensors.

    w13 [E, 2 * I, d]: each expert's gate rows then up rows (checkpoint w1/gate_proj, w3/up_proj)
    w2  [E, d, I]:     each expert's down projection (checkpoint w2/down_proj)

A token goes through its top-k experts, and its output is the routing-weighted sum of theirs.
Two ways to compute it, with the same result:

- `grouped_moe` (any device, the CPU path and the GPU reference): the T * k (token, expert)
  pairs are sorted by expert, so each active expert runs one matmul over all its tokens;
  Python loops over the active experts, never over tokens.
- the fused Triton kernel (radixlm.kernels.fused_moe, CUDA): the same sorted pairs, padded per
  expert to whole blocks, in two grouped GEMMs; no host sync, so decode steps can be captured
  in a CUDA graph.

Tensor parallelism splits every expert's intermediate channels across ranks, like a dense MLP:
w13 holds this rank's gate and up rows, w2 its columns, and the partial sums are all-reduced.

Quantized experts (quantization/experts.py) keep the two tensors in e4m3 or int8, with a
float32 scale per output channel of each expert in `w13_scale` [E, 2I] and `w2_scale` [E, d].
A GGUF model's experts on the CPU keep the file's blocks instead (quantization/gguf_experts.py:
`gguf`, w13 and w2 then empty), run by our CPU kernel.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.groups import TPInfo, all_reduce
from radixlm.runtime.models.quantization import cpu_weights
from radixlm.runtime.models.quantization.experts import (
    dequantize_experts,
    expert_linear,
    quantize_experts,
    stored_dtype,
)
from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks
from radixlm.runtime.models.quantization.gguf_experts import GGUFExperts
from radixlm.runtime.models.quantization.quant_config import QuantConfig
from radixlm.runtime.models.weights.loading import copy_weight, materialize, narrow

# Checkpoint part -> (parameter, index of the part in it).
_PARTS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}


def route_top_k(router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, k] float32, expert ids [T, k] int64): softmax over
    all experts in float32, the k largest, rescaled to sum to one if `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d] through experts ids [T, k] with weights [T, k] -> [T, d] in x's dtype (SiLU
    gate). With scales, w13 and w2 are quantized experts (e4m3 or int8, per-channel scales
    [E, 2I] and [E, d])."""

    def expert_mlp(expert: int, xs: torch.Tensor) -> torch.Tensor:
        s13 = None if w13_scale is None else w13_scale[expert]
        s2 = None if w2_scale is None else w2_scale[expert]
        gate, up = expert_linear(xs, w13[expert], s13).chunk(2, dim=-1)  # [n, I] each
        return expert_linear(F.silu(gate) * up, w2[expert], s2)

    return grouped_experts(x, weights, ids, w13.shape[0], expert_mlp)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    num_experts: int,
                    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, d] through experts ids [T, k] with weights [T, k] -> [T, d] in x's dtype, where
    `expert_mlp(e, rows)` is expert e's MLP of its rows [n, d] -> [n, d]. Weighted in
    float32, summed per token in expert order."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()  # [T * k]: pair p is token p // k's choice p % k
    order = flat.argsort(stable=True)  # pairs sorted by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // top_k  # [T * k] token of each sorted pair
    xs = x.index_select(0, token_of)  # [T * k, d], grouped by expert
    out = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        out[rows] = expert_mlp(expert, xs[rows]).float()  # [n, d]
        start += count
    out *= weights.flatten()[order].unsqueeze(1)
    summed = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return summed.index_add_(0, token_of, out).to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one MoE layer. `forward` takes the routing (see route_top_k). With a
    QuantConfig (fp8 or int8) the experts are quantized: float weights after loading, or an
    FP8 checkpoint's e4m3 weights and scales as they are. With "gguf" (a GGUF model on the
    CPU) they keep the file's blocks where our CPU kernel builds, and are float otherwise."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, tp: TPInfo | None = None,
                 quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp
        self.dtype = dtype
        self.start, size = (0, intermediate_size) if tp is None else tp.split(
            intermediate_size, "moe_intermediate_size")
        self.intermediate_size = size  # this rank's
        self.gguf = None
        if quant is not None and quant.method == "gguf":
            quant = None  # float experts, unless the blocks run as they are:
            if cpu_weights.linear_kernel() is not None:
                self.gguf = GGUFExperts(num_experts, hidden_size, size)
        self.quant = quant
        prequantized = quant is not None and quant.prequantized
        stored = stored_dtype(quant) if prequantized else dtype
        shapes = (((num_experts, 2 * size, hidden_size), (num_experts, hidden_size, size))
                  if self.gguf is None else ((0,), (0,)))
        self.w13 = nn.Parameter(torch.empty(shapes[0], dtype=stored), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shapes[1], dtype=stored), requires_grad=False)
        # Per-channel scales: a checkpoint's, or made after loading (quantize-on-load).
        for name, rows in (("w13_scale", 2 * size), ("w2_scale", hidden_size)):
            self.register_parameter(name, nn.Parameter(
                torch.empty(num_experts, rows, dtype=torch.float32), requires_grad=False)
                if prequantized else None)
        self.kernel: Any = None  # radixlm.kernels.fused_moe when the fused kernels are on

    def checkpoint_shards(self, param_name: str) -> list[tuple[int, str]]:
        """The (expert, part) pieces a complete checkpoint sets in this parameter."""
        base = param_name.removesuffix("_scale")
        parts = [p for p, (name, _) in _PARTS.items() if name == base]
        return [(e, p) for e in range(self.num_experts) for p in parts]

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: tuple[int, str]) -> None:
        """One expert's gate, up ([I, d]) or down ([d, I]) projection from the checkpoint, or
        its weight_scale (one per tensor, or one per output channel)."""
        expert, part = shard_id
        if self.gguf is not None:
            self.gguf.load(expert, part, loaded)
            return
        if isinstance(loaded, GGUFBlocks):  # a GGUF model whose blocks do not run here
            loaded = loaded.dequantize()
        _, index = _PARTS[part]
        size = self.intermediate_size
        if param is self.w13_scale or param is self.w2_scale:
            self._load_scale(param, materialize(loaded), expert, part)
        elif part == "down":  # this rank's input columns
            copy_weight(param.data[expert], narrow(loaded, 1, self.start, size))
        else:  # this rank's output rows, at the part's offset in w13
            rows = slice(index * size, (index + 1) * size)
            copy_weight(param.data[expert, rows], narrow(loaded, 0, self.start, size))

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, expert: int,
                    part: str) -> None:
        size = self.intermediate_size
        index = _PARTS[part][1]
        rows = (param.data[expert] if part == "down"
                else param.data[expert, index * size:(index + 1) * size])
        if loaded.numel() == 1:  # per-tensor: one scale for every channel of the part
            rows.fill_(loaded.reshape(()).item())
            return
        loaded = loaded.reshape(-1)  # per-channel: [rows] or [rows, 1]
        copy_weight(rows, loaded if part == "down" else loaded.narrow(0, self.start, size))

    def init_dummy(self, random: Any) -> None:
        """Random float weights (see loader._init_dummy), stored as a checkpoint of this
        layer's format holds them."""
        for name in ("w13", "w2"):
            param = getattr(self, name)
            w = random(tuple(param.shape), param.device)
            scale = getattr(self, f"{name}_scale")
            if scale is None:
                param.data.copy_(w)
            else:
                q, s = quantize_experts(w, self.quant.method, self.dtype)
                param.data.copy_(q)
                scale.data.copy_(s)

    def process_weights_after_loading(self) -> None:
        """Quantize float experts (fp8, int8); on the CPU, a bfloat16 model's FP8 experts
        become bfloat16 weights (no fast fp8 product there)."""
        if self.quant is None:  # float, or GGUF blocks (tiled as their last part loaded)
            return
        for name in ("w13", "w2"):
            param, scale = getattr(self, name), getattr(self, f"{name}_scale")
            if scale is None:
                q, s = quantize_experts(param.data, self.quant.method, self.dtype)
                setattr(self, name, nn.Parameter(q, requires_grad=False))
                self.register_parameter(f"{name}_scale", nn.Parameter(s, requires_grad=False))
            param, scale = getattr(self, name), getattr(self, f"{name}_scale")
            if (param.dtype != torch.int8 and param.device.type == "cpu"
                    and self.dtype == torch.bfloat16):
                setattr(self, name, nn.Parameter(
                    dequantize_experts(param.data, scale.data, self.dtype), requires_grad=False))
                self.register_parameter(f"{name}_scale", None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:
            out = grouped_experts(x, weights, ids, self.num_experts, self.gguf.expert_mlp)
        elif self.kernel is not None:
            out = self.kernel.fused_moe(x, self.w13, self.w2, weights, ids,
                                        self.w13_scale, self.w2_scale)
        else:
            out = grouped_moe(x, self.w13, self.w2, weights, ids, self.w13_scale,
                              self.w2_scale)
        return out if self.tp is None else all_reduce(out)
