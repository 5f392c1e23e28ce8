"""Our quantizers: AWQ and GPTQ beat RTN where they should, and the checkpoints they write load
back (through our loader) into exactly the weights they quantized to."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.cli import main
from radixlm.runtime.models.loader import load_model
from radixlm.runtime.models.quantization.int_weight import IntWeight, dequantize
from radixlm.runtime.models.quantization.rtn import dequantize_groups, fake_quantize, rtn_quantize
from radixlm.runtime.quantize import awq_quantizer
from radixlm.runtime.quantize.calibration import sequence_logprobs, sequence_scores
from radixlm.runtime.quantize.checkpoint import save_quantized
from radixlm.runtime.quantize.gptq_quantizer import accumulate_hessian, gptq_quantize
from radixlm.runtime.quantize.model_quantizer import QuantizeOptions, quantize_model

from conftest import save_tiny_hf_model

CPU = torch.device("cpu")
BITS, GROUP = 4, 32


def layer_problem(seed: int, k: int = 128, n: int = 64, tokens: int = 1024):
    """A weight and two independent draws of its inputs: correlated channels (what GPTQ's
    error compensation exploits) of very different magnitudes (what AWQ's scaling exploits)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    mixing = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    magnitude = torch.exp(torch.randn(k, generator=gen))  # log-normal channel scales

    def draw():
        return (torch.randn(tokens, k, generator=gen) @ mixing) * magnitude

    return w, draw(), draw()


def output_error(w_hat: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> float:
    return ((x @ (w_hat - w).t()).pow(2).mean() / (x @ w.t()).pow(2).mean()).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awq_and_gptq_beat_rtn_on_held_out_inputs(seed):
    w, x_calib, x_test = layer_problem(seed)
    rtn = output_error(fake_quantize(w, BITS, GROUP), w, x_test)
    # AWQ: scale search, clip search, then round the scaled weight; the input carries 1 / s.
    s = awq_quantizer.search_scales(w, x_calib, x_calib.abs().mean(0), BITS, GROUP)
    limits = awq_quantizer.search_clip(w * s, x_calib / s, BITS, GROUP)
    scaled = awq_quantizer.apply_clip(w * s, limits, GROUP)
    awq = output_error(fake_quantize(scaled, BITS, GROUP) / s, w, x_test)
    hessian = accumulate_hessian(None, x_calib)
    errors = {}
    for act_order in (False, True):
        quantized, g_idx = gptq_quantize(w, hessian, BITS, GROUP, act_order=act_order)
        errors[act_order] = output_error(dequantize_groups(quantized, GROUP, g_idx), w, x_test)
    # Measured ratios to RTN on these seeds: AWQ ~0.6, GPTQ ~0.7, GPTQ act-order ~0.4.
    assert awq < 0.75 * rtn, (awq, rtn)
    assert errors[False] < 0.85 * rtn, (errors, rtn)
    assert errors[True] < 0.6 * rtn, (errors, rtn)


def test_gptq_without_correlations_or_outliers_is_rtn():
    """With H = I no column's error can be moved onto another: GPTQ rounds to nearest."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen)
    quantized, _ = gptq_quantize(w, torch.eye(64), BITS, GROUP, damp=0.0)
    assert torch.equal(quantized.q, rtn_quantize(w, BITS, GROUP).q)


def loaded_weight(module) -> torch.Tensor:
    """A loaded quantized linear's weight, dequantized, in [out, in] checkpoint order."""
    method = module.quant_method
    w = dequantize(IntWeight(module.qweight, module.scales, module.zeros, method.config.bits,
                             method.group))  # [K, N], rows in the packed (act-order) order
    if getattr(method, "has_perm", False):
        w = torch.empty_like(w).index_copy_(0, module.perm, w)
    return w.t()


@pytest.mark.parametrize("method, fmt, desc_act", [
    ("rtn", "gptq", False), ("awq", "awq", False), ("gptq", "gptq", True)])
def test_written_checkpoint_loads_to_the_quantized_weights(tmp_path, method, fmt, desc_act):
    src = save_tiny_hf_model(tmp_path / "float", "qwen2")  # q/k/v biases: split and merged
    model = load_model(str(src), "auto", torch.float32, CPU).model
    calibration = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    options = QuantizeOptions(method=method, group_size=GROUP, desc_act=desc_act)
    results = quantize_model(model, calibration, options)
    out = save_quantized(model, results, options, fmt, src, tmp_path / "quantized")
    loaded = load_model(str(out), "auto", torch.float32, CPU)
    assert loaded.model.quant.method == fmt and loaded.model.quant.desc_act == desc_act
    for name in results:
        # The quantizer left the model computing with its dequantized weights: same values.
        assert torch.equal(loaded_weight(loaded.model.get_submodule(name)),
                           model.get_submodule(name).weight), name
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1))
    # Only the float16 norms, biases and embeddings of the checkpoint differ.
    diff = (sequence_logprobs(loaded.model, ids) - sequence_logprobs(model, ids)).abs().max()
    assert diff < 2e-3


