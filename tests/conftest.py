"""Shared fixtures: tiny random models of each supported family, and the real default model."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

# With the repository root on sys.path (`python -m pytest` from it puts it there), kernels/
# would be importable as a top-level `kernels` and shadow the Hugging Face package of that name
# that transformers imports. Importing radixlm takes the root off the path
# (lang/source_checkout.py), as it does in the servers the tests start (`python -m radixlm...`
# imports radixlm first).
import radixlm  # noqa: F401  (before any test imports transformers)

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
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0),
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


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """A two-layer Llama GGUF whose linears are Q4_0, Q4_1, Q5_0 and Q8_0 (the head Q8_0)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ffn, vocab = 64, 4, 2, 96, 128
    head_dim = hidden // heads
    kinds = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_0",
             "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 2, "embedding_length": hidden, "feed_forward_length": ffn,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                       "context_length": 256}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)

    def add(name: str, shape: tuple[int, ...], kind: str | None, scale: float = 0.05) -> None:
        values = rng.normal(0, scale, shape).astype(np.float32)
        if kind is None:
            writer.add_tensor(name, values)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), "Q8_0", 1.0)
    add("output_norm.weight", (hidden,), None, 0.1)
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", (hidden,), None, 0.1)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), None, 0.1)
        for base, kind in kinds.items():
            add(f"blk.{i}.{base}.weight", shapes[base], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@functools.cache
def _tokenizers(folder: Path) -> tuple[Any, Any]:
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def structural_tag_acceptor(tag: Any, folder: Path) -> Callable[..., bool]:
    """accepts(text, ids=None): does the structural tag's grammar, on the tokenizer in
    `folder`, take the whole text (or these token ids) and accept there?"""
    import llguidance

    from radixlm.runtime.grammar import structural_tag
    from radixlm.runtime.grammar.structural_tag import special_tokens

    tokenizer, lltok = _tokenizers(folder)
    grammar = structural_tag.to_lark(structural_tag.check(tag), special_tokens(tokenizer),
                                     {"whitespace_flexible": False})

    def accepts(text: str = "", ids: list[int] | None = None) -> bool:
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        ids = ids if ids is not None else tokenizer.encode(text, add_special_tokens=False)
        return (matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
                and matcher.is_accepting())
    return accepts
