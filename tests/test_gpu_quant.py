"""Quantized linears on CUDA (run on the GPU machine: `pytest -m gpu`). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.reference import w4a16_matmul_reference
from radixlm.runtime import Engine
from radixlm.runtime.models.quantization.fp8 import (
    GEMV_ROWS,
    fp8_linear,
    quantize_fp8_rows,
    scaled_mm_available,
)
from radixlm.runtime.models.quantization.packing import pack_gptq_weight

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


# The decoder linears of Llama-3-8B as (N, K): qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _int_weight(n: int, k: int, group: int, bits: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2 ** bits, (k, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).bfloat16()
    zeros = torch.randint(0, 2 ** bits, (groups, n), generator=gen).to(torch.uint8)
    return pack_gptq_weight(q, bits).cuda(), scales.cuda(), zeros.cuda()


def _split_counters_are_zero() -> bool:
    from radixlm.kernels import split_k

    return all(not b.counters.any() for b in split_k._BUFFERS.values())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", SHAPES_8B)
def test_int_gemv_at_8b_shapes_bf16(n, k, bits):
    """The one-launch GEMV (the rule's tiling, and whatever pick_config chooses) at batch 1-4
    against the reference; a second call is bit-identical and leaves the split-K counters at
    zero."""
    from radixlm.kernels.w4a16 import gemv_config, w4a16_matmul

    group = 128 if bits == 4 else k
    qweight, scales, zeros = _int_weight(n, k, group, bits)
    for m in (1, 2, 3, 4):
        rule = gemv_config(m, n, k, group, bits, qweight.device)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        # The float32 function (the GEMV does not round the dequantized weight to bf16).
        want = w4a16_matmul_reference(x.float(), qweight, scales.float(), zeros, group, bits)
        for config in (rule, None):
            out = w4a16_matmul(x, qweight, scales, zeros, group, bits, config=config)
            assert rel_err(out, want) < 5e-3
            again = w4a16_matmul(x, qweight, scales, zeros, group, bits, config=config)
            assert torch.equal(out, again)
            assert _split_counters_are_zero()


@pytest.mark.parametrize("fresh_shape", [False, True])
def test_split_k_gemvs_replay_in_cuda_graphs(fresh_shape):
    """Both GEMVs with K split, captured in one graph: replays give the eager results exactly
    and leave every counter at zero. fresh_shape: the split-K buffers are first made during
    the capture (the kernels themselves are compiled before, on another shape)."""
    from radixlm.kernels.fp8 import fp8_gemv
    from radixlm.kernels.w4a16 import w4a16_matmul

    if not scaled_mm_available(torch.device("cuda")):
        pytest.skip("no native e4m3 conversions (needs compute capability 8.9+)")
    int_cfg = dict(KERNEL="gemv", BLOCK_N=128, BLOCK_W=16, SPLIT_K=8, num_warps=4)
    fp8_cfg = dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, num_warps=4)

    def runner(n: int, k: int):
        qweight, scales, zeros = _int_weight(n, k, 128, 4, seed=1)
        w8, w_scale = quantize_fp8_rows(torch.randn(n, k, device="cuda"))
        x = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            x8, x_scale = quantize_fp8_rows(x)
            return (w4a16_matmul(x, qweight, scales, zeros, 128, 4, config=int_cfg),
                    fp8_gemv(x8, x_scale, w8, w_scale.view(-1), torch.bfloat16, config=fp8_cfg))
        return run

    warm = runner(4096, 4096)
    warm()  # compiles the kernels (and makes this shape's buffers)
    run = runner(2048, 6144) if fresh_shape else warm
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        eager = run()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))
        assert _split_counters_are_zero()


@pytest.mark.parametrize("n, k", SHAPES_8B)
def test_fp8_gemv_at_8b_shapes_bf16(n, k):
    """The fp8 GEMV computes _scaled_mm's function (up to the order of float32 additions),
    and fp8_linear sends batches of up to GEMV_ROWS rows to it."""
    if not scaled_mm_available(torch.device("cuda")):
        pytest.skip("no fp8 tensor cores (needs compute capability 8.9+)")
    from radixlm.kernels.fp8 import fp8_gemv, per_token_fp8

    w8, w_scale = quantize_fp8_rows(torch.randn(n, k, device="cuda"))
    w_scale = w_scale.view(-1)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x8, x_scale = per_token_fp8(x)
        out = fp8_gemv(x8, x_scale, w8, w_scale, torch.bfloat16)
        want = (x8.float() * x_scale) @ (w8.float() * w_scale[:, None]).t()
        assert rel_err(out, want) < 5e-3
        scaled_mm = fp8_linear(x, w8, w_scale, use_scaled_mm=True)
        assert rel_err(out, scaled_mm) < 5e-3
        routed = out if m <= GEMV_ROWS else scaled_mm  # small batches take the GEMV
        assert torch.equal(fp8_linear(x, w8, w_scale), routed)
        assert _split_counters_are_zero()


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

    from radixlm.runtime.models.loader import load_model
    from radixlm.runtime.quantize.checkpoint import save_quantized
    from radixlm.runtime.quantize.model_quantizer import QuantizeOptions, quantize_model

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
