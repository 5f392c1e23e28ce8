"""Each quantized linear, loaded part by part from checkpoint-layout tensors, computes x @ W for
the W its format defines (written out element by element here, in float64)."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.reference import dequantize_int_reference, fp8_linear_reference
from radixlm.runtime.models.layers.linear import Linear, MergedLinear, QKVLinear
from radixlm.runtime.models.quantization import QuantConfig, packing
from radixlm.runtime.models.quantization.fp8 import FP8, fp8_linear, quantize_fp8_rows


def load(layer, parts: list[dict[str, torch.Tensor]]) -> None:
    """Feed checkpoint tensors through the layer's weight_loader, part by part, then convert."""
    for shard, tensors in zip(layer.shard_names, parts):
        for name, tensor in tensors.items():
            layer.weight_loader(layer.get_parameter(name), tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)


def random_int_part(gen, k: int, n: int, group: int, bits: int, zero_min: int = 0):
    """Integers, zero points and fp16 scales of one part, and its W [K, N] in float64."""
    groups = -(-k // group)
    q = torch.randint(0, 2 ** bits, (k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(zero_min, 2 ** bits, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    return q, zeros, scales


def reference_w(q, zeros, scales, group_of_row):
    return (q - zeros[group_of_row]).double() * scales[group_of_row].double()


def check_close(out: torch.Tensor, want: torch.Tensor, tol: float = 1e-6) -> None:
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def test_awq_merged_qkv_with_a_ragged_last_group():
    gen = torch.Generator().manual_seed(0)
    k, group = 80, 32  # groups of 32, 32 and 16 inputs
    layer = QKVLinear(k, head_dim=16, num_heads=4, num_kv_heads=2, bias=True,
                      dtype=torch.float32, quant=QuantConfig("awq", bits=4, group_size=group,
                                                             prequantized=True))
    parts, ws, biases = [], [], []
    for n in layer.output_sizes:
        q, zeros, scales = random_int_part(gen, k, n, group, 4)
        bias = torch.randn(n, generator=gen)
        parts.append({"qweight": packing.pack_awq(q), "qzeros": packing.pack_awq(zeros),
                      "scales": scales, "bias": bias})
        ws.append(reference_w(q, zeros, scales, torch.arange(k) // group))
        biases.append(bias)
    load(layer, parts)
    x = torch.randn(5, k, generator=gen)
    check_close(layer(x), x.double() @ torch.cat(ws, 1) + torch.cat(biases).double())


@pytest.mark.parametrize("bits, v1", [(4, True), (4, False), (8, True)])
def test_gptq_act_order_merged_layer(bits, v1):
    gen = torch.Generator().manual_seed(bits)
    k, group = 64, 16
    cfg = QuantConfig("gptq", bits=bits, group_size=group, desc_act=True, prequantized=True,
                      checkpoint_format="gptq" if v1 else "gptq_v2")
    layer = MergedLinear(k, [32, 48], dtype=torch.float32, quant=cfg)
    # act-order: the groups are scattered over the inputs (shared by both parts)
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].to(torch.int32)
    parts, ws = [], []
    for n in layer.output_sizes:
        q, zeros, scales = random_int_part(gen, k, n, group, bits, zero_min=1 if v1 else 0)
        parts.append({"qweight": packing.pack_gptq_weight(q, bits),
                      "qzeros": packing.pack_gptq_zeros(zeros, bits, v1), "scales": scales,
                      "g_idx": g_idx})
        ws.append(reference_w(q, zeros, scales, g_idx.long()))
    load(layer, parts)
    assert layer.quant_method.has_perm
    x = torch.randn(7, k, generator=gen)
    check_close(layer(x), x.double() @ torch.cat(ws, 1))


def test_gptq_parts_with_different_g_idx_are_refused():
    layer = MergedLinear(32, [16, 16], dtype=torch.float32,
                         quant=QuantConfig("gptq", bits=4, group_size=8, prequantized=True))
    layer.weight_loader(layer.g_idx, torch.arange(32, dtype=torch.int32) // 8, 0)
    with pytest.raises(ValueError, match="g_idx"):
        layer.weight_loader(layer.g_idx, torch.arange(32, dtype=torch.int32).flip(0) // 8, 1)


def test_int8_online_matches_its_dequantized_weight():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=gen)
    layer = Linear(64, 48, dtype=torch.float32, quant=QuantConfig("int8"))
    load(layer, [{"weight": w}])
    deq = dequantize_int_reference(layer.qweight, layer.scales, layer.zeros, 64, 8)  # [K, N]
    # Round to nearest on a per-row grid of max|w| / 127: off by at most half a step.
    step = w.abs().amax(1) / 127
    assert ((deq.t() - w).abs() <= step[:, None] / 2 + 1e-7).all()
    x = torch.randn(3, 64, generator=gen)
    check_close(layer(x), x.double() @ deq.double())


def test_fp8_online_per_channel():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen) * torch.rand(48, 1, generator=gen)
    layer = Linear(64, 48, dtype=torch.float32, quant=QuantConfig("fp8"))
    load(layer, [{"weight": w}])
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (48,)
    deq = layer.weight.double() * layer.weight_scale.double()[:, None]
    assert ((deq - w).abs() <= w.abs().amax(1, keepdim=True) * 2 ** -4).all()  # e4m3: 3 bits
    x = torch.randn(6, 64, generator=gen)
    check_close(layer(x), fp8_linear_reference(x.double(), layer.weight, layer.weight_scale))


def test_fp8_checkpoint_with_per_tensor_scales_per_part():
    gen = torch.Generator().manual_seed(4)
    layer = QKVLinear(64, head_dim=16, num_heads=2, num_kv_heads=1, dtype=torch.float32,
                      quant=QuantConfig("fp8", prequantized=True))
    parts, rows = [], []
    for n in layer.output_sizes:
        w8 = (torch.randn(n, 64, generator=gen) * 100).clamp(-448, 448).to(FP8)
        scale = torch.rand((), generator=gen) * 0.01
        parts.append({"weight": w8, "weight_scale": scale})
        rows.append(w8.double() * scale.double())
    load(layer, parts)
    x = torch.randn(4, 64, generator=gen)
    # The same e4m3 weights; the layer holds each part's one scale on every row of the part.
    w = layer.weight.double() * layer.weight_scale.double()[:, None]
    assert torch.equal(w, torch.cat(rows))
    check_close(layer(x), fp8_linear_reference(x.double(), layer.weight, layer.weight_scale))


def test_fp8_fallback_agrees_with_scaled_mm_on_cpu():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen)
    w8, scale = quantize_fp8_rows(torch.randn(32, 64, generator=gen))
    fallback = fp8_linear(x, w8, scale.view(-1), use_scaled_mm=False)
    try:
        fused = fp8_linear(x, w8, scale.view(-1), use_scaled_mm=True)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {exc}")
    check_close(fused, fallback.double(), tol=1e-2)  # _scaled_mm rounds its output to bf16


def bf16_close(out: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 activations and output: within a few parts in a thousand of the scale."""
    assert out.dtype == torch.bfloat16
    assert (out.double() - want).abs().max() <= 8e-3 * want.abs().max()


@pytest.mark.parametrize("bits, group, act_order", [(4, 32, False), (4, 128, True),
                                                   (8, 64, False)])
def test_gptq_cpu_planes_with_bfloat16_activations(bits, group, act_order):
    """A bfloat16 model on the CPU repacks GPTQ (and AWQ, int8) weights into int4 planes for
    torch's CPU kernel: 4-bit codes one plane, 8-bit two; act-order through a permutation."""
    gen = torch.Generator().manual_seed(bits + group)
    k = 256
    cfg = QuantConfig("gptq", bits=bits, group_size=group, desc_act=act_order,
                      prequantized=True)
    layer = MergedLinear(k, [32, 64], dtype=torch.bfloat16, quant=cfg)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    parts, ws = [], []
    for n in layer.output_sizes:
        q, zeros, scales = random_int_part(gen, k, n, group, bits, zero_min=1)
        parts.append({"qweight": packing.pack_gptq_weight(q, bits),
                      "qzeros": packing.pack_gptq_zeros(zeros, bits, True),
                      "scales": scales.bfloat16(), "g_idx": g_idx.to(torch.int32)})
        ws.append(reference_w(q, zeros, scales.bfloat16().float(), g_idx))
    load(layer, parts)
    assert layer.quant_method.on_cpu
    assert layer.cpu_weights.plane_counts == [1 if bits == 4 else 2]
    x = torch.randn(3, k, generator=gen).bfloat16()
    bf16_close(layer(x), x.double() @ torch.cat(ws, 1))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_methods_on_cpu_with_bfloat16_activations(method):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen)
    layer = Linear(64, 48, dtype=torch.bfloat16, quant=QuantConfig(method))
    load(layer, [{"weight": w.bfloat16()}])
    assert layer.quant_method.on_cpu
    x = torch.randn(3, 64, generator=gen).bfloat16()
    if method == "fp8":  # 3 mantissa bits: compare with the rounded weights themselves
        from radixlm.runtime.models.quantization.fp8 import quantize_fp8_rows

        w8, scale = quantize_fp8_rows(w.bfloat16())
        w = w8.float() * scale
    bf16_close(layer(x), x.double() @ w.bfloat16().double().t())
