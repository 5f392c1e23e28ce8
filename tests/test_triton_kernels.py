"""Our Triton kernels on CPU, under the Triton interpreter, against kernels/reference.py.

TRITON_INTERPRET must be set before the kernels are defined, and setting it in this process
would leak into every later test (GPU tests included). So the cases run in one subprocess with
the variable set (python tests/test_triton_kernels.py), which reports each case's outcome as
JSON; each test below asserts one case. bfloat16 arithmetic is not emulated correctly by the
interpreter (triton 3.9), so bf16 is covered by the GPU tests only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interpreter_cases import collect_cases, main, results_under_interpreter

SCALE_DIM = {32: 32 ** -0.5, 64: 64 ** -0.5, 128: 128 ** -0.5}


def random_paged_batch(device: str, dtype: torch.dtype, page_size: int, q_lens: list[int],
                       kv_lens: list[int], heads: int = 8, kv_heads: int = 2, dim: int = 32,
                       seed: int = 0, strided_qkv: bool = False,
                       storage_dtype: torch.dtype | None = None):
    """A one-layer KV cache full of random "earlier" keys, each sequence on shuffled pages, and
    this step's q/k/v. With strided_qkv, q/k/v are views of one fused [T, H + 2 Hkv, D] tensor,
    as the model passes them."""
    from radixlm.runtime.attention.backend import ForwardBatch
    from radixlm.runtime.attention.kv_cache import KVCache

    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-kv // page_size) for kv in kv_lens) + 4
    cache = KVCache(1, num_pages * page_size, kv_heads, dim, dtype, torch.device(device),
                    page_size, storage_dtype)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    perm = torch.randperm(num_pages, generator=gen).tolist()
    width = max(kv_lens)
    table = torch.zeros(len(q_lens), -(-width // page_size) * page_size, dtype=torch.int64)
    for i, kv_len in enumerate(kv_lens):
        pages = torch.tensor([perm.pop() for _ in range(-(-kv_len // page_size))])
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
        table[i, : slots.numel()] = slots
    table = table[:, :width].to(device)
    out_slots = torch.cat([table[i, kv - q:kv] for i, (q, kv) in enumerate(zip(q_lens, kv_lens))])
    total = sum(q_lens)
    qkv = torch.randn(total, heads + 2 * kv_heads, dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    if not strided_qkv:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    zeros = torch.zeros(total, dtype=torch.int64, device=device)
    batch = ForwardBatch(input_ids=zeros, positions=zeros, q_lens=q_lens, kv_lens=kv_lens,
                         out_slots=out_slots, slot_table=table, kv_cache=cache)
    return batch, q, k, v


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_for(batch, q: torch.Tensor, scale: float) -> torch.Tensor:
    from radixlm.kernels.reference import paged_attention_reference

    return paged_attention_reference(q, batch.kv_cache.k[0], batch.kv_cache.v[0],
                                     batch.slot_table, batch.q_lens, batch.kv_lens, scale)


def _backend_case(dtype, page_size, q_lens, kv_lens, heads=8, kv_heads=2, dim=32, splits=None,
                  strided=False, tol=None):
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = random_paged_batch("cpu", dtype, page_size, q_lens, kv_lens, heads,
                                        kv_heads, dim, strided_qkv=strided)
    backend = TritonAttention(SCALE_DIM[dim], num_splits=splits)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch)
    # The backend stored this step's K/V; the reference reads everything from the cache.
    assert torch.equal(batch.kv_cache.k[0][batch.out_slots], k), "K not stored"
    assert torch.equal(batch.kv_cache.v[0][batch.out_slots], v), "V not stored"
    err = rel_err(out, reference_for(batch, q, SCALE_DIM[dim]))
    limit = tol or (1e-5 if dtype == torch.float32 else 2e-3)
    assert err < limit, f"relative error {err:.2e} >= {limit}"
    return f"rel err {err:.1e}, splits {backend.num_splits}"


# decode (1 new of 37), a fresh prompt (all 20 new), a later chunk (9 new of 50), a decode
# with a 1-token context, a chunk ending on a page boundary, a chunk crossing several
# key tiles after a long prefix, and a decode over a longer context.
MIXED_Q = [1, 20, 9, 1, 16, 70, 1]
MIXED_KV = [37, 20, 50, 1, 64, 260, 300]


def case_mixed_page1_fp32():
    return _backend_case(torch.float32, 1, MIXED_Q, MIXED_KV)


def case_mixed_page16_fp32_strided_qkv():
    return _backend_case(torch.float32, 16, MIXED_Q, MIXED_KV, strided=True, splits=3)


def case_mixed_page16_fp16_gqa4_d128():
    return _backend_case(torch.float16, 16, MIXED_Q, MIXED_KV, heads=8, kv_heads=2, dim=128)


def case_mixed_page1_fp16_mha_d64():
    return _backend_case(torch.float16, 1, MIXED_Q, MIXED_KV, heads=4, kv_heads=4, dim=64)


def case_decode_gqa8_page16():
    return _backend_case(torch.float32, 16, [1] * 3, [5, 33, 17], heads=16, kv_heads=2)


def case_split_kv_long_context():
    """Decode over ~1000 tokens: 1, 4 and 7 splits (7 leaves empty splits for the short
    sequence) all give the reference."""
    details = [_backend_case(torch.float32, 16, [1, 1, 1], [1000, 3, 517], splits=s)
               for s in (1, 4, 7)]
    return "; ".join(details)


def _fp8_case(storage_dtype, k_scale, v_scale, splits=None):
    """A float8 cache with per-layer scales: the store saturates (no NaN) and lands within a
    float8 step of torch's cast, and attention equals the reference over the dequantized
    cache. (The interpreter's float8 conversion rounds a value that should round up to a power
    of two down to the power below and flushes subnormals, so exact bytes are checked on the
    GPU: tests/test_gpu_attention.py.)"""
    from radixlm.runtime.attention.kv_cache import quantize_kv
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = random_paged_batch("cpu", torch.float32, 16, MIXED_Q, MIXED_KV,
                                        strided_qkv=True, storage_dtype=storage_dtype)
    cache = batch.kv_cache
    cache.set_scales([k_scale], [v_scale])
    k = k * 1000.0  # some keys past float8's range: saturated, never NaN
    backend = TritonAttention(SCALE_DIM[32], num_splits=splits)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch)
    for name, stored, x, scale in (("K", cache.k, k, k_scale), ("V", cache.v, v, v_scale)):
        got = stored[0][batch.out_slots].float()
        want = quantize_kv(x, scale, storage_dtype).float()
        assert not got.isnan().any(), f"{name}: NaN stored"
        # within a factor of two (the interpreter's rounding; it also flushes subnormals to
        # zero), same sign, zeros kept
        normal = want.abs() >= torch.finfo(storage_dtype).smallest_normal
        ratio = (got / want)[normal]
        assert ((ratio >= 0.5) & (ratio <= 1.0 + 1e-6)).all(), f"{name}: not float8(x / scale)"
        assert (got[~normal].abs() <= want[~normal].abs()).all(), f"{name}: subnormals"
    from radixlm.kernels.reference import paged_attention_reference

    ref = paged_attention_reference(q, cache.k[0].float() * k_scale, cache.v[0].float() * v_scale,
                                    batch.slot_table, batch.q_lens, batch.kv_lens, SCALE_DIM[32])
    err = rel_err(out, ref)
    assert err < 1e-5, f"relative error {err:.2e}"
    return f"rel err {err:.1e}, splits {backend.num_splits}"


def case_fp8_e4m3_cache_scaled():
    return _fp8_case(torch.float8_e4m3fn, 0.5, 2.0, splits=3)


def case_fp8_e5m2_cache():
    return _fp8_case(torch.float8_e5m2, 1.0, 1.0)


def case_fp8_v_read_as_pairs_equals_byte_reads():
    """Under a 16-bit query the decode kernel reads a float8 V as int16 pairs and widens the
    bytes itself: the same output as reading them as float8, and the reference's over the
    dequantized cache. Decode rows only: the interpreter mis-emulates bfloat16 elsewhere."""
    from radixlm.kernels.reference import paged_attention_reference
    from radixlm.kernels.triton_attention import DecodeConfig
    from radixlm.runtime.attention.triton_backend import TritonAttention

    details = []
    for dtype, storage, scales, splits in (
            (torch.bfloat16, torch.float8_e4m3fn, (0.5, 2.0), 3),
            (torch.float16, torch.float8_e4m3fn, (1.0, 0.25), 1),
            (torch.float16, torch.float8_e5m2, (1.0, 1.0), 2)):
        batch, q, k, v = random_paged_batch("cpu", dtype, 16, [1] * 4, [37, 1, 300, 64],
                                            storage_dtype=storage)
        batch.kv_cache.set_scales([scales[0]], [scales[1]])
        outs = []
        for pairs in (True, False):
            backend = TritonAttention(SCALE_DIM[32], num_splits=splits,
                                      decode_config=DecodeConfig(fp8_v_pairs=pairs))
            backend.plan(batch)
            outs.append(backend.forward(q, k, v, 0, batch))
        assert torch.equal(outs[0], outs[1]), f"{dtype}, {storage}: pairs differ from bytes"
        cache = batch.kv_cache
        ref = paged_attention_reference(q, cache.k[0].float() * scales[0],
                                        cache.v[0].float() * scales[1], batch.slot_table,
                                        batch.q_lens, batch.kv_lens, SCALE_DIM[32])
        err = rel_err(outs[0], ref)
        assert err < 5e-3, f"{dtype}, {storage}: relative error {err:.2e}"
        details.append(f"{storage} under {dtype}: {err:.1e}")
    return "; ".join(details)


def case_fp8_qk_multiplies_the_query_in_float8_by_the_keys():
    """DecodeConfig(fp8_qk=True) over an e4m3 cache: each head's query is scaled by its
    max |q| / 448 and rounded to e4m3, and its scores are that times the cache's keys in
    float32 sums. The interpreter rounds float32 to e4m3 wrongly where the rounding carries
    into the exponent (127.5 -> 64), so here every query row is e4m3 values times a power of
    two, with one at +-448: rounding is exact, and the output must be the reference's over
    the dequantized cache, splits and scales included. The GPU test checks random queries
    against the rounded reference (tests/test_gpu_attention.py)."""
    from radixlm.kernels.reference import paged_attention_reference
    from radixlm.kernels.triton_attention import DecodeConfig
    from radixlm.runtime.attention.triton_backend import TritonAttention

    batch, q, k, v = random_paged_batch("cpu", torch.float16, 16, [1] * 4, [37, 1, 300, 64],
                                        storage_dtype=torch.float8_e4m3fn)
    batch.kv_cache.set_scales([0.5], [2.0])
    gen = torch.Generator().manual_seed(3)
    codes = (torch.randn(q.shape, generator=gen) * 60).clamp(-440, 440)
    codes = codes.to(torch.float8_e4m3fn).float()
    codes[..., 0] = 448.0 * torch.where(torch.rand(q.shape[:2], generator=gen) < 0.5, -1, 1)
    powers = 2.0 ** torch.randint(-9, -5, q.shape[:2] + (1,), generator=gen)
    q = (codes * powers).to(torch.float16)
    backend = TritonAttention(SCALE_DIM[32], num_splits=3,
                              decode_config=DecodeConfig(fp8_qk=True))
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch)
    cache = batch.kv_cache
    ref = paged_attention_reference(q.float(), cache.k[0].float() * 0.5,
                                    cache.v[0].float() * 2.0, batch.slot_table, batch.q_lens,
                                    batch.kv_lens, SCALE_DIM[32])
    err = rel_err(out, ref)
    assert err < 1e-3, f"relative error {err:.2e}"
    return f"rel err {err:.1e}"


def case_extend_long_chunk_after_prefix():
    return _backend_case(torch.float16, 16, [130, 2], [400, 2], dim=64)


def case_store_kv_strided():
    from radixlm.kernels.triton_attention import store_kv

    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 6, 32, generator=gen)
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    k_cache, v_cache = torch.zeros(20, 2, 32), torch.zeros(20, 2, 32)
    slots = torch.tensor([7, 3, 19, 0, 12])
    store_kv(k, v, slots, k_cache, v_cache)
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[untouched].abs().sum() == 0, "wrote outside the given slots"
    return "exact"


def _fused_cases(dtype):
    import torch.nn.functional as F

    from radixlm.kernels import fused
    from radixlm.kernels import reference as ref
    from radixlm.runtime.models.layers.rotary import apply_rotary

    exact = dtype == torch.float16  # fp32 may differ by an ulp (fma contraction, rsqrt)
    gen = torch.Generator().manual_seed(2)

    def check(name, out, want):
        if exact:
            assert torch.equal(out, want), f"{name}: not bit-exact"
        else:
            assert rel_err(out, want) < 1e-6, f"{name}: rel err {rel_err(out, want):.1e}"

    x, res = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=gen).to(dtype)
    check("rms_norm", fused.rms_norm(x, w, 1e-6), w * F.rms_norm(x, (96,), eps=1e-6))
    out, summed = fused.rms_norm(x, w, 1e-6, residual=res)
    want, want_sum = ref.rms_norm_reference(x, w, 1e-6, residual=res)
    check("rms_norm+residual", out, want)
    check("residual sum", summed, want_sum)
    gate_up = torch.randn(7, 2 * 50, generator=gen).to(dtype)
    check("silu_and_mul", fused.silu_and_mul(gate_up), ref.silu_and_mul_reference(gate_up))
    qk = torch.randn(6, 5, 32, generator=gen).to(dtype)
    cos, sin = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
    want = apply_rotary(qk, cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))
    check("rotary reference", ref.rotary_reference(qk, cos, sin), want)
    check("rotary on a view", fused.rotary_embedding(qk[:, 1:4], cos, sin), want[:, 1:4])
    fused.rotary_embedding(qk, cos.unsqueeze(1), sin.unsqueeze(1), out=qk)
    check("rotary in place", qk, want)
    return "bit-exact" if exact else "within 1e-6"


def case_rotary_and_store():
    """The fused rotary + K/V store writes what rotary in place, then store_kv, write."""
    from radixlm.kernels import fused
    from radixlm.kernels.triton_attention import store_kv
    from radixlm.runtime.attention.kv_cache import KVCache

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, tokens = 6, 2, 32, 5
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen)
    cos, sin = torch.randn(tokens, 1, dim // 2, generator=gen), torch.randn(
        tokens, 1, dim // 2, generator=gen)
    slots = torch.tensor([9, 2, 14, 0, 7])
    results = []
    for storage in (None, torch.float8_e5m2):
        caches = [KVCache(1, 16, kv_heads, dim, torch.float32, torch.device("cpu"),
                          storage_dtype=storage) for _ in range(2)]
        for cache in caches:
            cache.set_scales([0.5], [2.0])
        a, b = qkv.clone(), qkv.clone()
        fused.rotary_and_store(a[:, : heads + kv_heads], a[:, heads + kv_heads:], cos, sin,
                               heads, *caches[0].layer(0), slots, 0.5, 2.0)
        fused.rotary_embedding(b[:, : heads + kv_heads], cos, sin, out=b[:, : heads + kv_heads])
        store_kv(b[:, heads: heads + kv_heads], b[:, heads + kv_heads:], slots, *caches[1].layer(0),
                 0.5, 2.0)
        assert torch.equal(a, b), "rotated q/k differ"
        for got, want in zip(caches[0].layer(0), caches[1].layer(0)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), storage
        results.append(str(storage))
    return "same bytes: " + ", ".join(results)


def case_gemv_kernels():
    """The float-weight GEMV against x @ W^T in float32, 1 to 16 rows, ragged N and K."""
    from radixlm.kernels.gemv import GemvConfig, gemv

    gen = torch.Generator().manual_seed(5)
    n, k = 100, 700  # neither a multiple of the tiles
    weight = torch.randn(n, k, generator=gen)
    worst = 0.0
    for rows in (1, 3, 5, 16):
        x = torch.randn(rows, k, generator=gen)
        out = gemv(x, weight, GemvConfig(block_n=32, block_k=64, num_stages=2))
        err = rel_err(out, x @ weight.T)
        assert err < 1e-5, f"{rows} rows: {err:.1e}"
        worst = max(worst, err)
    # Through a Linear: narrow float layers take it for a few rows, F.linear otherwise.
    from radixlm.runtime.models.layers.linear import Linear, use_small_batch_gemv

    layer = Linear(k, n, bias=True, dtype=torch.float16)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(torch.randn(n, generator=gen))
    use_small_batch_gemv(layer, True)
    assert layer.small_batch is not None
    for rows in (3, 20):
        x = torch.randn(rows, k, generator=gen).half()
        want = (x.float() @ weight.half().float().T + layer.bias.float())
        err = rel_err(layer(x), want)
        assert err < 2e-3, f"Linear, {rows} rows: {err:.1e}"
    use_small_batch_gemv(layer, False)
    assert layer.small_batch is None
    return f"worst rel err {worst:.1e}"


def case_fused_fp32():
    return _fused_cases(torch.float32)


def case_fused_fp16():
    return _fused_cases(torch.float16)


def save_llama(folder, head_dim: int = 128):
    """A tiny random Llama with 4 query / 2 KV heads of head_dim (FlashInfer needs 64+)."""
    import transformers

    from conftest import tiny_config

    cfg = tiny_config("llama")
    cfg.update(hidden_size=4 * head_dim, intermediate_size=8 * head_dim)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), torch_dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


# Prompts sharing prefixes (prefix-cache hits -> extends with cached prefixes); with a small
# chunk size, prefill chunks and decode tokens share steps.
PROMPTS = [[5 + i, 17, 99, 3 + i * 7] * (i + 1) for i in range(6)] + \
          [[7, 8, 9, 10] * 20 + [11 + i] * (3 + i) for i in range(4)]


def case_engine_greedy_matches_torch():
    """The whole engine (mixed steps, prefix-cache hits, strided q/k/v from the model)."""
    import tempfile

    from radixlm.runtime import Engine

    folder = save_llama(Path(tempfile.mkdtemp()), head_dim=32)
    prompts = PROMPTS[:3] + PROMPTS[-2:]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    tokens = {}
    for name in ("torch", "triton"):
        with Engine(str(folder), device="cpu", dtype="float32", max_total_tokens=1024,
                    chunked_prefill_size=16, page_size=4, attention_backend=name) as engine:
            tokens[name] = [o.token_ids for o in engine.generate(input_ids=prompts,
                                                                 sampling_params=params)]
            cached = engine.stats()["cached_tokens"]
    assert tokens["triton"] == tokens["torch"], tokens
    return f"same greedy tokens; {cached} cached prompt tokens"


def _engine_tokens(folder, prompts, params, setup=None, **options):
    from radixlm.runtime import Engine

    with Engine(str(folder), device="cpu", dtype="float32", max_total_tokens=1024,
                chunked_prefill_size=16, page_size=4, **options) as engine:
        if setup is not None:
            setup(engine)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def _uncaptured_graphs(max_batch_size, record):
    """An engine setup that gives the runner the graph runner, uncaptured (it runs its padded
    batches eagerly), calling record(requests) with each step's rows."""
    from radixlm.runtime.execution.cuda_graph import DecodeGraphs

    def attach(engine):
        core = engine.core
        scratch = core.allocator.allocate(1)[0] * core.page_size  # a page no request gets
        graphs = DecodeGraphs(core.runner.model, core.runner.attn, core.kv_cache, core.table,
                              scratch, max_batch_size=max_batch_size,
                              max_len=core.max_model_len, capture=False)
        forward = graphs.forward

        def recording_forward(requests, *args):
            record(requests)
            return forward(requests, *args)

        graphs.forward = recording_forward
        core.runner.cuda_graphs = graphs

    return attach


