"""The CPU decode kernel (kernels/cpu_decode.cpp through runtime/execution/cpu_decode.py):
a decode step in one C++ call gives the eager bfloat16 path's hidden states, on dense and
GGUF-block weights, for ragged batches; the engine uses it where it applies and keeps its
pages; its decode is as close to the float32 reference as the eager path is."""

from __future__ import annotations

import statistics

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


def _decode_both(model, kernel, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill B sequences of `lengths` tokens eagerly, then run one decode step through the
    kernel and through the eager model on copies of the same cache; their hidden states."""
    cfg = model.config
    page = 4
    counts = [-(-(n + 1) // page) for n in lengths]  # pages each sequence needs
    kv = KVCache(cfg.num_layers, sum(counts) * page, cfg.num_kv_heads, cfg.head_dim,
                 torch.bfloat16, torch.device("cpu"), page_size=page)
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
                                             ("llama", [300, 700])])
def test_kernel_matches_eager_on_dense_bfloat16(tmp_path, kernel, family, lengths):
    folder = save_tiny_hf_model(tmp_path / family, family)
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    fast, eager = _decode_both(model, kernel, lengths)
    assert fast.dtype == torch.bfloat16 and fast.shape == eager.shape
    # bfloat16 rounding in different places: a few ulps of the hidden states' scale.
    assert (fast.float() - eager.float()).abs().max() <= 0.03 * eager.abs().max()


def test_kernel_matches_eager_on_gguf_blocks(kernel, tiny_gguf, monkeypatch, tmp_path):
    from radixlm.runtime.models import gguf_loader

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    model = load_model(tiny_gguf, "auto", torch.bfloat16, torch.device("cpu")).model
    assert model.quant.method == "gguf"
    fast, eager = _decode_both(model, kernel, [3, 30])
    assert (fast.float() - eager.float()).abs().max() <= 0.03 * eager.abs().max()


def test_what_the_kernel_does_not_cover(tmp_path):
    folder = save_tiny_hf_model(tmp_path / "qwen3", "qwen3")
    model = load_model(str(folder), "auto", torch.bfloat16, torch.device("cpu")).model
    cfg = model.config
    attn = TorchNativeAttention(0.1)

    def cache(dtype):
        return KVCache(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype,
                       torch.device("cpu"), page_size=4)
    assert "q/k norms" in unsupported(model, attn, cache(torch.bfloat16))
    llama = load_model(str(save_tiny_hf_model(tmp_path / "llama", "llama")), "auto",
                       torch.float32, torch.device("cpu")).model
    assert unsupported(llama, attn, cache(torch.float32)) is None  # float32 is covered
    assert "not both" in unsupported(llama, attn, cache(torch.bfloat16))


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
