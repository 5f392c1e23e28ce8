"""The CPU decode kernel (kernels/cpu_decode.cpp through runtime/execution/cpu_decode.py):
a step in one C++ call gives the eager bfloat16 path's hidden states, on dense and GGUF-block
weights, for ragged batches; the engine uses it where it applies and keeps its pages; its
decode is as close to the float32 reference as the eager path is; and a row's result is the
same bits whatever else its step holds (its linears, and its hidden state whether prefilled
whole, chunked or decoded)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixlm.kernels import cpu_decode as kernel_build
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.execution.cpu_decode import CpuDecode, unsupported
from radixlm.runtime.models.loader import load_model

from conftest import save_tiny_hf_model


@pytest.fixture(scope="module")
def kernel():
    module = kernel_build.load()
    if module is None:
        pytest.skip("the CPU decode kernel does not build here (no C++ compiler?)")
    return module


def _decode_both(model, kernel, lengths: list[int],
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill B sequences of `lengths` tokens eagerly, then run one decode step through the
    kernel and through the eager model on copies of the same cache; their hidden states."""
    cfg = model.config
    page = 4
    counts = [-(-(n + 1) // page) for n in lengths]  # pages each sequence needs
    kv = KVCache(cfg.num_layers, sum(counts) * page, cfg.num_kv_heads, cfg.head_dim,
                 dtype, torch.device("cpu"), page_size=page)
    attn = TorchNativeAttention(cfg.head_dim ** -0.5)
    gen = torch.Generator().manual_seed(0)
    # Sequence i owns pages in reverse order from a block of its own: the page table matters.
    tables = []
    for i, count in enumerate(counts):
        pages = list(reversed(range(sum(counts[:i]), sum(counts[:i]) + count)))
        tables.append(torch.tensor([p * page + o for p in pages for o in range(page)]))
    with torch.inference_mode():
        for n, table in zip(lengths, tables):  # prefill, one sequence at a time
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
            batch = ForwardBatch(input_ids=ids, positions=torch.arange(n), q_lens=[n],
                                 kv_lens=[n], out_slots=table[:n], slot_table=table[None, :n],
                                 kv_cache=kv)
            attn.plan(batch)
            model(batch, attn)
        width = max(lengths) + 1
        slot_table = torch.stack([torch.nn.functional.pad(t, (0, max(0, width - len(t))))[:width]
                                  for t in tables])
        step = ForwardBatch(
            input_ids=torch.randint(0, cfg.vocab_size, (len(lengths),), generator=gen),
            positions=torch.tensor(lengths), q_lens=[1] * len(lengths),
            kv_lens=[n + 1 for n in lengths],
            out_slots=torch.stack([t[n] for t, n in zip(tables, lengths)]),
            slot_table=slot_table, kv_cache=kv)
        saved = kv.k.clone(), kv.v.clone()
        attn.plan(step)
        eager = model(step, attn)
        eager_kv = kv.k.clone(), kv.v.clone()
        kv.k.copy_(saved[0])
        kv.v.copy_(saved[1])
        fast = CpuDecode(model, kv, kernel).forward(step)
    # The step wrote the same K/V (up to the rotary's rounding) into the same slots.
    assert (kv.k.float() - eager_kv[0].float()).abs().max() <= 0.02 * eager_kv[0].abs().max()
    return fast, eager


@pytest.mark.parametrize("family, lengths", [("llama", [5, 17, 9]), ("qwen2", [5, 17, 9]),
                                             ("qwen3", [5, 17, 9]), ("phi3", [5, 17, 9]),
                                             ("llama", [300, 700])])
def test_kernel_matches_eager_on_dense_bfloat16(tmp_path, kernel, family, lengths):
    folder = save_tiny_hf_model(tmp_path / family, family)
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    fast, eager = _decode_both(model, kernel, lengths)
    assert fast.dtype == torch.bfloat16 and fast.shape == eager.shape
    # bfloat16 rounding in different places: a few ulps of the hidden states' scale.
    assert (fast.float() - eager.float()).abs().max() <= 0.03 * eager.abs().max()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_kernel_matches_eager_on_gemma(tmp_path, kernel, family):
    """Gemma's (1 + w) norms around each sublayer, GELU, its attention scale, soft-capped
    scores (Gemma 2), q/k norms and the local layers' own rotary (Gemma 3), with prompts
    longer than the window."""
    from test_model_families import NEW_FAMILIES

    # Weights 10x the default scale: attention scores large enough for the cap to bite.
    folder = save_tiny_hf_model(tmp_path / family, "llama", **NEW_FAMILIES[family],
                                initializer_range=0.2)
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    fast, eager = _decode_both(model, kernel, [5, 40, 9])
    assert (fast.float() - eager.float()).abs().max() <= 0.03 * eager.abs().max()
    # A row's hidden state is the same bits however its sequence was stepped (windows of 8).
    folder = save_tiny_hf_model(tmp_path / "window", "llama", initializer_range=0.2,
                                **{**NEW_FAMILIES[family], "sliding_window": 8})
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.config.vocab_size, (40,), generator=gen) for _ in range(3)]
    alone = _rows_of(model, kernel, [[(0, 40)]], ids[:1], torch.bfloat16)
    for steps in LAYOUTS:
        rows = _rows_of(model, kernel, steps, ids, torch.bfloat16)
        for position in range(40):
            if (0, position) in rows:
                assert torch.equal(rows[(0, position)], alone[(0, position)]), (steps, position)


