"""Shared fixtures: tiny random models of each supported family, and the real default model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

# Tests are CPU tests unless marked `gpu`; keep the thread count modest and deterministic.
torch.set_num_threads(2)

FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3-rope": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
}


def tiny_config(family: str, vocab_size: int = 512, tie: bool = False) -> dict:
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=tie, hidden_act="silu", bos_token_id=1, eos_token_id=2,
               torch_dtype="float32")
    cfg.update(FAMILIES[family])
    return cfg


def save_tiny_hf_model(folder: Path, family: str, vocab_size: int = 512, tie: bool = False,
                       seed: int = 0, **overrides) -> Path:
    """Build a random transformers model of the family and save it as an HF folder.
    `overrides` replace config entries (e.g. num_key_value_heads=1)."""
    import transformers

    cfg_dict = tiny_config(family, vocab_size, tie)
    cfg_dict.update(overrides)
    config = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # default init leaves biases at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted to an HF folder (cached on disk)."""
    from radixlm.runtime.models.loader import resolve_model

    try:
        return resolve_model(None)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def save_tiny_chat_model(folder: Path, default_model_folder: Path, chat_template: str | None = None,
                         max_position_embeddings: int = 1024) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (vocab 49152) in `folder`, with
    SmolLM2's chat template or `chat_template`."""
    save_tiny_hf_model(folder, "llama", vocab_size=49152, tie=True, seed=1,
                       max_position_embeddings=max_position_embeddings)
    for f in default_model_folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, folder / f.name)
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = 2
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_folder) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (vocab 49152), for engine tests
    that need text in and out but not a good model."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), default_model_folder)
