"""CUDA-graph decode and the fused kernels in the model, on CUDA (`pytest -m gpu`).

- A replayed graph computes exactly what the same padded batch computes eagerly (bitwise
  hidden states and logits), for batch sizes that need padding and ones that do not.
- The engine's greedy tokens are the same with graphs on and off.
- The fused norm/activation/rotary path agrees with the torch ops: within bf16 tolerance,
  and with identical greedy tokens in fp32.
"""

from __future__ import annotations

import types

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.models.loader import load_model

from conftest import save_tiny_hf_model
from test_triton_kernels import PROMPTS, rel_err, save_llama

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")]


def _needs(backend: str) -> None:
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")


def _decode_inputs(core, num: int, seed: int):
    """`num` fake running sequences with random contexts (up to ~300 tokens) on pages taken
    from the engine's allocator, and a random KV cache behind them."""
    gen = torch.Generator().manual_seed(seed)
    page = core.page_size
    core.kv_cache.k.normal_(generator=torch.Generator("cuda").manual_seed(seed))
    core.kv_cache.v.normal_(generator=torch.Generator("cuda").manual_seed(seed + 1))
    requests, ids, positions, rows, kv_lens = [], [], [], [], []
    for _ in range(num):
        kv_len = int(torch.randint(1, 300, (1,), generator=gen))
        pages = core.allocator.allocate(-(-kv_len // page))
        row = core.table.acquire()
        core.table.write_pages(row, 0, pages)
        requests.append(types.SimpleNamespace(pages=pages))
        ids.append(int(torch.randint(0, 512, (1,), generator=gen)))
        positions.append(kv_len - 1)
        rows.append(row)
        kv_lens.append(kv_len)
    return requests, ids, positions, rows, kv_lens


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_graph_replay_equals_eager_bitwise(tmp_path, backend, dtype):
    _needs(backend)
    folder = save_llama(tmp_path)
    with Engine(str(folder), device="cuda", dtype=dtype, max_total_tokens=16384,
                max_running_requests=24, attention_backend=backend) as engine:
        core = engine.core
        graphs = core.runner.cuda_graphs
        assert graphs is not None and sorted(bs for bs, _ in graphs.graphs) == [1, 2, 4, 8, 16, 24]
        model = core.runner.model
        for num, seed in [(1, 0), (3, 1), (8, 2), (13, 3), (24, 4)]:
            inputs = _decode_inputs(core, num, seed)
            bs = graphs.padded_size(num)
            with torch.inference_mode():
                replayed = graphs.forward(*inputs).clone()
                graph = graphs.graphs.pop((bs, False))  # the same padded batch, eagerly
                try:
                    eager = graphs.forward(*inputs).clone()
                finally:
                    graphs.graphs[bs, False] = graph
                assert torch.equal(replayed, eager), f"batch {num} (padded to {bs})"
                assert torch.equal(model.compute_logits(replayed), model.compute_logits(eager))
            for request, row in zip(inputs[0], inputs[3]):
                core.allocator.free(request.pages)
                core.table.release(row)


def _generate(folder, prompts, params, **options):
    with Engine(str(folder), device="cuda", max_total_tokens=8192,
                max_running_requests=16, **options) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def test_engine_greedy_same_with_and_without_graphs_fp32(tmp_path):
    folder = save_llama(tmp_path)
    # Requests end at different lengths, so decode batches shrink across padded sizes.
    params = [{"temperature": 0, "max_new_tokens": 8 + 5 * i, "ignore_eos": True,
               "logprobs": True} for i in range(len(PROMPTS))]
    options = dict(dtype="float32", attention_backend="triton", chunked_prefill_size=16)
    graph_tokens, graph_lps = _generate(folder, PROMPTS, params, **options)
    eager_tokens, eager_lps = _generate(folder, PROMPTS, params, disable_cuda_graph=True,
                                        **options)
    assert graph_tokens == eager_tokens
    worst = max(abs(a - b) for x, y in zip(graph_lps, eager_lps) for a, b in zip(x, y))
    # Padding changes the GEMM shapes and the decode split count, hence fp32 rounding only.
    assert worst < 1e-3, worst


def test_engine_flashinfer_graphs_match_eager_bf16(tmp_path):
    pytest.importorskip("flashinfer")
    folder = save_llama(tmp_path)
    prompts = [[7 + 3 * i] for i in range(8)]  # one-token prompts: every step is a decode
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "logprobs": True}
    options = dict(dtype="bfloat16", attention_backend="flashinfer")
    graph_tokens, graph_lps = _generate(folder, prompts, params, **options)
    eager_tokens, eager_lps = _generate(folder, prompts, params, disable_cuda_graph=True,
                                        **options)
    first = max(abs(x[0] - y[0]) for x, y in zip(graph_lps, eager_lps))
    assert graph_tokens == eager_tokens, f"first-token logprob gap {first:.2e}"


def _forward(loaded, dtype: torch.dtype, backend: str, lens: list[int]) -> torch.Tensor:
    """One prefill step of len(lens) fresh sequences through the model; [T, vocab] logits."""
    cfg = loaded.config
    page = 16
    cache = KVCache(cfg.num_layers, 4096, cfg.num_kv_heads, cfg.head_dim, dtype,
                    torch.device("cuda"), page)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (sum(lens),), generator=gen).cuda()
    positions = torch.cat([torch.arange(n) for n in lens]).cuda()
    width = -(-max(lens) // page) * page
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    start = 0
    for i, n in enumerate(lens):  # sequence i on consecutive slots from `start`
        table[i] = torch.arange(start, start + width)
        start += width
    table = table.cuda()
    out_slots = torch.cat([table[i, :n] for i, n in enumerate(lens)])
    batch = ForwardBatch(input_ids=ids, positions=positions, q_lens=lens, kv_lens=lens,
                         out_slots=out_slots, slot_table=table[:, :max(lens)], kv_cache=cache)
    attn = create_backend(backend, cfg.head_dim ** -0.5)
    attn.plan(batch)
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(batch, attn))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_kernels_close_to_torch_ops_bf16(tmp_path, family):
    folder = save_tiny_hf_model(tmp_path, family)
    loaded = load_model(str(folder), "auto", torch.bfloat16, torch.device("cuda"))
    assert loaded.model.fused is not None  # on by default on CUDA
    fused = _forward(loaded, torch.bfloat16, "triton", [37, 5, 64])
    loaded.model.use_fused_kernels(False)
    plain = _forward(loaded, torch.bfloat16, "triton", [37, 5, 64])
    assert rel_err(fused, plain) < 1e-2


