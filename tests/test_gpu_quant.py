"""Quantized linears on CUDA (run on the GPU machine: `pytest -m gpu`). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.reference import w4a16_matmul_reference
from radixlm.runtime import Engine
from radixlm.runtime.quantization.fp8 import fp8_linear, quantize_fp8_rows, scaled_mm_available
from radixlm.runtime.quantization.packing import pack_gptq_weight

from conftest import save_tiny_hf_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 300])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (1536, 576, 128), (576, 1536, 64)])
def test_w4a16_kernel_bf16(m, n, k, group):
    from radixlm.kernels.w4a16 import w4a16_matmul

    gen = torch.Generator().manual_seed(m)
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    qweight = pack_gptq_weight(q, 4).cuda()
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).bfloat16().cuda()
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.uint8).cuda()
    x = torch.randn(m, k, generator=gen).bfloat16().cuda()
    out = w4a16_matmul(x, qweight, scales, zeros, group)
    assert rel_err(out, w4a16_matmul_reference(x, qweight, scales, zeros, group)) < 5e-3


def test_fp8_scaled_mm_agrees_with_the_cpu_fallback():
    if not scaled_mm_available(torch.device("cuda")):
        pytest.skip("no fp8 tensor cores (needs compute capability 8.9+)")
    gen = torch.Generator().manual_seed(0)
    w8, scale = quantize_fp8_rows(torch.randn(1024, 512, generator=gen))
    for m in (1, 7, 128):
        x = torch.randn(m, 512, generator=gen).bfloat16()
        cpu = fp8_linear(x.float(), w8, scale.view(-1), use_scaled_mm=False)
        gpu = fp8_linear(x.cuda(), w8.cuda(), scale.view(-1).cuda())
        assert rel_err(gpu.cpu(), cpu) < 1e-2


def test_per_token_fp8_kernel_matches_the_torch_rule():
    from radixlm.kernels.fp8 import per_token_fp8

    x = torch.randn(37, 1536, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = per_token_fp8(x)
    want_q, want_scale = quantize_fp8_rows(x)
    assert torch.allclose(scale, want_scale, rtol=1e-6)
    # e4m3 values agree but for rare ties at rounding boundaries (x / scale may differ by an
    # ulp between the two divisions).
    assert (q.float() != want_q.float()).float().mean() < 1e-3


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_engine_online_quantization_on_cuda_matches_cpu(tmp_path, quantization):
    folder = save_tiny_hf_model(tmp_path, "llama")
    prompts = [[5 + i, 17, 99, 3 + i * 7] * (i + 1) for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, "logprobs": True}
    outs = {}
    for device in ("cpu", "cuda"):
        with Engine(str(folder), device=device, dtype="float32", max_total_tokens=2048,
                    quantization=quantization) as engine:
            outs[device] = engine.generate(input_ids=prompts, sampling_params=params)
    if quantization == "int8":  # the same float32 function on both: the same tokens
        assert [o.token_ids for o in outs["cuda"]] == [o.token_ids for o in outs["cpu"]]
    # fp8's CUDA product rounds its output to bf16: compare the first step's choice and odds.
    for cuda, cpu in zip(outs["cuda"], outs["cpu"]):
        assert cuda.token_ids[0] == cpu.token_ids[0]
        assert abs(cuda.logprobs[0].logprob - cpu.logprobs[0].logprob) < 2e-2


def test_engine_awq_checkpoint_on_cuda_matches_cpu(tmp_path):
    """Our AWQ checkpoint through the Triton kernel (decode steps in CUDA graphs) gives the
    greedy tokens of the CPU dequantize-and-multiply path, in float32."""
    import transformers

    from radixlm.runtime.loader import load_model
    from radixlm.runtime.quantization.checkpoint import save_quantized
    from radixlm.runtime.quantization.quantize import QuantizeOptions, quantize_model

    from conftest import tiny_config

    cfg = tiny_config("llama")
    cfg.update(hidden_size=256, intermediate_size=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg)).save_pretrained(tmp_path / "float")
    model = load_model(str(tmp_path / "float"), "auto", torch.float32, torch.device("cpu"))
    options = QuantizeOptions(method="rtn", group_size=128)
    results = quantize_model(model.model, None, options)
    out = save_quantized(model.model, results, options, "awq", None, tmp_path / "awq")
    prompts = [[5 + i, 17, 99, 3 + i * 7] * (i + 1) for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    tokens = {}
    for device in ("cpu", "cuda"):
        with Engine(str(out), device=device, dtype="float32", max_total_tokens=2048) as engine:
            tokens[device] = [o.token_ids for o in engine.generate(input_ids=prompts,
                                                                   sampling_params=params)]
    assert tokens["cuda"] == tokens["cpu"]
