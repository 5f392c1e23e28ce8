"""Deterministic inference on CUDA (`deterministic=True`): a request's tokens and logprobs are
the same bits alone and inside random batches, with random prefill chunk sizes, a warm prefix
cache, overlap scheduling on or off and CUDA graphs on or off; and the default mode still
works. Run on the GPU machine (`pytest -m gpu`); skipped without CUDA.

The kernels first (rows of a matmul at every row count, a query's attention as prefill,
chunk or decode, at Llama-3-8B's shapes), then the engine on a Llama-3.2-1B-shaped dummy
model (bf16): small enough that several engines fit in a test, the same GQA layout as 8B.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from test_batch_invariant import attention_invariance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Llama-3-8B's linears [N, K]: qkv, o, gate_up, down, the output head.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
ROWS = [1, 2, 3, 8, 16, 63, 64, 65, 200, 256, 1000]


def _rows_check(n: int, k: int, fp8: bool) -> str:
    from radixlm.kernels.fp8 import per_token_fp8
    from radixlm.kernels.invariant_matmul import invariant_matmul, segments_for
    from radixlm.runtime.models.quantization.fp8 import quantize_fp8_rows

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(2048, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    if fp8:
        w8, w_scale = quantize_fp8_rows(weight)
        w_scale = w_scale.view(-1)

        def product(rows: torch.Tensor) -> torch.Tensor:
            x8, x_scale = per_token_fp8(rows)
            return invariant_matmul(x8, w8, torch.bfloat16, x_scale, w_scale)

        x8, x_scale = per_token_fp8(x)  # the reference: the same rounded operands in float32
        want = (x8.float() * x_scale) @ (w8.float() * w_scale[:, None]).T
    else:
        def product(rows: torch.Tensor) -> torch.Tensor:
            return invariant_matmul(rows, weight)

        want = x.float() @ weight.float().T
    full = product(x)
    err = ((full.float() - want).norm() / want.norm()).item()
    assert err < 5e-3, err
    for m in ROWS:
        for start in (0, 37):
            part = product(x[start:start + m].clone())
            assert torch.equal(part, full[start:start + m]), (n, k, m, start)
    if not fp8:
        # Rows that start off a 16-byte boundary cannot be read by the copy engine (TMA):
        # they take plain loads, with the same bits.
        for m in (8, 256):
            unaligned = torch.empty(m * k + 1, device="cuda", dtype=x.dtype)[1:].view(m, k)
            unaligned.copy_(x[:m])
            assert torch.equal(product(unaligned), full[:m]), ("unaligned", m)
    # In a CUDA graph (the split path's ticket counters must start at zero on every replay).
    rows = x[:4].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = product(rows)
    for start in (100, 5):
        rows.copy_(x[start:start + 4])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, full[start:start + 4]), ("graph", start)
    return f"{segments_for(n, k, x.device)} err {err:.1e}"


@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_matmul_rows_are_the_same_bits_at_every_row_count(n, k):
    print(_rows_check(n, k, fp8=False))


@pytest.mark.parametrize("n,k", SHAPES_8B[:4])
def test_fp8_matmul_rows_are_the_same_bits_at_every_row_count(n, k):
    print(_rows_check(n, k, fp8=True))


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
def test_int4_matmul_rows_are_the_same_bits_at_every_row_count(n, k):
    """INT4 weights (AWQ / GPTQ layout) with deterministic inference's fixed w4a16 tiling."""
    from radixlm.kernels.w4a16 import invariant_config, w4a16_matmul
    from radixlm.runtime.models.quantization.packing import pack_gptq_weight

    gen = torch.Generator().manual_seed(k)
    group = 128
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    qweight = pack_gptq_weight(q, 4).cuda()
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).bfloat16().cuda()
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8).cuda()
    x = torch.randn(1100, k, generator=gen).bfloat16().cuda()

    def product(rows: torch.Tensor) -> torch.Tensor:
        return w4a16_matmul(rows, qweight, scales, zeros, group, 4, invariant_config(group))

    full = product(x)
    for m in ROWS:
        assert torch.equal(product(x[37:37 + m].clone()), full[37:37 + m]), m


ATTENTION_8B = dict(device="cuda", dtype=torch.bfloat16, heads=32, kv_heads=8, dim=128,
                    length=1300, chunks=((0, 97), (97, 256), (256, 257), (257, 700),
                                         (700, 1300)),
                    positions=(0, 255, 256, 700, 1299), workers=(None, 1, 3, 7), tol=1e-2)


@pytest.mark.parametrize("layer", [{}, {"sliding_window": 500}, {"logit_softcap": 30.0}])
def test_attention_is_the_same_bits_as_prefill_chunk_or_decode(layer):
    print(attention_invariance(layer, **ATTENTION_8B))


def test_attention_over_a_float8_cache_is_the_same_bits_as_prefill_chunk_or_decode():
    print(attention_invariance({}, storage=torch.float8_e4m3fn, **{**ATTENTION_8B, "tol": 3e-2}))