def test_fused_kernels_same_greedy_tokens_fp32(tmp_path):
    folder = save_llama(tmp_path)
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    tokens = {}
    with Engine(str(folder), device="cuda", dtype="float32", max_total_tokens=8192,
                attention_backend="triton", disable_cuda_graph=True) as engine:
        for fused in (True, False):
            engine.core.runner.model.use_fused_kernels(fused)  # the engine thread is idle
            engine.flush_cache()
            tokens[fused] = [o.token_ids for o in engine.generate(input_ids=PROMPTS,
                                                                  sampling_params=params)]
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_overlap_schedule_changes_no_token(tmp_path, backend, dtype):
    """Follow-up steps fed by device-side tokens (graphs on) give exactly the tokens of the
    plain loop: same kernels, same batches, only the host's order of work differs. Seeded
    sampling and staggered lengths make requests finish at different steps."""
    _needs(backend)
    folder = save_llama(tmp_path)
    params = [{"temperature": 0, "max_new_tokens": 24 + 3 * i, "ignore_eos": True}
              for i in range(len(PROMPTS))]
    params[1] = {"temperature": 0.9, "seed": 5, "max_new_tokens": 40, "ignore_eos": True}
    outputs = {}
    for overlap in ("off", "on"):
        with Engine(str(folder), device="cuda", dtype=dtype, max_total_tokens=8192,
                    attention_backend=backend, overlap_schedule=overlap) as engine:
            outputs[overlap] = [o.token_ids for o in engine.generate(input_ids=PROMPTS,
                                                                     sampling_params=params)]
            stats = engine.stats()
            assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
            assert (stats["overlapped_steps"] > 0) == (overlap == "on")
    assert outputs["on"] == outputs["off"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_verify_steps_replay_graphs_and_keep_tokens(tmp_path, method):
    """Verify steps replay the decode graphs as one row per token (and the draft model its
    own graphs); greedy tokens equal plain decoding. fp32, where the kernels agree exactly
    enough for random weights' near-ties."""
    folder = save_llama(tmp_path)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompts = [p * 3 for p in PROMPTS]  # repeated text gives n-gram drafts something to hit
    options = dict(device="cuda", dtype="float32", max_total_tokens=16384,
                   attention_backend="triton")
    with Engine(str(folder), **options) as engine:
        plain = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    spec = {"speculative": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["draft_model"] = str(folder)  # the target itself: every draft is accepted
    with Engine(str(folder), **options, **spec) as engine:
        replays = []
        graphs = engine.core.runner.cuda_graphs
        forward = graphs.forward
        graphs.forward = lambda *a: replays.append(len(a[0])) or forward(*a)
        out = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        stats = engine.stats()
    assert out == plain
    assert stats["spec_accepted_tokens"] > 0
    assert any(n > len(prompts) for n in replays)  # verify steps went through the graphs
    if method == "draft":
        assert stats["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_fp8_kv_graphs_match_eager_bf16(tmp_path, backend):
    _needs(backend)
    folder = save_llama(tmp_path)
    prompts = [[7 + 3 * i] for i in range(8)] + PROMPTS[:4]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "logprobs": True}
    options = dict(dtype="bfloat16", attention_backend=backend, kv_cache_dtype="fp8_e4m3")
    graph_tokens, _ = _generate(folder, prompts, params, **options)
    eager_tokens, _ = _generate(folder, prompts, params, disable_cuda_graph=True, **options)
    assert graph_tokens == eager_tokens
