"""GGUF files of Gemma 2 ("gemma2"), Gemma 3 text ("gemma3") and Phi-3 ("phi3").

A tiny random transformers model is saved as a safetensors folder, and the same weights are
written as a GGUF file the way llama.cpp's converter lays them out (the gguf package's tensor
names and metadata keys, Gemma's norms stored with 1 added, Phi-3's fused attn_qkv and
[gate | up] ffn_up, its LongRoPE factors as rope_factors_long/short tensors). Loaded from the
GGUF, our model gives transformers' logits on the folder and its greedy tokens through the
engine. The configs switch each family's features on: soft-caps that bite, windows shorter
than the prompts, Gemma 3's local rope base beside a scaled global one, LongRoPE's long factors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radixlm.runtime.models import gguf_families, gguf_loader

from conftest import save_tiny_hf_model, tiny_config
from gguf_files import Q8_0, gguf_writer, write_tensors
from test_models import check_converted_logits, check_engine_greedy

CPU = torch.device("cpu")
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
             "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
             "original_max_position_embeddings": 64}
# name -> (GGUF architecture, transformers config on top of conftest's tiny Llama). GGUF has
# no query_pre_attn_scalar (llama.cpp uses head_dim below 27B), so Gemma's is head_dim here.
CASES = {
    "gemma2": ("gemma2", dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                              head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                              hidden_activation="gelu_pytorch_tanh", num_hidden_layers=3,
                              tie_word_embeddings=True)),
    # Six layers: llama.cpp's pattern makes the last one global.
    "gemma3": ("gemma3", dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                              head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                              num_hidden_layers=6,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"],
                              rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 1000000.0},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 20000.0}},
                              final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh",
                              tie_word_embeddings=True)),
    # Prompts beyond the 64-token pretraining length: transformers uses the long factors, as
    # our engine does when serving 1024 positions.
    "phi3": ("phi3", dict(architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0,
                          original_max_position_embeddings=64, rope_scaling=_LONGROPE,
                          sliding_window=24)),
}
_ARCHS = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
          "phi3": gguf.MODEL_ARCH.PHI3}


class FamilyFiles(NamedTuple):
    folder: Path  # the transformers model (with the dequantized weights for Q8_0)
    gguf: Path
    arch: str
    config: dict  # the transformers config it was made from
    q8_0: frozenset[str]  # GGUF tensors stored as Q8_0


def _gguf_names(hf_names, arch: str, layers: int) -> dict[str, str]:
    table = gguf.get_tensor_name_map(_ARCHS[arch], layers)
    names = {}
    for hf_name in hf_names:
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        names[hf_name] = name
    return names


def _write_gguf(path: Path, arch: str, cfg: dict, tensors: dict[str, np.ndarray],
                q8_0: frozenset[str]) -> None:
    """The keys llama.cpp's converter writes for the family (convert_hf_to_gguf.py)."""
    writer = gguf_writer(path, arch, cfg)
    writer.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(cfg["rope_theta"])
        scaling = cfg["rope_scaling"]
        original = scaling["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        tensors = {"rope_factors_long.weight": np.array(scaling["long_factor"], np.float32),
                   "rope_factors_short.weight": np.array(scaling["short_factor"], np.float32),
                   **tensors}
    else:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma2":
        writer.add_rope_freq_base(cfg["rope_theta"])
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if arch == "gemma3":
        rope = cfg["rope_parameters"]
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    write_tensors(writer, tensors, q8_0)


def _make_files(root: Path, case: str, quantized: bool) -> FamilyFiles:
    arch, overrides = CASES[case]
    cfg = tiny_config("llama") | overrides
    folder = save_tiny_hf_model(root / "hf", "llama", **overrides)
    weights = load_file(str(folder / "model.safetensors"))
    names = _gguf_names(weights, arch, cfg["num_hidden_layers"])
    q8_0 = frozenset(names[n] for n, t in weights.items()
                     if quantized and names[n].startswith("blk.") and t.ndim == 2)
    tensors = {}
    for hf_name, tensor in weights.items():
        name = names[hf_name]
        if name in q8_0:  # the folder gets exactly the weights the GGUF holds
            rounded = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), Q8_0), Q8_0)
            weights[hf_name] = tensor = torch.from_numpy(rounded.astype(np.float32))
        if arch != "phi3" and name.endswith("norm.weight"):
            # On a 2^-16 grid, w + 1 - 1 == w in float32: the round trip through llama.cpp's
            # +1 is exact, so the converted norms can be compared for equality.
            weights[hf_name] = tensor = torch.round(tensor * 2 ** 16) / 2 ** 16
            tensors[name] = tensor.numpy() + np.float32(1.0)
        else:
            tensors[name] = np.ascontiguousarray(tensor.numpy())
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = root / f"tiny-{case}.gguf"
    _write_gguf(path, arch, cfg, tensors, q8_0)
    return FamilyFiles(folder, path, arch, cfg, q8_0)


@pytest.fixture(scope="module", params=[("gemma2", "F32"), ("gemma3", "F32"), ("phi3", "F32"),
                                        ("phi3", "Q8_0")], ids=lambda p: f"{p[0]}-{p[1]}")
def family_files(request, tmp_path_factory) -> FamilyFiles:
    case, kind = request.param
    return _make_files(tmp_path_factory.mktemp(f"{case}-{kind}"), case, kind == "Q8_0")


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory, monkeypatch) -> Path:
    """Conversions land in one cache for this module; these files have no vocabulary, so the
    tokenizer step (covered in test_gguf_loader.py) is skipped."""
    root = tmp_path_factory.getbasetemp() / "gguf-families-cache"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(root))
    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    return root


