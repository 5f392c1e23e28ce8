"""Quantized experts (fp8, int8 weight-only, per-channel scales): the quantizers, the grouped
path and the CPU int8 kernel against the dequantized weights, loading float and FP8
checkpoints, whole tiny MoE models against their float selves, the fused Triton kernel under
the interpreter (fp32 activations), and on the GPU (marked gpu) against the grouped path.

Tolerances. A product with quantized experts equals, up to float32 rounding, the product with
the dequantized weights: that is checked tightly (1e-5 of the output's scale in fp32). Against
the float model the error is the format's own: int8 rounds each weight within half a step of
max|row| / 127 (~1% of a layer's output here), e4m3 to 3 mantissa bits (~3%), and "fp8"
also quantizes the activations of the other linears (W8A8). Logits of the tiny models stay
within 2e-2 (int8) and 1e-1 (fp8) of the float logits in relative norm, and their greedy
tokens are the float model's at 90% (int8) and 80% (fp8) of the positions at least.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_moe import per_token_reference, random_moe

from radixlm.runtime.models.layers.moe import FusedMoE, grouped_moe
from radixlm.runtime.models.quantization.experts import (
    INT8_KERNEL_ROWS,
    dequantize_experts,
    expert_linear,
    quantize_experts,
)
from radixlm.runtime.models.quantization.fp8 import FP8, quantize_fp8_rows
from radixlm.runtime.models.quantization.quant_config import QuantConfig

from interpreter_cases import collect_cases, main, results_under_interpreter

METHODS = ["int8", "fp8"]
# Relative (Frobenius) error of one layer's output against the float layer, per format.
LAYER_TOL = {"int8": 2e-2, "fp8": 6e-2}
# The same for a tiny model's logits (every decoder linear quantized).
LOGITS_TOL = {"int8": 2e-2, "fp8": 1e-1}
# Positions (teacher-forced) whose greedy token is the float model's, at least.
GREEDY_AGREEMENT = {"int8": 0.9, "fp8": 0.8}


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def quantized_moe(tokens: int, experts: int, top_k: int, method: str, hidden: int = 64,
                  inter: int = 48, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  skew: bool = False, seed: int = 0):
    """random_moe's layer with its experts quantized: x, q13, q2, s13, s2, weights, ids and
    the float w13, w2 they came from."""
    x, w13, w2, weights, ids = random_moe(tokens, experts, top_k, hidden, inter, dtype, device,
                                          seed=seed, skew=skew)
    q13, s13 = quantize_experts(w13, method, dtype)
    q2, s2 = quantize_experts(w2, method, dtype)
    return x, q13, q2, s13, s2, weights, ids, w13, w2


# -- the quantizers and the grouped path -----------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_quantize_experts_per_output_channel(method):
    _, w13, _, _, _ = random_moe(1, 4, 2)
    q, scale = quantize_experts(w13, method, torch.float32)
    assert q.dtype == (FP8 if method == "fp8" else torch.int8) and scale.shape == (4, 96)
    back = dequantize_experts(q, scale, torch.float32)
    if method == "int8":  # within half a grid step of each row
        assert ((back - w13).abs() <= scale[..., None] / 2 * 1.0001).all()
        assert q.abs().max() == 127
    else:  # the dense rule, expert by expert
        q8, s8 = quantize_fp8_rows(w13[2])
        assert torch.equal(q[2].float(), q8.float()) and torch.equal(scale[2], s8.view(-1))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (60, 4, 2), (37, 16, 4)])
def test_grouped_quantized_equals_dequantized(method, tokens, experts, top_k):
    """The product runs on the stored values and scales the result: the function of the
    dequantized weights, in fp32 up to rounding (60 tokens over 4 experts: more rows per
    expert than the CPU int8 kernel takes, so the cast path too)."""
    x, q13, q2, s13, s2, weights, ids, _, _ = quantized_moe(tokens, experts, top_k, method)
    out = grouped_moe(x, q13, q2, weights, ids, s13, s2)
    deq13, deq2 = (dequantize_experts(q, s, torch.float32) for q, s in ((q13, s13), (q2, s2)))
    want = per_token_reference(x, deq13, deq2, weights, ids)
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("rows", [1, INT8_KERNEL_ROWS, INT8_KERNEL_ROWS + 1, 40])
def test_int8_expert_linear_bf16(rows):
    """bfloat16 activations: torch's int8 kernel up to INT8_KERNEL_ROWS rows, the cast weights
    beyond, both within bfloat16 rounding of the float64 product."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(1, 96, 256, generator=gen) * 0.05
    q, scale = quantize_experts(w, "int8", torch.bfloat16)
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    out = expert_linear(x, q[0], scale[0])
    want = x.double() @ dequantize_experts(q, scale, torch.float64)[0].t()
    assert out.dtype == torch.bfloat16
    assert (out.double() - want).abs().max() <= 8e-3 * want.abs().max()


