"""Attention backends against the plain-torch reference, on a mixed ragged batch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from radixlm.kernels.reference import paged_attention_reference
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_batch(device: str, dtype: torch.dtype, page_size: int, q_lens: list[int],
               kv_lens: list[int], heads: int = 8, kv_heads: int = 2, dim: int = 32,
               seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-kv // page_size) for kv in kv_lens) + 8
    cache = KVCache(1, num_pages * page_size, kv_heads, dim, dtype, torch.device(device),
                    page_size)
    # Fill the whole cache with random "earlier" keys, then give each sequence random pages.
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    perm = torch.randperm(num_pages, generator=gen).tolist()
    width = max(kv_lens)
    table = torch.zeros(len(q_lens), -(-width // page_size) * page_size, dtype=torch.int64)
    for i, kv_len in enumerate(kv_lens):
        pages = [perm.pop() for _ in range(-(-kv_len // page_size))]
        slots = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).flatten()
        table[i, : slots.numel()] = slots
    table = table[:, :width].to(device)
    total = sum(q_lens)
    out_slots = torch.cat([table[i, kv - q:kv] for i, (q, kv) in
                           enumerate(zip(q_lens, kv_lens))])
    q = torch.randn(total, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
    batch = ForwardBatch(input_ids=torch.zeros(total, dtype=torch.int64, device=device),
                         positions=torch.zeros(total, dtype=torch.int64, device=device),
                         q_lens=q_lens, kv_lens=kv_lens, out_slots=out_slots,
                         slot_table=table, kv_cache=cache)
    return batch, q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_torch_backend_matches_reference(device, page_size):
    # decode (1 new of 37), a fresh prompt (all 20 new), a later chunk (9 new of 50),
    # another decode with a 1-token context, and a chunk ending on a page boundary.
    q_lens, kv_lens = [1, 20, 9, 1, 16], [37, 20, 50, 1, 64]
    batch, q, k, v = make_batch(device, torch.float32, page_size, q_lens, kv_lens)
    backend = create_backend("torch", scale=32 ** -0.5)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch)
    # The backend stored this step's K/V; the reference reads everything from the cache.
    ref = paged_attention_reference(q, batch.kv_cache.k[0], batch.kv_cache.v[0],
                                    batch.slot_table, q_lens, kv_lens, 32 ** -0.5)
    assert (out - ref).abs().max().item() < 1e-5
    assert torch.equal(batch.kv_cache.k[0][batch.out_slots], k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_backend_bf16_on_cuda():
    q_lens, kv_lens = [1, 30, 7], [100, 30, 77]
    batch, q, k, v = make_batch("cuda", torch.bfloat16, 16, q_lens, kv_lens)
    backend = create_backend("torch", scale=32 ** -0.5)
    backend.plan(batch)
    out = backend.forward(q, k, v, 0, batch)
    ref = paged_attention_reference(q, batch.kv_cache.k[0], batch.kv_cache.v[0],
                                    batch.slot_table, q_lens, kv_lens, 32 ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


def test_auto_backend_by_device():
    from radixlm.runtime.attention import resolve_backend
    from radixlm.runtime.attention.torch_native import TorchNativeAttention

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(create_backend("auto", 0.1, device=cpu), TorchNativeAttention)
    assert resolve_backend("auto") == "torch"
    assert resolve_backend("triton", cpu) == "triton"  # an explicit choice is kept
    # Deciding needs no GPU: CUDA gets our Triton kernels whatever the dtype and head size.
    expected = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    for dtype, head_dim in ((torch.float32, 128), (torch.bfloat16, 96), (torch.bfloat16, 128)):
        assert resolve_backend("auto", cuda, dtype, head_dim) == expected


def test_engine_default_backend_on_cpu_is_torch(tmp_path):
    from radixlm.runtime import Engine
    from radixlm.runtime.attention.torch_native import TorchNativeAttention
    from radixlm.runtime.config.engine_config import EngineConfig

    from conftest import save_tiny_hf_model

    assert EngineConfig().attention_backend == "auto"
    assert EngineConfig().disable_cuda_graph is False
    with pytest.raises(ValueError, match="disable_cuda_graph"):
        EngineConfig(disable_cuda_graph="yes")
    folder = save_tiny_hf_model(tmp_path, "llama")
    with Engine(str(folder), device="cpu", max_total_tokens=256) as engine:
        assert isinstance(engine.core.runner.attn, TorchNativeAttention)
        assert engine.core.runner.cuda_graphs is None
        assert engine.core.kv_cache.num_slots == engine.core.allocator.num_pages * 16
        assert engine.core.runner.model.fused is None