def test_quantized_loads_of_a_float_checkpoint(tmp_path):
    src = save_tiny_hf_model(tmp_path, "llama")
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1))
    base = sequence_logprobs(load_model(str(src), "auto", torch.float32, CPU).model, ids)
    for method, limit in (("int8", 0.02), ("fp8", 0.1)):
        model = load_model(str(src), "auto", torch.float32, CPU, quantization=method).model
        assert model.quant.method == method
        assert (sequence_logprobs(model, ids) - base).abs().mean() < limit, method
    with pytest.raises(ValueError, match="radixlm quantize"):
        load_model(str(src), "auto", torch.float32, CPU, quantization="gptq")


def test_the_float8_attention_emulation_is_attention_with_the_roundings_added(
        tmp_path, monkeypatch):
    """quant_quality.py's float8 tensor-core attention: without its roundings it is the
    torch backend's attention (causal, grouped queries); with them, a few percent off; a
    decode row equals the prefill's last one; and a model scored through it gives the same
    scores a token at a time as in one prefill."""
    from pathlib import Path

    import torch.nn.functional as F

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import quant_quality

    from radixlm.runtime.attention import torch_native

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 40, 64, generator=gen) for heads in (6, 2, 2))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125,
                                           enable_gqa=True)
    rounded = quant_quality.fp8_attention(q, k, v, None, 0.125)
    error = ((rounded - exact).norm() / exact.norm()).item()
    assert 1e-3 < error < 0.05, error
    last = quant_quality.fp8_attention(q[:, :, -1:], k, v, torch.ones(1, 1, 1, 40).bool(),
                                       0.125)
    assert torch.allclose(last[:, :, 0], rounded[:, :, -1], atol=1e-5)
    with monkeypatch.context() as patch:
        patch.setattr(quant_quality, "e4m3", lambda x: x)
        plain = quant_quality.fp8_attention(q, k, v, None, 0.125)
    assert torch.allclose(plain, exact, atol=1e-5)

    saved = torch_native.F, torch_native._decode_attention
    src = save_tiny_hf_model(tmp_path, "llama")
    model = load_model(str(src), "auto", torch.float32, CPU).model
    ids = torch.randint(3, 512, (2, 16), generator=gen)
    with quant_quality.emulated_fp8_attention(256.0):
        prefill_lp, _ = sequence_scores(model, ids, torch.float8_e4m3fn)
        steps_lp, _ = sequence_scores(model, ids, torch.float8_e4m3fn, one_token_steps=True)
    assert (torch_native.F, torch_native._decode_attention) == saved  # restored
    assert (steps_lp - prefill_lp).abs().mean() < 0.02


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_scores_a_token_at_a_time_equal_one_prefill(tmp_path, kv_dtype):
    """quant_quality.py --one-token-steps: sequences as decode steps, side by side, score each
    token as the prefill does, up to float32 summation order, and each sequence as it scores
    alone. A float8 cache can turn that order into a one-step rounding difference of a stored
    value (seen on SmolLM2 from layer 6 on), so there the scores need only agree closely."""
    src = save_tiny_hf_model(tmp_path, "llama")
    model = load_model(str(src), "auto", torch.float32, CPU).model
    ids = torch.randint(3, 512, (3, 24), generator=torch.Generator().manual_seed(2))
    prefill_lp, prefill_top = sequence_scores(model, ids, kv_dtype)
    steps_lp, steps_top = sequence_scores(model, ids, kv_dtype, one_token_steps=True)
    assert steps_lp.shape == prefill_lp.shape == (3 * 23,)
    alone_lp, _ = sequence_scores(model, ids[1], kv_dtype, one_token_steps=True)
    assert (alone_lp - steps_lp[23:46]).abs().max() < 1e-4
    if kv_dtype is None:
        assert (steps_lp - prefill_lp).abs().max() < 1e-4
        assert torch.equal(steps_top, prefill_top)
    else:
        assert (steps_lp - prefill_lp).abs().mean() < 0.02
        assert (steps_top == prefill_top).float().mean() >= 0.9