# -- the layer: loading and quantizing -------------------------------------------------------

def load_experts(layer: FusedMoE, w13: torch.Tensor, w2: torch.Tensor,
                 s13: torch.Tensor | None = None, s2: torch.Tensor | None = None) -> None:
    """Checkpoint pieces, expert by expert (with scales: an FP8 checkpoint's weight_scale)."""
    for e in range(w13.shape[0]):
        for part, rows in (("gate", w13[e].chunk(2)[0]), ("up", w13[e].chunk(2)[1])):
            layer.weight_loader(layer.w13, rows, (e, part))
        layer.weight_loader(layer.w2, w2[e], (e, "down"))
        if s13 is not None:
            gate_s, up_s = s13[e].chunk(2)
            layer.weight_loader(layer.w13_scale, gate_s, (e, "gate"))
            layer.weight_loader(layer.w13_scale, up_s.view(-1, 1), (e, "up"))  # [rows, 1] too
            layer.weight_loader(layer.w2_scale, s2[e], (e, "down"))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_quantizes_float_experts_on_load(method, dtype):
    x, w13, w2, weights, ids = random_moe(23, 8, 2, hidden=128, inter=96, dtype=dtype)
    layer = FusedMoE(8, 128, 96, dtype, quant=QuantConfig(method))
    load_experts(layer, w13, w2)
    layer.process_weights_after_loading()
    if method == "fp8" and dtype == torch.bfloat16:  # the CPU's form: bfloat16 weights
        assert layer.w13.dtype == torch.bfloat16 and layer.w13_scale is None
    else:
        assert layer.w13.dtype == (FP8 if method == "fp8" else torch.int8)
        assert layer.w13_scale.shape == (8, 192) and layer.w2_scale.shape == (8, 128)
    float_out = grouped_moe(x, w13, w2, weights, ids)
    assert rel_err(layer(x, weights, ids), float_out) < LAYER_TOL[method]


def test_fp8_checkpoint_scales_per_channel_per_tensor_and_shards():
    """An FP8 checkpoint's e4m3 experts with per-channel weight_scale ([rows] or [rows, 1])
    or one per tensor; two ranks hold their halves of gate/up scales and every down scale,
    and their partial outputs sum to the whole layer's."""
    from radixlm.runtime.distributed.groups import TPInfo

    x, q13, q2, s13, s2, weights, ids, _, _ = quantized_moe(9, 4, 2, "fp8")
    s13[1, :48] = 0.01  # expert 1's gate: one scale for the whole tensor
    cfg = QuantConfig("fp8", prequantized=True)
    whole = FusedMoE(4, 64, 48, torch.float32, quant=cfg)
    halves = [FusedMoE(4, 64, 48, torch.float32, TPInfo(rank, 2), quant=cfg) for rank in (0, 1)]
    for layer in [whole] + halves:
        load_experts(layer, q13, q2, s13, s2)
        layer.weight_loader(layer.w13_scale, torch.tensor(0.01), (1, "gate"))  # per-tensor
        assert len(layer.checkpoint_shards("w13_scale")) == 8
        layer.process_weights_after_loading()  # prequantized fp32 on CPU: kept as they are
    assert torch.equal(whole.w13_scale, s13) and torch.equal(whole.w2_scale, s2)
    assert torch.equal(halves[1].w13_scale[2, :24], s13[2, 24:48])  # rank 1's gate rows
    assert torch.equal(halves[1].w2_scale, s2)
    full = whole(x, weights, ids)
    assert rel_err(full, grouped_moe(x, q13, q2, weights, ids, s13, s2)) < 1e-6
    parts = sum(grouped_moe(x, h.w13, h.w2, weights, ids, h.w13_scale, h.w2_scale)
                for h in halves)
    assert (full - parts).abs().max() < 1e-5


# -- whole models ----------------------------------------------------------------------------