def case_decode_graph_padding_matches_eager():
    """The CUDA-graph runner's padded static batches, run eagerly: padded rows (a scratch
    slot, one-token contexts) change nothing, and batch sizes cross several padded sizes as
    requests finish at different lengths."""
    import tempfile

    folder = save_llama(Path(tempfile.mkdtemp()), head_dim=32)
    prompts = PROMPTS[:5] + [[42]]  # a one-token prompt is a decode-shaped first step
    params = [{"temperature": 0, "max_new_tokens": 3 + 2 * i, "ignore_eos": True,
               "logprobs": True} for i in range(len(prompts))]
    seen: list[int] = []
    attach = _uncaptured_graphs(5, lambda requests: seen.append(len(requests)))
    eager = _engine_tokens(folder, prompts, params, attention_backend="triton")
    padded = _engine_tokens(folder, prompts, params, setup=attach, attention_backend="triton")
    assert padded[0] == eager[0], (padded[0], eager[0])
    for a, b in zip(padded[1], eager[1]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert {3, 5} <= set(seen), seen  # padded to 4, and a step of exactly the largest size
    return f"same greedy tokens; decode batch sizes {sorted(set(seen))}"


def case_prompt_chunks_as_graph_rows_match_eager():
    """Prompt chunks (first prompts, and extends after prefix-cache hits) beside decode
    tokens go through the graph runner as one row per token, uncaptured: the same greedy
    tokens as the eager extend path, and logprobs within float32 noise."""
    import tempfile

    folder = save_llama(Path(tempfile.mkdtemp()), head_dim=32)
    params = [{"temperature": 0, "max_new_tokens": 2 + i % 4, "ignore_eos": True,
               "logprobs": True} for i in range(len(PROMPTS))]
    chunks: list[int] = []  # the longest chunk of each graph step
    attach = _uncaptured_graphs(
        48, lambda requests: chunks.append(max(sum(r is q for q in requests) for r in requests)))
    eager = _engine_tokens(folder, PROMPTS, params, attention_backend="triton")
    rows = _engine_tokens(folder, PROMPTS, params, setup=attach, attention_backend="triton")
    assert rows[0] == eager[0], (rows[0], eager[0])
    worst = max(abs(x - y) for a, b in zip(rows[1], eager[1]) for x, y in zip(a, b))
    assert worst < 1e-4, worst
    assert max(chunks) == 16, chunks  # whole 16-token chunks went through the graph rows
    return f"same greedy tokens; {len(chunks)} graph steps, logprobs within {worst:.1e}"


def case_tp2_decode_graph_steps_match_tp1():
    """Tensor parallelism through the graph runner, uncaptured: rank 0 sends each padded
    step's inputs and slot-table rows, the other rank replays them on its own
    buffers (gloo, two processes). Greedy tokens equal TP=1's, with overlap scheduling
    feeding the sampled tokens on the device."""
    import tempfile

    from radixlm.runtime.engine import engine_core
    from radixlm.runtime.execution import cuda_graph

    folder = save_llama(Path(tempfile.mkdtemp()), head_dim=32)
    prompts = PROMPTS[:3]
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, "logprobs": True}
    expected = _engine_tokens(folder, prompts, params, attention_backend="triton")[0]
    sent: list[int] = []
    send, graphs_on = cuda_graph.DecodeGraphs.forward, engine_core.uses_decode_graphs

    def counting_forward(self, requests, *args):
        sent.append(len(requests))
        return send(self, requests, *args)

    engine_core.uses_decode_graphs = lambda *args: True
    cuda_graph.DecodeGraphs.forward = counting_forward
    try:
        got = _engine_tokens(folder, prompts, params, attention_backend="triton", tp_size=2,
                             overlap_schedule="on", tp_timeout=120)[0]
    finally:
        cuda_graph.DecodeGraphs.forward = send
        engine_core.uses_decode_graphs = graphs_on
    assert got == expected, (got, expected)
    # The prompts' first chunks as one row per token, then decode steps of every prompt.
    assert sent[0] == sum(map(len, prompts)) and len(prompts) in sent, sent
    return f"same greedy tokens; {len(sent)} graph steps sent"


