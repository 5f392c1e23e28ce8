"""The engine on CUDA (run on the GPU machine: `pytest -m gpu`). Skipped without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.models.loader import load_model

from conftest import save_tiny_hf_model
from test_disk_tier import check_tiers_against_a_model
from test_models import run_chunks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_on_cuda_match_transformers(tmp_path, family):
    import transformers

    folder = save_tiny_hf_model(tmp_path, family)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(3, 512, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits[0]
    loaded = load_model(str(folder), "auto", torch.float32, torch.device("cuda"))
    ours = run_chunks(loaded, ids[0].tolist(), [40, 1, 59]).cpu()
    assert (ours - ref).abs().max().item() < 1e-3


def test_greedy_is_the_same_on_cuda_and_cpu(tmp_path):
    folder = save_tiny_hf_model(tmp_path, "llama")
    prompts = [[5 + i, 17, 99, 3 + i * 7] * (i + 1) for i in range(6)]
    params = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    results = []
    for device in ("cpu", "cuda"):
        with Engine(str(folder), device=device, dtype="float32", max_total_tokens=2048,
                    chunked_prefill_size=8) as engine:
            results.append([o.token_ids for o in engine.generate(input_ids=prompts,
                                                                 sampling_params=params)])
            stats = engine.stats()
            assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert results[0] == results[1]


def test_llama3_8b_shape_bf16_runs():
    # triton: FlashInfer's prefill kernels would first compile for a minute and a half.
    with Engine("llama-3-8b", load_format="dummy", device="cuda", attention_backend="triton",
                max_total_tokens=65536) as engine:
        prompts = [[1000 + i] * (50 + 10 * i) for i in range(16)]
        params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
        engine.generate(input_ids=prompts[:2], sampling_params=params)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
        assert all(o.completion_tokens == 32 for o in outs)
        stats = engine.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
        print(f"llama-3-8b shape, bf16, triton attention: 16 x 32 tokens in {elapsed:.2f} s "
              f"({16 * 32 / elapsed:.0f} tokens/s)")


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
def test_float_gemv_at_8b_shapes_eager_and_in_a_graph(n, k):
    """The small-batch GEMV (launched with PDL on Hopper) at Llama-3-8B's o and down shapes
    against float32 products, eager and replayed in a CUDA graph after its input changed."""
    from radixlm.kernels.gemv import gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5

    def check(x, out):
        want = x.float() @ weight.float().T
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 5e-3, f"{x.shape[0]} rows: {err:.1e}"

    for rows in (1, 4, 16):
        x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        check(x, gemv(x, weight))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = gemv(x, weight)
        # square: the second product reads the first's output, so PDL must order them
        second = gemv(first if k == n else x, weight)
    x.copy_(torch.randn(x.shape, device="cuda", generator=gen, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    check(x, first)
    check(first if k == n else x, second)


@pytest.mark.parametrize("tiers", ["host", "host over disk"])
def test_the_host_tier_on_cuda_against_a_model(tmp_path, tiers):
    """Pages stored and loaded by the side stream, slots reused: every cached page holds its
    prefix's KV."""
    for seed in range(3):
        check_tiers_against_a_model(tmp_path / str(seed), seed, tiers, "cuda")


def test_the_host_tier_on_cuda_gives_the_tokens_of_computing(tmp_path):
    """A pool that holds one prompt's prefix at a time: with the host tier the other's comes
    back over PCIe, and the greedy tokens are those of an engine that computes everything."""
    folder = save_tiny_hf_model(tmp_path, "llama")
    prompts = [[5 + i % 7, 17, 99, 3 + i] * 40 for i in range(2)] * 3
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = []
    for host_gb in (0, 0.05):
        with Engine(str(folder), device="cuda", dtype="float32", max_total_tokens=256,
                    max_running_requests=1, deterministic=True,
                    host_cache_gb=host_gb) as engine:
            results.append([engine.generate(input_ids=p, sampling_params=params).token_ids
                            for p in prompts])
            stats = engine.stats()
            assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert results[0] == results[1]
    assert stats["host_hit_tokens"] >= 2 * 128