def test_kernel_matches_eager_on_gguf_blocks(kernel, tiny_gguf, monkeypatch, tmp_path):
    from radixlm.runtime.models import gguf_loader

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    model = load_model(tiny_gguf, "auto", torch.bfloat16, torch.device("cpu")).model
    assert model.quant.method == "gguf"
    fast, eager = _decode_both(model, kernel, [3, 30])
    assert (fast.float() - eager.float()).abs().max() <= 0.03 * eager.abs().max()


def test_what_the_kernel_does_not_cover(tmp_path):
    folder = save_tiny_hf_model(tmp_path / "llama-bias", "llama", mlp_bias=True)
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    cfg = model.config
    attn = TorchNativeAttention(0.1)

    def cache(dtype):
        return KVCache(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype,
                       torch.device("cpu"), page_size=4)
    assert "MLP biases" in unsupported(model, attn, cache(torch.bfloat16))
    llama = load_model(str(save_tiny_hf_model(tmp_path / "llama", "llama")), "auto",
                       torch.float32, torch.device("cpu")).model
    assert unsupported(llama, attn, cache(torch.float32)) is None  # float32 is covered
    assert "not both" in unsupported(llama, attn, cache(torch.bfloat16))


def test_sliding_windows_match_eager_and_do_not_depend_on_the_step(tmp_path, kernel):
    """A window of 8 positions: prefills and decode steps past it against the eager path,
    and a row's hidden state the same bits however its sequence was stepped."""
    folder = save_tiny_hf_model(tmp_path, "mistral", sliding_window=8)
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    assert [layer.self_attn.attends.sliding_window for layer in model.model.layers] == [8, 8]
    fast, eager = _decode_both(model, kernel, [5, 17, 30])
    assert (fast.float() - eager.float()).abs().max() <= 0.03 * eager.abs().max()
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, model.config.vocab_size, (40,), generator=gen) for _ in range(3)]
    alone = _rows_of(model, kernel, [[(0, 40)]], ids[:1], torch.bfloat16)
    for steps in ([[(0, 7)], [(0, 13)], [(0, 20)]], [[(0, 30)]] + [[(0, 1)]] * 10,
                  [[(1, 25), (0, 10)], [(0, 30), (1, 1), (2, 40)]]):
        rows = _rows_of(model, kernel, steps, ids, torch.bfloat16)
        for position in range(40):
            if (0, position) in rows:
                assert torch.equal(rows[(0, position)], alone[(0, position)]), (steps, position)