def case_fused_model_matches_torch():
    """The Llama forward with the fused norm/activation/rotary kernels, under the
    interpreter: the same greedy tokens as the torch ops in fp32."""
    import tempfile

    folder = save_llama(Path(tempfile.mkdtemp()), head_dim=32)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "logprobs": True}
    plain = _engine_tokens(folder, PROMPTS[:4], params)
    fused = _engine_tokens(folder, PROMPTS[:4], params,
                           setup=lambda e: e.core.runner.model.use_fused_kernels(True))
    assert fused[0] == plain[0], (fused[0], plain[0])
    worst = max(abs(x - y) for a, b in zip(fused[1], plain[1]) for x, y in zip(a, b))
    assert worst < 1e-4, worst
    return f"same greedy tokens; logprobs within {worst:.1e}"


CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", CASES)
def test_kernel_under_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert result["ok"], result["detail"]


# -- what the CUDA-only paths compile to (PTX for sm_90, no GPU needed) ----------------------


def e4m3_decode_ptx(**constants) -> str:
    """The decode kernel's PTX for sm_90 over an e4m3 cache under a bf16 query, V read as
    pairs widened by the conversion instruction (the CUDA default), 128-key tiles, 4 warps,
    3 stages; `constants` adds DIRECT and FP8_QK."""
    from sm90_ptx import ptx_for_sm90

    from radixlm.kernels.triton_decode import decode_split_kernel

    signature = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*i16",
                 "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
                 "slot_table_ptr": "*i64", "kv_lens_ptr": "*i32", "seq_rows_ptr": "*i32",
                 "q_rows_ptr": "*i32", "score_mul": "fp32", "cap_mul": "fp32",
                 "out_mul": "fp32"}
    constants = dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128, BLOCK_N=128,
                     SOFTCAP=False, DOT_PRECISION="tf32", WIDEN_FP16=True, V_PAIRS=True,
                     V_E4M3=True, V_CVT=True, PDL=True) | constants
    aligned = [name for name in decode_split_kernel.arg_names
               if name.endswith("_ptr") or name.startswith("stride")]
    return ptx_for_sm90(decode_split_kernel, signature, constants, aligned, num_warps=4,
                        num_stages=3)