CPU = torch.device("cpu")


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe", "qwen3-moe"])
@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_logits_close_to_float(tmp_path, family, method):
    """Every decoder linear quantized (experts, attention, shared expert, dense layers), the
    routers in float: logits within the format's tolerance of the float model's, and the
    float model's greedy token at most positions (random tiny models have flat logits, where
    any rounding may swap the two best tokens)."""
    from radixlm.runtime.models.loader import load_model

    from test_model_families import save_family
    from test_models import run_chunks

    folder = save_family(tmp_path, family)
    ids = torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    want = run_chunks(load_model(str(folder), "auto", torch.float32, CPU), ids, [80])
    loaded = load_model(str(folder), "auto", torch.float32, CPU, quantization=method)
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.w13.element_size() == 1 and experts.w2_scale is not None
    out = run_chunks(loaded, ids, [50, 1, 1, 28])
    err = rel_err(out, want)
    agree = (out.argmax(-1) == want.argmax(-1)).double().mean().item()
    print(f"{family} {method}: logits rel err {err:.2e}, greedy agreement {agree:.3f}")
    assert err < LOGITS_TOL[method]
    assert agree >= GREEDY_AGREEMENT[method]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_engine_greedy_is_its_own_forward(tmp_path, method):
    """Through the engine (chunked prefill, decode steps, prefix-cache hits) a quantized model
    gives the greedy tokens of its own whole-sequence forward, in fp32 on the CPU."""
    from radixlm.runtime import Engine
    from radixlm.runtime.models.loader import load_model

    from test_model_families import save_family
    from test_models import run_chunks

    folder = save_family(tmp_path, "qwen2-moe")
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 20)]
    params = {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8}
    with Engine(str(folder), device="cpu", dtype="float32", quantization=method, page_size=4,
                max_total_tokens=1024, chunked_prefill_size=16,
                max_num_batched_tokens=32) as engine:
        outs = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    loaded = load_model(str(folder), "auto", torch.float32, CPU, quantization=method)
    for prompt, generated in zip(prompts, outs):
        logits = run_chunks(loaded, prompt + generated[:-1], [len(prompt) + 7])
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == generated


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_bf16_on_cpu(tmp_path, method):
    """The CPU's bfloat16 forms: int8 experts stay int8 (torch's int8 kernel), fp8 experts
    become bfloat16 weights; generation runs."""
    from radixlm.runtime import Engine

    from test_model_families import save_family

    folder = save_family(tmp_path, "mixtral")
    with Engine(str(folder), device="cpu", dtype="bfloat16", quantization=method,
                max_total_tokens=512) as engine:
        experts = engine.core.runner.model.model.layers[1].mlp.experts
        out = engine.generate(input_ids=[[5, 9, 33, 7, 120]],
                              sampling_params={"temperature": 0, "max_new_tokens": 6,
                                               "ignore_eos": True})
    want = torch.int8 if method == "int8" else torch.bfloat16
    assert experts.w13.dtype == want and experts.w2.dtype == want
    assert out[0].error is None and len(out[0].token_ids) == 6


# llm-compressor's FP8_DYNAMIC scheme as compressed-tensors writes it in config.json.
COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                    "dynamic": False, "group_size": None, "block_structure": None},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                              "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"]}