# -- the engine ------------------------------------------------------------------------------

MODEL = "llama-3.2-1b"
NEW_TOKENS = 40


def _engine(**options):
    from radixlm.runtime import Engine

    return Engine(MODEL, load_format="dummy", device="cuda", attention_backend="triton",
                  max_total_tokens=131072, max_running_requests=64, **options)


def _greedy() -> dict:
    return {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True,
            "logprobs": True, "top_logprobs_num": 5}


def _sampled() -> dict:
    return {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1234,
            "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "logprobs": True}


def _result(out) -> tuple:
    return out.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]


def _random_batch(rng: random.Random, vocab: int, targets: list[tuple[list[int], dict]]):
    """Random other requests (lengths 1-900, 1-60 new tokens, greedy or sampled) with the
    targets at random places; returns (prompts, params, where each target went)."""
    others = []
    for _ in range(rng.randint(6, 30)):
        length = rng.choice([1, 2, rng.randint(3, 64), rng.randint(65, 900)])
        params = {"max_new_tokens": rng.randint(1, 60), "ignore_eos": True,
                  "temperature": rng.choice([0, 0.7])}
        others.append(([rng.randrange(vocab) for _ in range(length)], params))
    places = []
    for target in targets:
        place = rng.randint(0, len(others))
        others.insert(place, target)
        places = [p + (p >= place) for p in places] + [place]
    return [p for p, _ in others], [q for _, q in others], places


def test_a_request_is_the_same_bits_alone_and_in_random_batches():
    rng = random.Random(0)
    with _engine(deterministic=True) as engine:
        vocab = engine.model_config.vocab_size
        prompt = [rng.randrange(vocab) for _ in range(700)]
        targets = [(prompt, _greedy()), (prompt[:333], _sampled())]
        start = time.perf_counter()
        alone = []
        for target_prompt, target_params in targets:  # each from a cold cache
            out = engine.generate(input_ids=target_prompt, sampling_params=target_params)
            alone.append(_result(out))
            engine.flush_cache()
        print(f"alone: {time.perf_counter() - start:.1f} s")
        # The greedy continuation from the prompt plus some of its own output: the cached
        # output tokens' KV came from decode steps, a cold engine's from a prefill.
        follow = prompt + alone[0][0][:25]
        follow_params = {**_greedy(), "max_new_tokens": NEW_TOKENS - 25}
        want_follow = (alone[0][0][25:], alone[0][1][25:])
        configs = [  # (engine, warm the cache first) x batches
            dict(),
            dict(chunked_prefill_size=37, max_num_batched_tokens=300, overlap_schedule="off",
                 disable_cuda_graph=True),
            dict(chunked_prefill_size=200, max_num_batched_tokens=1000),
        ]
        checked = 0
        for index, options in enumerate(configs):
            other = engine if not options else _engine(deterministic=True, **options)
            try:
                for trial in range(3):
                    if trial == 1:  # warm the cache with the first 300 prompt tokens
                        other.generate(input_ids=prompt[:300] + [1, 2, 3],
                                       sampling_params={"max_new_tokens": 2})
                    prompts, params, places = _random_batch(
                        rng, vocab, targets + [(follow, follow_params)])
                    outs = other.generate(input_ids=prompts, sampling_params=params)
                    got = [_result(outs[place]) for place in places]
                    for name, g, want in zip(("greedy", "sampled", "continuation"), got,
                                             alone + [want_follow]):
                        assert g[0] == want[0], (index, trial, name, "tokens")
                        assert g[1] == want[1], (index, trial, name, "logprobs")
                        checked += 1
                    stats = other.stats()
                    print(f"config {index} trial {trial}: {len(prompts)} requests, "
                          f"{stats.get('cached_tokens')} cached tokens")
            finally:
                if other is not engine:
                    other.close()
    assert checked == 27


def test_default_mode_still_works_beside_deterministic():
    from radixlm.kernels.gemv import gemv

    rng = random.Random(1)
    with _engine() as engine:
        model = engine.core.runner.model
        assert model.invariant_head is None
        assert any(getattr(m, "small_batch", None) is gemv for m in model.modules())
        prompts = [[rng.randrange(1000) for _ in range(300)] for _ in range(8)]
        outs = engine.generate(input_ids=prompts, sampling_params=_greedy())
        default = [_result(o) for o in outs]
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in default)
    with _engine(deterministic=True) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=_greedy())
        invariant = [_result(o) for o in outs]
    # Different kernels, so not the same bits: where the two pick the same first token, its
    # logprob agrees to bf16 rounding.
    same = [(a[1][0][1], b[1][0][1]) for a, b in zip(default, invariant)
            if a[0][0] == b[0][0]]
    assert all(abs(x - y) < 0.1 for x, y in same), same
    assert all(lp == lp for _, lps in default for _, lp, _ in lps)  # no NaN
    print(f"first tokens equal for {len(same)} of {len(prompts)} prompts")