def _fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's split projections joined again into transformers' qkv_proj and gate_up_proj."""
    out = dict(tensors)
    for fused, parts in ((".self_attn.qkv_proj.", ("q_proj", "k_proj", "v_proj")),
                         (".mlp.gate_up_proj.", ("gate_proj", "up_proj"))):
        module = fused.split(".")[1] + "."
        for name in [n for n in tensors if f".{module}{parts[0]}." in n]:
            names = [name.replace(f".{module}{parts[0]}.", f".{module}{p}.") for p in parts]
            out[name.replace(f".{module}{parts[0]}.", fused)] = torch.cat([out.pop(n)
                                                                          for n in names])
    return out


def test_converted_folder_holds_the_transformers_checkpoint(family_files):
    """Config fields the family's model reads, and every tensor: Gemma's norms without the
    +1, Phi-3's fused projections cut (joined again, they are the checkpoint's); Q8_0 rows
    keep their blocks."""
    from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks

    folder = gguf_loader.convert_gguf(family_files.gguf)
    config = json.loads((folder / "config.json").read_text())
    cfg = family_files.config
    assert config["architectures"] == cfg["architectures"]
    assert config["model_type"] == cfg["model_type"]
    assert config["sliding_window"] == cfg["sliding_window"]
    if family_files.arch == "phi3":
        assert config["rope_scaling"]["long_factor"] == pytest.approx(_LONGROPE["long_factor"])
        assert config["rope_scaling"]["short_factor"] == pytest.approx(
            _LONGROPE["short_factor"])
        assert config["original_max_position_embeddings"] == 64
    else:
        assert config["layer_types"] == (cfg.get("layer_types") or [
            "sliding_attention", "full_attention", "sliding_attention"])
        for key in ("query_pre_attn_scalar", "final_logit_softcapping", "hidden_activation"):
            assert config[key] == cfg[key], key
    if family_files.arch == "gemma2":
        assert config["attn_logit_softcapping"] == cfg["attn_logit_softcapping"]
    if family_files.arch == "gemma3":
        assert config["rope_local_base_freq"] == 20000.0
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert ("quantization_config" in config) == bool(family_files.q8_0)

    reference = load_file(str(family_files.folder / "model.safetensors"))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        types = json.loads(f.metadata()[gguf_loader.TYPES_METADATA])
        converted = {name: f.get_tensor(name) for name in f.keys()}
    assert bool(types) == bool(family_files.q8_0)
    converted = {name: GGUFBlocks.from_rows(types[name], t).dequantize() if name in types
                 else t for name, t in converted.items()}
    if family_files.arch == "phi3":
        assert any(".qkv_proj." in n for n in reference)
        converted = _fused(converted)
    assert set(converted) == set(reference)
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name


def test_logits_match_transformers(family_files):
    """Whole prompt and chunked prefill with single decode steps, float32: within 1e-4 of
    transformers on the folder (80 tokens: beyond the windows and Phi-3's short rope)."""
    check_converted_logits(family_files.folder, family_files.gguf,
                           family_files.config["architectures"][0], 80, [7, 1, 51, 1, 20])


def test_greedy_matches_transformers_through_the_engine(family_files):
    """Prompts sharing a prefix (cache hits), prefilled in chunks mixed with decode steps:
    transformers' greedy tokens."""
    check_engine_greedy(family_files.folder, family_files.gguf, shared=66)


def _meta(values: dict):
    return lambda key, default=None: values.get(key, default)


_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 4}


def test_gemma_config_defaults_and_overrides():
    """Without the keys: llama.cpp's pattern, soft-caps and head_dim scaling; a pattern key,
    attention.scale and the 27B layer count change them."""
    config = gguf_families.family_config("gemma2", _meta({"attention.sliding_window": 8}),
                                         _BASE, {})
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["query_pre_attn_scalar"] == 16
    keys = {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3,
            "attention.scale": 0.125}
    config = gguf_families.family_config("gemma3", _meta(keys), _BASE, {})
    assert config["layer_types"] == ["sliding_attention"] * 2 + ["full_attention",
                                                                 "sliding_attention"]
    assert config["query_pre_attn_scalar"] == pytest.approx(64.0)
    assert config["rope_local_base_freq"] == 10000.0 and config["final_logit_softcapping"] is None
    big = _BASE | {"num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32,
                   "head_dim": 128}
    config = gguf_families.family_config("gemma2", _meta({"attention.sliding_window": 8}), big,
                                         {})
    assert config["query_pre_attn_scalar"] == 144  # Gemma 2 27B: hidden / heads


@pytest.mark.parametrize("arch,keys,tensors,match", [
    ("gemma2", {}, (), "sliding_window"),
    ("phi3", {"rope.dimension_count": 12}, (), "partial rotary"),
    ("phi3", {"rope.scaling.type": "yarn"}, (), "yarn"),
    ("phi3", {}, ("rope_factors_long.weight",), "not the other"),
    ("phi3", {}, ("rope_factors_long.weight", "rope_factors_short.weight"),
     "original_context_length"),
])
def test_family_config_refuses_what_it_cannot_express(arch, keys, tensors, match):
    with pytest.raises(ValueError, match=match):
        gguf_families.family_config(arch, _meta(keys), _BASE, dict.fromkeys(tensors))