@pytest.mark.parametrize("method", ["fp8", "int8", "awq", "gptq"])
def test_dummy_weights_for_every_method(tmp_path, method):
    """load_format="dummy" (benchmarks): awq/gptq get random weights RTN-packed in their
    format, so the same repacking runs as for a checkpoint."""
    src = save_tiny_hf_model(tmp_path, "llama")
    model = load_model(str(src), "dummy", torch.float32, CPU, quantization=method).model
    down = model.model.layers[0].mlp.down_proj
    if method in ("awq", "gptq"):
        assert 0.015 < loaded_weight(down).std() < 0.025  # ~ the float dummy weights' 0.02
    ids = torch.randint(3, 512, (16,), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(sequence_logprobs(model, ids)).all()


def test_quantize_command_then_generate(tmp_path, tiny_chat_model, capsys):
    out = tmp_path / "awq"
    code = main(["quantize", "--model", str(tiny_chat_model), "--method", "awq",
                 "--group-size", "32", "--num-samples", "2", "--seq-len", "64",
                 "--device", "cpu", "--out", str(out)])
    assert code == 0 and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    capsys.readouterr()
    code = main(["generate", "Hello", "--model", str(out), "--max-new-tokens", "4",
                 "--max-total-tokens", "1024", "--device", "cpu"])
    assert code == 0 and capsys.readouterr().out.strip()


def test_engine_quantization_option(tmp_path):
    """Engine(model, quantization=...) quantizes a float checkpoint on load."""
    from radixlm.runtime import Engine

    src = save_tiny_hf_model(tmp_path, "llama")
    with Engine(str(src), device="cpu", dtype="float32", max_total_tokens=1024,
                quantization="int8") as engine:
        assert engine.core.runner.model.quant.method == "int8"
        out = engine.generate(input_ids=[5, 17, 99],
                              sampling_params={"max_new_tokens": 3, "temperature": 0,
                                               "ignore_eos": True})
    assert len(out.token_ids) == 3


def test_fp8_checkpoint_with_static_input_scales(tmp_path):
    """An FP8 checkpoint as FP8 exporters write it (per-tensor weight_scale per projection,
    static input_scale): loaded, the e4m3 weights are kept bit for bit, each projection's scale
    covers its rows of the fused layer, and input_scale is read past."""
    import json

    from safetensors.torch import load_file, save_file

    from radixlm.runtime.models.quantization.fp8 import FP8

    src = save_tiny_hf_model(tmp_path / "float", "llama")
    tensors = load_file(str(src / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        scale = w.abs().max() / 448
        tensors[name] = (w / scale).to(FP8)
        tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(())
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (out / "config.json").write_text(json.dumps(config))
    model = load_model(str(out), "auto", torch.float32, CPU).model
    qkv = model.model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn"
    k_rows = slice(qkv.offsets[1], qkv.offsets[2])
    assert torch.equal(qkv.weight[k_rows].view(torch.uint8),
                       tensors[f"{prefix}.k_proj.weight"].view(torch.uint8))
    assert torch.equal(qkv.weight_scale[k_rows],
                       tensors[f"{prefix}.k_proj.weight_scale"].expand(k_rows.stop - k_rows.start))
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1))
    base = sequence_logprobs(load_model(str(src), "auto", torch.float32, CPU).model, ids)
    assert (sequence_logprobs(model, ids) - base).abs().mean() < 0.1
