"""The triton and flashinfer attention backends on CUDA (run on the GPU machine: `pytest -m gpu`).

Kernel level: each backend against torch-native attention in float32 on random paged layouts
(mixed decode + prefill batches, cached prefixes, long contexts, page sizes 1 and 16).
Engine level: greedy tokens with each backend against attention_backend="torch".
FlashInfer kernels are compiled on first use (minutes): the tests stick to bf16, head_dim 128.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.torch_native import TorchNativeAttention

from test_triton_kernels import PROMPTS, random_paged_batch, rel_err, save_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYOUTS = {
    # decode over short and long contexts, fresh prompts, chunks after cached prefixes
    "mixed": ([1, 300, 17, 1, 64, 129, 1, 1], [1200, 300, 500, 1, 64, 2177, 4097, 33]),
    "long_decode": ([1] * 24, [64 + 331 * i for i in range(24)]),
    "prefill": ([512, 200, 1000, 3], [512, 1000, 3000, 7]),
}


def make_backend(name: str, scale: float):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    return create_backend(name, scale)


def run_against_torch(name: str, dtype: torch.dtype, page_size: int, layout: str,
                      heads: int = 32, kv_heads: int = 8, dim: int = 128) -> float:
    q_lens, kv_lens = LAYOUTS[layout]
    batch, q, k, v = random_paged_batch("cuda", dtype, page_size, q_lens, kv_lens, heads,
                                        kv_heads, dim, strided_qkv=True)
    backend = make_backend(name, dim ** -0.5)
    backend.plan(batch)
    torch.cuda.synchronize()  # keep the copy below out of the backend's step
    out = backend.forward(q, k, v, 0, batch)
    assert torch.equal(batch.kv_cache.k[0][batch.out_slots], k)
    # The reference: torch-native attention in float32 over the same (now stored) cache.
    batch.kv_cache.k = batch.kv_cache.k.float()
    batch.kv_cache.v = batch.kv_cache.v.float()
    ref_backend = TorchNativeAttention(dim ** -0.5)
    ref_backend.plan(batch)
    ref = ref_backend.forward(q.float(), k.float(), v.float(), 0, batch)
    assert torch.isfinite(out).all()
    return rel_err(out, ref)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_backend_matches_torch_native_bf16(name, page_size, layout):
    assert run_against_torch(name, torch.bfloat16, page_size, layout) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.float32, 1e-5)])
def test_triton_other_dtypes(dtype, tol):
    assert run_against_torch("triton", dtype, 16, "mixed") < tol


@pytest.mark.parametrize("heads,kv_heads", [(9, 9), (16, 2)])
def test_triton_head_dim_64_and_groups(heads, kv_heads):
    assert run_against_torch("triton", torch.bfloat16, 1, "mixed", heads, kv_heads, 64) < 1e-2


def test_triton_split_counts_agree():
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = random_paged_batch("cuda", torch.float32, 16, [1] * 4,
                                        [5000, 17, 2048, 1], 32, 8, 128)
    outs = []
    for splits in (1, 3, 16):
        backend = TritonAttention(128 ** -0.5, num_splits=splits)
        backend.plan(batch)
        outs.append(backend.forward(q, k, v, 0, batch))
    assert rel_err(outs[1], outs[0]) < 1e-6 and rel_err(outs[2], outs[0]) < 1e-6


def generate(folder, backend: str, dtype: str, page_size: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(str(folder), device="cuda", dtype=dtype, max_total_tokens=4096,
                chunked_prefill_size=16, page_size=page_size,
                attention_backend=backend) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
        stats = engine.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_triton_fp32_greedy_matches_torch(tmp_path, page_size):
    folder = save_llama(tmp_path)
    assert generate(folder, "triton", "float32", page_size) == \
        generate(folder, "torch", "float32", page_size)


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_engine_bf16_close_to_torch(tmp_path, name):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
    folder = save_llama(tmp_path)
    ours = generate(folder, name, "bfloat16", 16)
    ref = generate(folder, "torch", "bfloat16", 16)
    # bf16 rounding differs between kernels, so a near-tie may flip a token and the rest of
    # that sequence with it; the first tokens must agree and most sequences entirely.
    assert sum(a[0] == b[0] for a, b in zip(ours, ref)) >= len(ref) - 1
    assert sum(a == b for a, b in zip(ours, ref)) >= len(ref) // 2


# FlashInfer compiles each KV dtype's kernels on first use (minutes): e4m3 only there, on its
# prefill (mixed) and decode (long_decode) kernels.
@pytest.mark.parametrize("name,storage,layout", [
    ("triton", torch.float8_e4m3fn, "mixed"), ("triton", torch.float8_e5m2, "mixed"),
    ("flashinfer", torch.float8_e4m3fn, "mixed"),
    ("flashinfer", torch.float8_e4m3fn, "long_decode")])
def test_fp8_cache_matches_dequantized_reference(name, storage, layout):
    """A float8 cache with per-layer scales: the stored bytes are torch's saturating cast of
    x / scale (the GPU's conversion, not an emulation of it), and attention equals float32
    attention over the dequantized cache."""
    from radixlm.runtime.attention.kv_cache import quantize_kv

    q_lens, kv_lens = LAYOUTS[layout]
    batch, q, k, v = random_paged_batch("cuda", torch.bfloat16, 16, q_lens, kv_lens, 32, 8,
                                        128, strided_qkv=True, storage_dtype=storage)
    cache = batch.kv_cache
    cache.set_scales([0.5], [2.0])
    k = k * 300.0  # some keys past e4m3's range: saturated, never NaN
    backend = make_backend(name, 128 ** -0.5)
    backend.plan(batch)
    torch.cuda.synchronize()
    out = backend.forward(q, k, v, 0, batch)
    for stored, x, scale in ((cache.k, k, 0.5), (cache.v, v, 2.0)):
        want = quantize_kv(x, scale, storage)
        assert torch.equal(stored[0][batch.out_slots].view(torch.uint8), want.view(torch.uint8))
    cache.k = cache.k.float() * 0.5
    cache.v = cache.v.float() * 2.0
    cache.storage_dtype = cache.dtype = torch.float32
    ref_backend = TorchNativeAttention(128 ** -0.5)
    ref_backend.plan(batch)
    # A whole prompt's own keys are the rounded ones too (the reference would take k as given)
    stored_k, stored_v = cache.k[0][batch.out_slots], cache.v[0][batch.out_slots]
    ref = ref_backend.forward(q.float(), stored_k, stored_v, 0, batch, kv_stored=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_v_read_as_pairs_equals_byte_reads(storage):
    """The decode kernel reads a float8 V as int16 pairs under a bf16 query and widens the
    bytes itself (triton_decode; e4m3 by the pairwise conversion instruction or, with
    fp8_v_cvt off, by integer ops): the output of reading V as float8, split or not, up to
    the compiler's choice of fused multiply-adds (measured ~3e-5 apart on an H200)."""
    from radixlm.kernels.triton_attention import DecodeConfig
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = random_paged_batch("cuda", torch.bfloat16, 16, [1] * 6,
                                        [1, 17, 300, 1088, 2048, 4000], 32, 8, 128,
                                        storage_dtype=storage)
    batch.kv_cache.set_scales([0.5], [2.0])
    for splits in (1, 7):
        outs = []
        for config in (DecodeConfig(), DecodeConfig(fp8_v_cvt=False),
                       DecodeConfig(fp8_v_pairs=False)):
            backend = TritonAttention(128 ** -0.5, num_splits=splits, decode_config=config)
            backend.plan(batch)
            outs.append(backend.forward(q, k, v, 0, batch))
        assert torch.isfinite(outs[0]).all()
        for other in outs[1:]:
            assert rel_err(outs[0], other) < 1e-3, f"splits {splits}"


def test_fp8_qk_equals_the_reference_over_the_rounded_query():
    """DecodeConfig(fp8_qk=True): random bf16 queries, each head scaled by its max |q| / 448
    and rounded to e4m3, times the e4m3 keys on the tensor cores. The output must be the
    float32 reference's over that rounded query and the dequantized cache (up to V's float16
    products and the bf16 output), split or not, and closer to it than the default path's."""
    from radixlm.kernels.reference import paged_attention_reference
    from radixlm.kernels.triton_attention import DecodeConfig, store_kv
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = random_paged_batch("cuda", torch.bfloat16, 16, [1] * 6,
                                        [1, 17, 300, 1088, 2048, 4000], 32, 8, 128,
                                        storage_dtype=torch.float8_e4m3fn)
    batch.kv_cache.set_scales([0.5], [2.0])
    # forward stores the step's own keys and values first: the reference reads them after
    store_kv(k, v, batch.out_slots, *batch.kv_cache.layer(0), *batch.kv_cache.scales(0))
    q_scale = q.float().abs().amax(-1, keepdim=True) / 448.0
    q_rounded = (q.float() / q_scale).to(torch.float8_e4m3fn).float() * q_scale
    cache = batch.kv_cache
    ref = paged_attention_reference(q_rounded, cache.k[0].float() * 0.5,
                                    cache.v[0].float() * 2.0, batch.slot_table, batch.q_lens,
                                    batch.kv_lens, 128 ** -0.5)
    for splits in (1, 7):
        outs = []
        for fp8_qk in (True, False):
            backend = TritonAttention(128 ** -0.5, num_splits=splits,
                                      decode_config=DecodeConfig(fp8_qk=fp8_qk))
            backend.plan(batch)
            outs.append(backend.forward(q, k, v, 0, batch))
        err = rel_err(outs[0], ref)
        assert err < 5e-3, f"splits {splits}: {err:.1e} from the rounded query's reference"
        # the default path, which multiplies the unrounded query, is further from it
        assert rel_err(outs[1], ref) > 1.5 * err, "the query was not rounded"


def test_fused_rotary_store_fp8_same_bytes_as_backend_store():
    """On the GPU too: the fused rotary + K/V store writes the bytes rotary + store_kv write."""
    from radixlm.kernels import fused
    from radixlm.kernels.triton_attention import store_kv
    from radixlm.runtime.attention.kv_cache import KVCache

    gen = torch.Generator("cuda").manual_seed(4)
    qkv = torch.randn(64, 48, 128, generator=gen, device="cuda", dtype=torch.bfloat16) * 30
    cos = torch.randn(64, 1, 64, generator=gen, device="cuda")
    sin = torch.randn(64, 1, 64, generator=gen, device="cuda")
    slots = torch.randperm(256, generator=gen, device="cuda")[:64]
    caches = [KVCache(1, 256, 8, 128, torch.bfloat16, torch.device("cuda"),
                      storage_dtype=torch.float8_e4m3fn) for _ in range(2)]
    a, b = qkv.clone(), qkv.clone()
    fused.rotary_and_store(a[:, :40], a[:, 40:], cos, sin, 32, *caches[0].layer(0), slots)
    fused.rotary_embedding(b[:, :40], cos, sin, out=b[:, :40])
    store_kv(b[:, 32:40], b[:, 40:], slots, *caches[1].layer(0))
    assert torch.equal(a, b)
    for got, want in zip(caches[0].layer(0), caches[1].layer(0)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_engine_fp8_kv_triton_greedy_matches_torch_fp32(tmp_path):
    """The same float8 cache under both backends: identical greedy tokens (fp32 compute, so
    only the cache's rounding differs from the float run, and it is the same for both)."""
    folder = save_llama(tmp_path)
    tokens = {}
    for backend in ("triton", "torch"):
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        with Engine(str(folder), device="cuda", dtype="float32", max_total_tokens=4096,
                    chunked_prefill_size=16, attention_backend=backend,
                    kv_cache_dtype="fp8_e4m3") as engine:
            assert engine.core.kv_cache.k.dtype == torch.float8_e4m3fn
            tokens[backend] = [o.token_ids for o in engine.generate(input_ids=PROMPTS,
                                                                    sampling_params=params)]
    assert tokens["triton"] == tokens["torch"]