def save_fp8_checkpoint(src, dst, quantization_config: dict | None = None) -> None:
    """The float checkpoint in `src` as an FP8 checkpoint in `dst`: every decoder linear (the
    experts too) e4m3 with a per-channel weight_scale [rows, 1], experts with an input_scale
    (read past); routers, norms, embeddings and the head in float."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        linear = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if linear in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj", "w1", "w2", "w3"):
            q, scale = quantize_fp8_rows(tensor)
            out[name], out[name + "_scale"] = q, scale
            if ".experts." in name:
                out[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config or {
        "quant_method": "fp8", "activation_scheme": "dynamic",
        "ignored_layers": ["lm_head", "model.layers.0.mlp.gate"]}
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_fp8_checkpoint_matches_quantize_on_load(tmp_path, family):
    """An FP8 checkpoint (per-channel scales, as compressed-tensors and llm-compressor write
    them) gives the logits of its float weights quantized on load: quantize_fp8_rows maps each
    row's largest weight to 448, so quantizing the dequantized weights again finds the same
    values and scales."""
    from radixlm.runtime.models.loader import load_model

    from test_model_families import save_family
    from test_models import run_chunks

    folder = save_family(tmp_path / "float", family)
    save_fp8_checkpoint(folder, tmp_path / "fp8")
    fp8 = load_model(str(tmp_path / "fp8"), "auto", torch.float32, CPU)
    assert fp8.model.quant.prequantized
    # The float model of the checkpoint's values, quantized on load.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    deq = {name: tensor.float() * tensors[name + "_scale"] if tensor.dtype == FP8 else tensor
           for name, tensor in tensors.items() if not name.endswith(("_scale",))}
    save_file(deq, str(folder / "model.safetensors"))
    online = load_model(str(folder), "auto", torch.float32, CPU, quantization="fp8")
    ids = list(range(3, 60))
    assert rel_err(run_chunks(fp8, ids, [57]), run_chunks(online, ids, [57])) < 1e-5


def test_compressed_tensors_fp8_checkpoint_loads_like_fp8(tmp_path):
    """The same tensors under compressed-tensors' config (per-channel FP8 weights, dynamic
    per-token FP8 activations; routers ignored by a pattern): the same model."""
    from radixlm.runtime.models.loader import load_model

    from test_model_families import save_family
    from test_models import run_chunks

    folder = save_family(tmp_path / "float", "qwen3-moe")
    save_fp8_checkpoint(folder, tmp_path / "fp8")
    save_fp8_checkpoint(folder, tmp_path / "ct", COMPRESSED_TENSORS_FP8)
    ids = list(range(3, 40))
    logits = [run_chunks(load_model(str(tmp_path / name), "auto", torch.float32, CPU), ids,
                         [37]) for name in ("fp8", "ct")]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("change, message", [
    ({"format": "pack-quantized"}, "float-quantized"),
    ({"weights": {"strategy": "block", "block_structure": [128, 128]}}, "blocks"),
    ({"weights": {"type": "int", "num_bits": 4}}, "8-bit float"),
    ({"input_activations": None}, "weight-only"),
    ({"ignore": ["lm_head", "re:.*experts.*"]}, "matches decoder linears"),
])
def test_compressed_tensors_variants_we_cannot_run_are_refused(change, message):
    import copy

    from radixlm.runtime.models.quantization.quant_config import resolve_quant_config

    qc = copy.deepcopy(COMPRESSED_TENSORS_FP8)
    group = qc["config_groups"]["group_0"]
    for key, value in change.items():
        if key in ("weights",):
            group[key].update(value)
        elif key == "input_activations":
            group[key] = value
        else:
            qc[key] = value
    with pytest.raises(ValueError, match=message):
        resolve_quant_config(None, {"quantization_config": qc})
    assert resolve_quant_config("fp8", {"quantization_config": COMPRESSED_TENSORS_FP8}
                                ).prequantized
    with pytest.raises(ValueError, match="conflicts"):
        resolve_quant_config("int8", {"quantization_config": COMPRESSED_TENSORS_FP8})


def test_awq_and_gptq_moe_checkpoints_are_refused():
    from radixlm.runtime.models.architecture.model_config import ModelConfig
    from radixlm.runtime.models.moe import MoEForCausalLM

    from conftest import tiny_config
    from test_model_families import NEW_FAMILIES

    config = ModelConfig.from_dict({**tiny_config("llama"), **NEW_FAMILIES["qwen3-moe"]})
    quant = QuantConfig("awq", bits=4, group_size=128, prequantized=True)
    with torch.device("meta"), pytest.raises(ValueError, match="awq.*mixture-of-experts"):
        MoEForCausalLM(config, torch.float32, 64, quant)


# -- the fused kernel under the Triton interpreter (this file run as a script) ---------------

def _fused_case(method: str, tokens: int, experts: int, top_k: int, skew: bool = False) -> str:
    """fp32 activations (the interpreter does not emulate bf16 products): the kernel against
    the grouped path on the same quantized experts."""
    from radixlm.kernels.fused_moe import fused_moe

    x, q13, q2, s13, s2, weights, ids, _, _ = quantized_moe(tokens, experts, top_k, method,
                                                            skew=skew)
    out = fused_moe(x, q13, q2, weights, ids, s13, s2)
    want = grouped_moe(x, q13, q2, weights, ids, s13, s2)
    err = (out - want).abs().max().item()
    assert err < 1e-5 * want.abs().max().item(), f"max error {err:.2e}"
    return f"max err {err:.1e}"


def case_fp8_decode_top2():
    return _fused_case("fp8", 1, 8, 2)


def case_int8_decode_top2():
    return _fused_case("int8", 1, 8, 2)


def case_fp8_prefill_skewed():
    return _fused_case("fp8", 45, 8, 2, skew=True)


def case_int8_many_experts():
    return _fused_case("int8", 70, 32, 4)  # P = 280 pairs: 64-row blocks


def case_scales_must_match_the_weights():
    from radixlm.kernels.fused_moe import fused_moe

    x, q13, q2, s13, s2, weights, ids, w13, w2 = quantized_moe(3, 4, 2, "int8")
    for args in ((q13, q2, None, None), (w13, w2, s13, s2), (q13, q2, s13, None)):
        try:
            fused_moe(x, args[0], args[1], weights, ids, args[2], args[3])
        except ValueError:
            continue
        raise AssertionError("mismatched weights and scales were accepted")
    return "refused"


_CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def interpreter_results():
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", _CASES)
def test_quantized_fused_moe_under_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert result["ok"], result["detail"]


# -- GPU: bf16 activations, quantized experts, the kernel against the grouped path ------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 1024, 1792), (64, 8, 2, 1024, 1792), (300, 8, 2, 512, 896),
    (1, 128, 8, 512, 192), (200, 128, 8, 512, 192), (5, 16, 4, 320, 200)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_quantized_matches_grouped(method, tokens, experts, top_k, hidden, inter):
    """The fused kernel on e4m3 / int8 experts against the grouped torch path on the same
    experts (bf16 rounding of h and of the output apart: 2e-2 of the output's scale, as for
    bf16 experts), and against the float64 product of the dequantized weights. The last
    shape has N and K that are not multiples of the tiles."""
    from radixlm.kernels.fused_moe import fused_moe

    x, q13, q2, s13, s2, weights, ids, _, _ = quantized_moe(
        tokens, experts, top_k, method, hidden, inter, torch.bfloat16, "cuda",
        skew=tokens > 100)
    out = fused_moe(x, q13, q2, weights, ids, s13, s2)
    ref = grouped_moe(x, q13, q2, weights, ids, s13, s2)
    scale = ref.float().abs().max().item()
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref.float()).abs().max().item() < 2e-2 * scale
    deq13, deq2 = (dequantize_experts(q, s, torch.float64).cpu()
                   for q, s in ((q13, s13), (q2, s2)))
    exact = per_token_reference(x.cpu().double(), deq13, deq2, weights.cpu(), ids.cpu())
    assert (out.cpu().double() - exact).abs().max().item() < 2e-2 * scale


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_quantized_in_a_cuda_graph(method):
    """Captured once, replayed with new inputs and routings: the same as eager each time."""
    from radixlm.kernels.fused_moe import fused_moe

    x, q13, q2, s13, s2, weights, ids, _, _ = quantized_moe(4, 16, 4, method, 256, 128,
                                                            torch.bfloat16, "cuda")
    fused_moe(x, q13, q2, weights, ids, s13, s2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, q13, q2, weights, ids, s13, s2)
    for seed in (1, 2, 3):
        new = quantized_moe(4, 16, 4, method, 256, 128, torch.bfloat16, "cuda", seed=seed)
        x.copy_(new[0])
        weights.copy_(new[5])
        ids.copy_(new[6])
        graph.replay()
        assert torch.equal(out, fused_moe(x, q13, q2, weights, ids, s13, s2))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantized_model_fused_matches_grouped(tmp_path, method):
    """A tiny Qwen3-MoE quantized on load on CUDA: experts stay e4m3 / int8 on the GPU, and
    fp32 logits through the fused kernel equal those through the grouped path: to float32
    rounding for int8; for fp8 within 1e-2, since the other linears round their inputs to
    e4m3 per token, and an input that sits on a rounding boundary turns a float32-sized
    difference into one e4m3 step."""
    from test_gpu_models import _logits

    from radixlm.runtime.models.loader import load_model

    from test_model_families import save_family

    folder = save_family(tmp_path, "qwen3-moe")
    loaded = load_model(str(folder), "auto", torch.float32, torch.device("cuda"),
                        quantization=method)
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.w13.element_size() == 1 and experts.w13.is_cuda
    assert experts.kernel is not None
    ids = torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    fused = _logits(loaded, ids, [40, 1, 19], "triton")
    loaded.model.use_fused_kernels(False)
    grouped = _logits(loaded, ids, [40, 1, 19], "triton")
    assert rel_err(fused, grouped) < (1e-4 if method == "int8" else 1e-2)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantized_graph_decode_equals_eager_bf16(tmp_path, method):
    """Decode replayed from CUDA graphs gives the tokens of eager decode, in bf16. Two
    requests: every decode step has 1 or 2 rows, sizes that are captured as they are (no
    padding rows that would send the other linears down another product)."""
    from radixlm.runtime import Engine

    from test_model_families import save_family

    folder = save_family(tmp_path, "mixtral")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (90, 40)]
    params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}
    tokens = {}
    for graphs in (True, False):
        with Engine(str(folder), device="cuda", dtype="bfloat16", quantization=method,
                    max_total_tokens=4096, attention_backend="triton",
                    disable_cuda_graph=not graphs) as engine:
            assert (engine.core.runner.cuda_graphs is not None) == graphs
            tokens[graphs] = [o.token_ids for o in engine.generate(input_ids=prompts,
                                                                   sampling_params=params)]
    assert tokens[True] == tokens[False]


if __name__ == "__main__":
    main(globals())