def _reference_attention(q, k_cache, v_cache, pages, seq, position, page_size, kv_heads,
                         scale, softcap, window) -> torch.Tensor:
    """One row's attention in float64: q [heads, head_dim] over its sequence's positions."""
    first = max(0, position - window + 1) if window else 0
    slots = [int(pages[seq, j // page_size]) * page_size + j % page_size
             for j in range(first, position + 1)]
    heads, head_dim = q.shape
    keys = k_cache[slots].double().view(len(slots), kv_heads, head_dim)
    values = v_cache[slots].double().view(len(slots), kv_heads, head_dim)
    kv_of = torch.arange(heads) // (heads // kv_heads)
    scores = torch.einsum("hd,jhd->hj", q.double(), keys[:, kv_of]) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("hj,jhd->hd", scores.softmax(-1), values[:, kv_of])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("softcap, window", [(0.0, 0), (30.0, 0), (0.0, 37)])
def test_step_attention_matches_a_reference_and_not_its_step(kernel, dtype, softcap, window):
    """The kernel's attention against float64, for a step of many rows (a 200-row prefill
    chunk beside decode rows: a task per row block and KV head, each run whole) and for each
    row alone (too few tasks to go round the threads: scores, softmax and values each run as
    a loop of their own over finer units). A row's output has the same bits either way."""
    heads, kv_heads, head_dim, page_size = 8, 4, 48, 16
    gen = torch.Generator().manual_seed(7)
    lengths = [260, 90, 33]  # tokens each sequence has in the cache
    pages_per_seq = -(-max(lengths) // page_size)
    order = torch.randperm(len(lengths) * pages_per_seq, generator=gen)  # scattered pages
    pages = order.view(len(lengths), pages_per_seq).contiguous()
    slots = order.numel() * page_size
    k_cache = torch.randn(slots, kv_heads * head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads * head_dim, generator=gen).to(dtype)
    width = (heads + 2 * kv_heads) * head_dim  # q, then the step's own k and v (unread here)
    rows = [(0, p) for p in range(40, 240)] + [(1, 89), (2, 32)]
    qkv = (torch.randn(len(rows), width, generator=gen) * 2).to(dtype)
    token_seq = torch.tensor([s for s, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    scale = head_dim ** -0.5

    def run(at: list[int]) -> torch.Tensor:
        return kernel.attention(qkv[at].contiguous(), k_cache, v_cache, pages, token_seq[at],
                                positions[at], page_size, heads, kv_heads, head_dim, scale,
                                softcap, window)

    together = run(list(range(len(rows))))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for i, (seq, position) in enumerate(rows):
        if i % 7 and i < len(rows) - 2:
            continue  # every seventh row of the chunk, and the decode rows
        want = _reference_attention(qkv[i, :heads * head_dim].view(heads, head_dim), k_cache,
                                    v_cache, pages, seq, position, page_size, kv_heads, scale,
                                    softcap, window)
        got = together[i].view(heads, head_dim).double()
        assert (got - want).abs().max() <= tolerance * want.abs().max(), (seq, position)
        assert torch.equal(run([i])[0], together[i]), (seq, position)


def test_engine_decodes_through_the_kernel(kernel):
    from radixlm.runtime import Engine

    prompts = ["Explain why the sky is blue.", "List three uses of Python.",
               "Why do cats purr?"]
    params = {"max_new_tokens": 32, "temperature": 0, "logprobs": True}
    with Engine(max_total_tokens=2048) as fast:
        assert fast.core.runner.cpu_decode is not None
        ids = [fast.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        outs = fast.generate(input_ids=ids, sampling_params=params)
        stats = fast.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    with Engine(max_total_tokens=2048, disable_cpu_kernel=True) as eager:
        assert eager.core.runner.cpu_decode is None
    with Engine(max_total_tokens=2048, dtype="float32", disable_cpu_kernel=True) as exact:
        want = [exact.score(i, [o.token_ids])[0] for i, o in zip(ids, outs)]
    got = [[entry.logprob for entry in o.logprobs] for o in outs]
    deltas = [abs(a - b) for w, g in zip(want, got) for a, b in zip(w, g)]
    # Measured 0.026 for the kernel, 0.029 for the eager bfloat16 path (docs/performance.md).
    assert statistics.mean(deltas) < 0.06, statistics.mean(deltas)


# --- determinism: each row's result is the same whatever else the step holds -----------------

@pytest.mark.parametrize("planes, group, rows", [(1, 32, 70), (2, 32, 40), (1, 64, 33)])
def test_linear_rows_do_not_depend_on_the_batch(kernel, planes, group, rows):
    from radixlm.runtime.models.quantization.cpu_weights import (
        Plane,
        dequantize_planes,
        tile_planes,
    )

    gen = torch.Generator().manual_seed(planes * group)
    n, k = 37, 128  # n: not a whole number of 16-channel tiles
    parts = [Plane(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                   torch.rand(n, k // group, generator=gen) * 0.02,
                   torch.randn(n, k // group, generator=gen) * 0.01) for _ in range(planes)]
    tiles = tile_planes(parts)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        full = kernel.planes_linear(x, list(tiles), n, True)
        want = x.double() @ dequantize_planes(parts).double().t()
        assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max()
        for start, stop in [(0, 1), (5, 6), (0, 3), (2, 9), (7, rows)]:
            assert torch.equal(kernel.planes_linear(x[start:stop], list(tiles), n, True),
                               full[start:stop])


@pytest.mark.parametrize("bits, group, symmetric", [(1, 32, True), (2, 16, False),
                                                    (4, 32, True), (4, 32, False)])
def test_compact_high_planes(kernel, bits, group, symmetric):
    """5- and 6-bit codes' high plane in 1 or 2 bits, its scales derived from the low plane's
    (16 times them), and a symmetric format's zeros derived too (a factor per channel times
    the scales): fewer bytes than two nibble planes with both scales and every zero stored,
    the same weights, and each row still its own. A 4-bit high plane gives the same bits as
    the wide form, except where bfloat16 inputs are held as int16: there, as 1 and 2 bits
    always are, it is read with the low nibble as one code, so its sums are the whole
    code's (compared with the exact product)."""
    from radixlm.runtime.models.quantization.cpu_weights import (
        Plane,
        dequantize_planes,
        tile_planes,
    )

    gen = torch.Generator().manual_seed(bits)
    n, k = 37, 128
    # float16 scales, as the files store them: a small factor times one is exact
    scale = (torch.rand(n, k // group, generator=gen) * 0.02).half().float()
    zero = (torch.randint(0, 200, (n, 1), generator=gen) * scale if symmetric
            else torch.randn(n, k // group, generator=gen) * 0.01)
    # As the formats split their codes: 16 hi + lo, the high plane first.
    planes = [Plane(torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8),
                    16 * scale, zero),
              Plane(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), scale,
                    torch.zeros(n, k // group))]
    compact, wide = tile_planes(planes), tile_planes(planes, compact=False)
    assert compact.hi.shape[1] == k * bits // 32 and compact.scales.shape[2] == 1
    assert compact.zeros.dim() == (2 if symmetric else 3)
    assert compact.scales.dtype == torch.float16
    assert wide.hi.shape[1] == k // 8 and wide.scales.shape[2] == 2
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(19, k, generator=gen).to(dtype)
        full = kernel.planes_linear(x, list(compact), n, True)
        whole_codes = dtype == torch.bfloat16 and kernel.pair_inputs() == "int16"
        if bits == 4 and not whole_codes:
            assert torch.equal(full, kernel.planes_linear(x, list(wide), n, True))
        want = x.double() @ dequantize_planes(planes).double().t()
        assert (full.double() - want).abs().max() <= 1e-5 * want.abs().max()
        for start, stop in [(3, 4), (0, 1), (5, 13)]:
            assert torch.equal(kernel.planes_linear(x[start:stop], list(compact), n, True),
                               full[start:stop])


@pytest.mark.parametrize("bits, group", [(2, 16), (0, 32)])
def test_inputs_of_any_size_in_one_group(kernel, bits, group):
    """A group of inputs may hold an outlier beside values a million times smaller. On a CPU
    with AVX512-VNNI but no BF16 the kernel sums bfloat16 inputs as int16 under a power of two
    per group, each within 2^-15 of its group's largest |x| (exact within 2^7 of it); on the
    others the float32 sums are closer still. Either way the result is that close to the
    exact product. A channel whose weights are zero as codes at their offset and a zero that
    cancels them gives zero to float32 rounding (the zeros' term must sum the same inputs as
    the codes'), and a NaN or an infinity in a row makes that row's outputs non-finite and
    leaves the other rows' bits as they were."""
    from radixlm.runtime.models.quantization.cpu_weights import (
        Plane,
        dequantize_planes,
        tile_planes,
    )

    gen = torch.Generator().manual_seed(bits + group)
    n, k, rows = 37, 128, 9
    scale = (torch.rand(n, k // group, generator=gen) * 0.02).half().float()
    planes = [Plane(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), scale,
                    torch.randn(n, k // group, generator=gen) * 0.01)]
    if bits:  # a 6-bit code: 16 hi + lo, the high plane first
        planes.insert(0, Plane(torch.randint(0, 1 << bits, (n, k), generator=gen,
                                             dtype=torch.uint8), 16 * scale,
                               torch.zeros(n, k // group)))
    # channel 0: the largest code (16 * 3 + 15 - 136 = -73 read whole, or 15 - 8) cancelled
    planes[-1].codes[0] = 15
    planes[-1].zero[0] = (73 if bits else -7) * scale[0]
    if bits:
        planes[0].codes[0] = 3
    tiles, weight = tile_planes(planes), dequantize_planes(planes).double()
    assert weight[0].eq(0).all()
    sizes = 10.0 ** (torch.rand(rows, k, generator=gen) * 7 - 4)  # 1e-4 .. 1e3
    x = (torch.randn(rows, k, generator=gen) * sizes).bfloat16()
    x[0] = 0  # a row of zeros
    full = kernel.planes_linear(x, list(tiles), n, True).double()
    want = x.double() @ weight.t()
    largest = x.double().abs().unflatten(1, (-1, group)).amax(2)  # [rows, groups]
    bound = (largest.repeat_interleave(group, 1) * 2.0 ** -15
             + x.double().abs() * 1e-6) @ weight.abs().t()
    assert (full - want)[:, 1:].abs().le(bound[:, 1:]).all()
    assert full[0].eq(0).all()
    stored = x.double().abs() @ (2 * planes[-1].zero[0].double().abs()).repeat_interleave(group)
    assert full[:, 0].abs().le(1e-6 * stored).all()
    bad = x.clone()
    bad[2, 5], bad[6, 100] = float("nan"), float("inf")
    out = kernel.planes_linear(bad, list(tiles), n, True).double()
    assert not out[[2, 6]].isfinite().any()
    others = [r for r in range(rows) if r not in (2, 6)]
    assert torch.equal(out[others], full[others])


def _formats_outputs(kernel) -> dict[str, torch.Tensor]:
    """planes_linear on random planes of the formats' shapes (4-bit codes, 5- and 6-bit
    codes read whole, two nibble planes, and the same with derived scales: 8-bit codes,
    read whole from int16 inputs), bfloat16 and float32 inputs, 9 rows at once and row 3
    alone. 1,024 inputs: past one chunk (CHUNK_INPUTS), so that 9 rows carry their sums
    from one chunk to the next where one row sums all inputs in one pass."""
    from radixlm.runtime.models.quantization.cpu_weights import Plane, tile_planes

    out = {}
    for bits, group, compact in ((0, 32, True), (1, 32, True), (2, 16, True), (4, 32, False),
                                 (4, 32, True)):
        gen = torch.Generator().manual_seed(bits)
        n, k = 37, 1024
        scale = (torch.rand(n, k // group, generator=gen) * 0.02).half().float()
        planes = [Plane(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                        scale, torch.randn(n, k // group, generator=gen) * 0.01)]
        if bits:
            planes.insert(0, Plane(torch.randint(0, 1 << bits, (n, k), generator=gen,
                                                 dtype=torch.uint8), 16 * scale,
                                   torch.zeros(n, k // group)))
        tiles = list(tile_planes(planes, compact=compact))
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(9, k, generator=gen) * 3).to(dtype)
            form = f"{bits}/{'compact' if compact else 'wide'}/{dtype}"
            out[form] = kernel.planes_linear(x, tiles, n, True)
            out[f"{form}/row 3"] = kernel.planes_linear(x[3:4], tiles, n, True)
    return out


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 build")
def test_an_avx2_build_gives_the_same_bits(kernel, tmp_path):
    """Most laptops' x86 CPUs have AVX2 but not AVX-512. Built for them (RADIXLM_CPU_MARCH=
    x86-64-v3), the kernel sums int16 inputs in 8-lane halves of a tile (vpmaddwd) where a
    CPU with AVX-512 but no BF16 sums whole tiles (vpdpwssd): both sums are exact integers, so
    the bits are the same; float32 inputs take float32 lanes of either width, the same
    fused multiply-adds. Checked against this build where it sums int16 too, and on its own
    for rows that do not depend on the batch."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU cannot run an AVX2 build")
    script = ("import sys, torch; sys.path.insert(0, sys.argv[2]); import test_cpu_decode as t; "
              "from radixlm.kernels import cpu_decode as kb; k = kb.load(); "
              "assert k.pair_inputs() == 'int16', k.pair_inputs(); "
              "torch.save(t._formats_outputs(k), sys.argv[1])")
    env = dict(os.environ, RADIXLM_CPU_MARCH="x86-64-v3")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "avx2.pt"),
                    str(Path(__file__).parent)], env=env, check=True, timeout=900)
    avx2 = torch.load(tmp_path / "avx2.pt")
    native = _formats_outputs(kernel)
    for key, value in avx2.items():
        if key.endswith("row 3"):
            assert torch.equal(value, avx2[key.removesuffix("/row 3")][3:4]), key
        if "float32" in key or kernel.pair_inputs() == "int16":
            assert torch.equal(value, native[key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_rows_do_not_depend_on_the_batch(kernel, dtype):
    from radixlm.runtime.models.quantization.cpu_weights import tile_dense

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(45, 96, generator=gen).to(dtype)
    x = torch.randn(21, 96, generator=gen).to(dtype)
    full = kernel.dense_linear(x, tile_dense(weight), 45, False)
    want = x.double() @ weight.double().t()
    assert full.dtype == dtype
    assert (full.double() - want).abs().max() <= 0.01 * want.abs().max()
    for start, stop in [(0, 1), (3, 4), (1, 8), (4, 21)]:
        assert torch.equal(kernel.dense_linear(x[start:stop], tile_dense(weight), 45, False),
                           full[start:stop])


# Ways to step sequence 0's 40 tokens (sequences 1 and 2 beside it), as (sequence, tokens).
LAYOUTS = [
    [[(0, 7)], [(0, 13)], [(0, 20)]],  # chunked prefill
    [[(0, 30)]] + [[(0, 1)]] * 10,  # prefill, then decode steps
    [[(1, 25), (0, 10)], [(0, 30), (1, 1), (2, 40)]],  # beside other sequences' chunks
    # decoded in a batch of others, at different places in it
    [[(2, 9), (1, 3), (0, 1)]] + [[(0, 1), (2, 1)]] * 31 + [[(1, 1), (0, 1)]] * 8,
]


def _rows_of(model, kernel, steps: list[list[tuple[int, int]]], ids: list[torch.Tensor],
             dtype: torch.dtype) -> dict[tuple[int, int], torch.Tensor]:
    """Run `steps` through the kernel on one cache: each step is (sequence, tokens) chunks,
    taken in order from each sequence's ids. The hidden row of every (sequence, position)."""
    cfg = model.config
    page, per_seq = 4, 64
    kv = KVCache(cfg.num_layers, len(ids) * per_seq, cfg.num_kv_heads, cfg.head_dim, dtype,
                 torch.device("cpu"), page_size=page)
    # Sequence s owns pages in reverse order from a block of its own.
    tables = [torch.tensor([p * page + o for p in reversed(range(s * per_seq // page,
                                                                  (s + 1) * per_seq // page))
                            for o in range(page)]) for s in range(len(ids))]
    done = [0] * len(ids)
    rows: dict[tuple[int, int], torch.Tensor] = {}
    runner = CpuDecode(model, kv, kernel)
    for step in steps:
        positions = torch.cat([torch.arange(done[s], done[s] + n) for s, n in step])
        kv_lens = [done[s] + n for s, n in step]
        batch = ForwardBatch(
            input_ids=torch.cat([ids[s][done[s]:done[s] + n] for s, n in step]),
            positions=positions, q_lens=[n for _, n in step], kv_lens=kv_lens,
            out_slots=torch.cat([tables[s][done[s]:done[s] + n] for s, n in step]),
            slot_table=torch.stack([tables[s][:max(kv_lens)] for s, _ in step]), kv_cache=kv)
        hidden = runner.forward(batch)
        row = 0
        for s, n in step:
            for position in range(done[s], done[s] + n):
                rows[(s, position)] = hidden[row]
                row += 1
            done[s] += n
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_hidden_state_does_not_depend_on_its_step(kernel, tiny_gguf, monkeypatch,
                                                         tmp_path, dtype):
    """The same tokens prefilled whole, in chunks of any size, decoded one at a time, or
    beside other sequences: bit-identical hidden states (the CPU path's determinism)."""
    from radixlm.runtime.models import gguf_loader

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    model = load_model(tiny_gguf, "auto", dtype, torch.device("cpu")).model
    assert unsupported(model, TorchNativeAttention(0.1), KVCache(
        1, 8, 2, 16, dtype, torch.device("cpu"), page_size=4)) is None
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, model.config.vocab_size, (40,), generator=gen) for _ in range(3)]
    alone = _rows_of(model, kernel, [[(0, 40)]], ids[:1], dtype)
    for steps in LAYOUTS:
        rows = _rows_of(model, kernel, steps, ids, dtype)
        for position in range(40):
            if (0, position) in rows:
                assert torch.equal(rows[(0, position)], alone[(0, position)]), (steps, position)