def test_e4m3_v_pairs_come_back_by_transposing_loads_and_widen_by_conversion():
    """The decode kernel's float8 V under a bf16 query on CUDA (V_PAIRS with V_CVT): the V
    tile leaves shared memory by 16-bit transposing matrix loads, never a byte at a time, and
    its e4m3 pairs are widened by the pairwise conversion instruction (one a pair, as many as
    for K), not integer ops. This is what makes the path fast (docs/attention.md); the
    interpreter cannot run the instruction, so the GPU tests check its values."""
    import re

    pytest.importorskip("triton.backends.nvidia")
    ptx = e4m3_decode_ptx(DIRECT=True, FP8_QK=False)
    assert re.search(r"ldmatrix\.sync\.aligned\.\S*trans", ptx)
    assert not re.search(r"ld\.shared\.[usb]8", ptx), "V read from shared memory byte by byte"
    # K's widening (128 keys x 128 dims / 2 per instruction / 128 threads) and V's, alike
    assert ptx.count("cvt.rn.f16x2.e4m3x2") >= 2 * 64


def test_fp8_qk_multiplies_in_float8_on_warpgroup_tensor_cores():
    """DecodeConfig(fp8_qk=True) on CUDA: q.k is one float8 warpgroup MMA per 64 keys (the
    keys as the 64-row operand, the group's padded 16 heads as the 16 columns), so K is never
    widened: the only pairwise conversions left are V's, half the default path's."""
    import re

    pytest.importorskip("triton.backends.nvidia")
    conversions = {}
    for fp8_qk in (False, True):
        ptx = e4m3_decode_ptx(DIRECT=False, FP8_QK=fp8_qk)
        conversions[fp8_qk] = ptx.count("cvt.rn.f16x2.e4m3x2")
        e4m3_mma = re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)
        assert bool(e4m3_mma) == fp8_qk, e4m3_mma
    # 128 keys x 128 dims / 2 a conversion / 128 threads = 64 for each of K and V (the
    # query's own rounding adds a few float32 -> e4m3 conversions, not counted here)
    assert conversions[False] >= 128 and conversions[True] <= conversions[False] // 2 + 8, \
        conversions


