"""The float8 KV cache option (kv_cache_dtype) on CPU: storage, attention over it, pool size,
checkpoint scales and the engine end to end. The Triton kernels' side is in
test_triton_kernels.py (interpreter) and test_gpu_attention.py (GPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlm.kernels.reference import paged_attention_reference
from radixlm.runtime import Engine
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.kv_cache import KVCache, quantize_kv
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.engine.kv_sizing import pool_pages
from radixlm.runtime.models.architecture.model_config import ModelConfig

from conftest import save_tiny_hf_model
from test_attention import make_batch

E4M3 = torch.float8_e4m3fn


def test_store_saturates_and_reads_back_scaled():
    cache = KVCache(2, 8, 1, 4, torch.float32, torch.device("cpu"), storage_dtype=E4M3)
    cache.set_scales([1.0, 0.25], [1.0, 4.0])
    k = torch.tensor([[[1.0, -3.0, 1000.0, -1e6]]] * 2)
    v = torch.tensor([[[0.5, 2.0, 8.0, -96.0]]] * 2)  # all exact in e4m3 at scale 4
    cache.store(1, torch.tensor([3, 5]), k, v)
    stored = cache.k[1][3].float()
    assert not stored.isnan().any()  # e4m3 has no infinity: an unclamped overflow is NaN
    assert stored.abs().max().item() == torch.finfo(E4M3).max
    back = cache.dequantize(cache.k[1][[3, 5]], 0.25)
    assert back.dtype == torch.float32
    assert torch.equal(back[0, 0, :2], torch.tensor([1.0, -3.0]))  # exact in e4m3 at 1/4
    assert torch.equal(cache.dequantize(cache.v[1][[5]], 4.0)[0, 0], v[1, 0])
    assert cache.k[0].view(torch.uint8).sum() == 0  # other layers untouched


def test_quantize_kv_does_not_touch_its_input():
    x = torch.tensor([1000.0, 1.0])
    quantize_kv(x, 1.0, E4M3)
    assert x[0] == 1000.0


@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_backend_over_fp8_cache_matches_reference(page_size):
    q_lens, kv_lens = [1, 20, 9, 1, 16], [37, 20, 50, 1, 64]
    batch, q, k, v = make_batch("cpu", torch.float32, page_size, q_lens, kv_lens)
    cache = batch.kv_cache
    fp8 = KVCache(1, cache.num_slots, 2, 32, torch.float32, torch.device("cpu"), page_size,
                  E4M3)
    fp8.k.copy_(cache.k.to(E4M3))
    fp8.v.copy_(cache.v.to(E4M3))
    fp8.set_scales([0.5], [2.0])
    batch.kv_cache = fp8
    backend = create_backend("torch", scale=32 ** -0.5)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch)
    # This step's K/V were quantized too: the reference reads the whole dequantized cache,
    # so the fresh prompt (q_len == kv_len) attends to rounded keys like everything else.
    ref = paged_attention_reference(q, fp8.k[0].float() * 0.5, fp8.v[0].float() * 2.0,
                                    batch.slot_table, q_lens, kv_lens, 32 ** -0.5)
    assert (out - ref).abs().max().item() < 1e-5
    assert (fp8.k[0][batch.out_slots].float() * 0.5 - k).abs().max() < 0.1 * k.abs().max()


def test_option_validated_and_pool_holds_twice_the_tokens():
    from radixlm.runtime.attention.kv_cache import KV_CACHE_DTYPES
    from radixlm.runtime.config.engine_config import KV_CACHE_DTYPES as NAMES

    assert NAMES == ("auto", *KV_CACHE_DTYPES)  # the config's names are the cache's types
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    mc = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=512, max_position_embeddings=1024))
    cpu = torch.device("cpu")
    plain = pool_pages(EngineConfig(), [mc], torch.bfloat16, cpu)
    fp8 = pool_pages(EngineConfig(kv_cache_dtype="fp8_e4m3"), [mc], torch.bfloat16, cpu)
    assert fp8 == 2 * plain


def test_fp8_attention_asks_for_what_it_needs():
    """fp8_attention multiplies the query by an e4m3 cache's keys in our Triton decode
    kernel: any other cache, backend or the deterministic mode is a ValueError naming the
    field; on a CPU engine (torch attention) it is refused when the backend is chosen."""
    from radixlm.runtime.attention import create_backend

    EngineConfig(kv_cache_dtype="fp8_e4m3", fp8_attention=True)
    for bad, field in (({}, "kv_cache_dtype"), ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
                       ({"kv_cache_dtype": "fp8_e4m3", "attention_backend": "flashinfer"},
                        "attention_backend"),
                       ({"kv_cache_dtype": "fp8_e4m3", "deterministic": True}, "deterministic"),
                       ({"kv_cache_dtype": "fp8_e4m3", "fp8_attention": 1}, "fp8_attention")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**({"fp8_attention": True} | bad))
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        create_backend("auto", 1.0, torch.device("cpu"), torch.bfloat16, 64,
                       fp8_attention=True)


def test_checkpoint_scales_reach_the_cache(tmp_path):
    folder = save_tiny_hf_model(tmp_path / "m", "llama")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([3.0])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with Engine(str(folder), device="cpu", max_total_tokens=256,
                kv_cache_dtype="fp8_e4m3") as engine:
        cache = engine.core.kv_cache
        assert cache.k_scale == [0.5, 1.0] and cache.v_scale == [1.0, 3.0]
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 3,
                                                                      "temperature": 0})
        assert len(out[0].token_ids) == 3
    with Engine(str(folder), device="cpu", max_total_tokens=256) as engine:  # float cache
        assert engine.core.kv_cache.k.dtype == torch.float32


def test_engine_fp8_kv_close_to_float_on_the_real_model(default_model_folder):
    """SmolLM2 in float32 with an e4m3 cache against the float cache: most greedy tokens agree
    and the logprobs of the tokens the float run picked move little (docs/performance.md has
    the measured figures)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = {"temperature": 0, "max_new_tokens": 12, "logprobs": True, "ignore_eos": True}
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        with Engine(str(default_model_folder), device="cpu", dtype="float32",
                    max_total_tokens=2048, kv_cache_dtype=kv) as engine:
            runs[kv] = engine.generate(prompts, sampling_params=params)
    same_first = sum(a.token_ids[0] == b.token_ids[0]
                     for a, b in zip(runs["auto"], runs["fp8_e4m3"]))
    assert same_first == len(prompts)
    gaps = [abs(x.logprob - y.logprob) for a, b in zip(runs["auto"], runs["fp8_e4m3"])
            for x, y in zip(a.logprobs[:1], b.logprobs[:1])]
    assert max(gaps) < 0.5, gaps


def test_fp8_kv_with_tensor_parallelism_matches_one_rank(tmp_path):
    """Each rank stores its own KV heads in float8: TP=2 gives TP=1's greedy tokens."""
    folder = save_tiny_hf_model(tmp_path / "m", "llama")
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    tokens = {}
    for tp in (1, 2):
        with Engine(str(folder), device="cpu", dtype="float32", max_total_tokens=512,
                    tp_size=tp, kv_cache_dtype="fp8_e4m3") as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            tokens[tp] = [o.token_ids for o in outs]
    assert tokens[2] == tokens[1]
