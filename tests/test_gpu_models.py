"""The families beyond Llama, and the Llama module's sliding windows, on CUDA (marked gpu):
fp32 logits against transformers through the Triton backend and fused kernels, and decode
replayed from CUDA graphs giving the tokens of eager decode in bf16."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.models.loader import load_model

from test_model_families import reference_logits, save_family

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe", "gemma2", "gemma3", "phi3", "mistral-window",
            "qwen2-window"]


def _logits(loaded, ids: list[int], chunks: list[int], backend: str) -> torch.Tensor:
    cfg, device = loaded.config, torch.device("cuda")
    cache = KVCache(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.float32, device,
                    4)
    table = torch.arange(256, device=device).flip(0)[None, :]  # scattered slots
    attn = create_backend(backend, cfg.head_dim ** -0.5)
    out, start = [], 0
    for size in chunks:
        end = start + size
        batch = ForwardBatch(
            input_ids=torch.tensor(ids[start:end], device=device),
            positions=torch.arange(start, end, device=device), q_lens=[size], kv_lens=[end],
            out_slots=table[0, start:end], slot_table=table[:, :end], kv_cache=cache)
        attn.plan(batch)
        with torch.inference_mode():
            out.append(loaded.model.compute_logits(loaded.model(batch, attn)).cpu())
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_logits_match_transformers_fp32(tmp_path, family):
    folder = save_family(tmp_path, family, tie=family.startswith("gemma"))
    ids = torch.randint(3, 512, (1, 120), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(folder, ids)
    loaded = load_model(str(folder), "auto", torch.float32, torch.device("cuda"))
    ours = _logits(loaded, ids[0].tolist(), [50, 1, 1, 68], "triton")
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe", "gemma2", "gemma3", "qwen2-window"])
def test_gpu_graph_decode_equals_eager_bf16(tmp_path, family):
    folder = save_family(tmp_path, family, tie=family.startswith("gemma"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (90, 7, 40)]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    tokens = {}
    for graphs in (True, False):
        with Engine(str(folder), device="cuda", dtype="bfloat16", max_total_tokens=4096,
                    attention_backend="triton", disable_cuda_graph=not graphs) as engine:
            assert (engine.core.runner.cuda_graphs is not None) == graphs
            tokens[graphs] = [o.token_ids for o in engine.generate(input_ids=prompts,
                                                                   sampling_params=params)]
    assert tokens[True] == tokens[False]