# Shared memory a block may use on Ampere's and Ada's consumer cards (sm_86, sm_89: RTX
# 30x0 and 40x0, A10, L4); the H100 and H200 have 227 KB.
CONSUMER_CARD_SHARED = 101376


def test_the_default_cuda_kernels_fit_a_consumer_cards_shared_memory():
    """The shipped tiles of the decode attention (bf16 and float8 caches), the prefill
    attention and the small-batch GEMV, compiled for sm_89: each must fit 99 KB of shared
    memory, or a user's RTX card would refuse the kernel at its first launch. (The batch-
    invariant matmul and the INT4/INT8 tensor-core kernel instead take fewer stages where
    theirs do not fit: kernels/shared_memory.py, test_batch_invariant.)"""
    pytest.importorskip("triton.backends.nvidia")
    from sm90_ptx import compile_for_cuda

    from radixlm.kernels import gemv
    from radixlm.kernels import triton_attention as ta
    from radixlm.kernels.triton_decode import decode_split_kernel
    from radixlm.kernels.triton_extend import extend_kernel

    def aligned(kernel) -> list[str]:
        return [name for name in kernel.arg_names
                if name.endswith("_ptr") or name.startswith("stride")]

    used = {}
    decode = ta.decode_config(torch.bfloat16, 128)
    for cache in ("bf16", "fp8e4nv"):
        fp8 = cache != "bf16"
        signature = {"q_ptr": "*bf16", "k_cache_ptr": f"*{cache}",
                     "v_cache_ptr": "*i16" if fp8 else "*bf16", "out_ptr": "*bf16",
                     "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "slot_table_ptr": "*i64",
                     "kv_lens_ptr": "*i32", "seq_rows_ptr": "*i32", "q_rows_ptr": "*i32",
                     "score_mul": "fp32", "cap_mul": "fp32", "out_mul": "fp32"}
        constants = dict(GROUP=4, HEAD_DIM=128, BLOCK_H=16, BLOCK_D=128,
                         BLOCK_N=decode.block_n, DIRECT=False, SOFTCAP=False,
                         DOT_PRECISION="tf32", WIDEN_FP16=fp8, V_PAIRS=fp8, V_E4M3=fp8,
                         V_CVT=fp8, FP8_QK=False, PDL=False)
        used[f"decode, {cache} cache"] = compile_for_cuda(
            decode_split_kernel, signature, constants, aligned(decode_split_kernel),
            decode.num_warps, decode.num_stages, capability=89).metadata.shared
    extend = ta.extend_config(torch.bfloat16, 128)
    signature = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                 "out_ptr": "*bf16", "slot_table_ptr": "*i64", "block_rows_ptr": "*i32",
                 "block_m0_ptr": "*i32", "q_starts_ptr": "*i32", "q_lens_ptr": "*i32",
                 "kv_lens_ptr": "*i32", "score_mul": "fp32", "cap_mul": "fp32",
                 "out_mul": "fp32"}
    constants = dict(GROUP=4, HEAD_DIM=128, BLOCK_M=extend.block_m, BLOCK_N=extend.block_n,
                     BLOCK_D=128, WINDOWED=False, SOFTCAP=False, DOT_PRECISION="tf32")
    used["extend"] = compile_for_cuda(extend_kernel, signature, constants,
                                      aligned(extend_kernel), extend.num_warps,
                                      extend.num_stages, capability=89).metadata.shared
    narrow = gemv.NARROW
    constants = dict(BLOCK_N=narrow.block_n, BLOCK_K=narrow.block_k,
                     NUM_STAGES=narrow.num_stages, PDL=False)
    used["gemv"] = compile_for_cuda(gemv._gemv_dot_kernel,
                                    {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"},
                                    constants, aligned(gemv._gemv_dot_kernel) + ["K"],
                                    narrow.num_warps, narrow.num_stages,
                                    capability=89).metadata.shared
    assert all(0 < size <= CONSUMER_CARD_SHARED for size in used.values()), used


if __name__ == "__main__":
    main(globals())
