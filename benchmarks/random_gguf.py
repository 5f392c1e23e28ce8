"""Random-weight GGUF files of other families at the shapes of real small checkpoints, for
speed runs that cannot download the real ones (benchmarks/cpu_decode.py --families).

Each file is written in llama.cpp's own layout (tensor names, metadata keys, Gemma's norms
stored as 1 + w) in float16, with the embedded SmolLM2's tokenizer and chat template; its
token list is padded with unused tokens up to the family's vocabulary, so that the output
head has the real size. llama.cpp's quantizer then writes the K-quant types from it. Speed
does not depend on the weights' values; the outputs are noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# Shapes of released checkpoints: Gemma 3 270M, Qwen3 0.6B, Gemma 2 2B (its vocabulary and
# widths, 8 of its 26 layers, to keep the file small), Qwen3-30B-A3B (its vocabulary and
# widths, top-8 routing, 16 of its 48 layers and 16 of its 128 experts: a batch-1 token
# reads the same bytes per layer as the real model's, the file is 1.1 GB instead of 18).
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": dict(like="Gemma 3 270M", hidden=640, layers=18, heads=4,
                   kv_heads=1, head_dim=256, ffn=2048, vocab=262144, window=512,
                   rope_theta=1_000_000.0, rope_theta_swa=10_000.0),
    "qwen3": dict(like="Qwen3 0.6B", hidden=1024, layers=28, heads=16,
                  kv_heads=8, head_dim=128, ffn=3072, vocab=151936, rope_theta=1_000_000.0),
    "gemma2": dict(like="Gemma 2 2B, 8 of 26 layers", hidden=2304, layers=8,
                   heads=8, kv_heads=4, head_dim=256, ffn=9216, vocab=256000, window=4096,
                   rope_theta=10_000.0, attn_softcap=50.0, final_softcap=30.0),
    "qwen3moe": dict(like="Qwen3-30B-A3B, 16 of 48 layers, 16 of 128 experts", hidden=2048,
                     layers=16, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=151936,
                     rope_theta=1_000_000.0, experts=16, experts_used=8, expert_ffn=768),
}


def write_random_gguf(path: Path, family: str, tokenizer_file: Path, seed: int = 0) -> None:
    """Write the family's random float16 GGUF to `path` (through a partial file, so that a
    killed run leaves nothing under the final name)."""
    import gguf

    spec = FAMILIES[family]  # keyed by the GGUF architecture's name
    arch, d, layers = family, spec["hidden"], spec["layers"]
    heads, kv_heads, head_dim, ffn = spec["heads"], spec["kv_heads"], spec["head_dim"], spec["ffn"]
    gemma = arch.startswith("gemma")
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    writer.add_name(f"random {spec['like']}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(spec["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if "window" in spec:
        writer.add_sliding_window(spec["window"])
    if "rope_theta_swa" in spec:
        writer.add_rope_freq_base_swa(spec["rope_theta_swa"])
    if "experts" in spec:
        writer.add_expert_count(spec["experts"])
        writer.add_expert_used_count(spec["experts_used"])
        writer.add_expert_feed_forward_length(spec["expert_ffn"])
    if "attn_softcap" in spec:
        writer.add_attn_logit_softcapping(spec["attn_softcap"])
        writer.add_final_logit_softcapping(spec["final_softcap"])
    _copy_tokenizer(writer, tokenizer_file, spec["vocab"])

    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def norm(size: int) -> np.ndarray:  # Gemma's files store 1 + w; both are near 1
        return (1.0 + rng.standard_normal(size, dtype=np.float32) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(spec["vocab"], d))
    writer.add_tensor("output_norm.weight", norm(d))
    for i in range(layers):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", norm(d))
        writer.add_tensor(blk + "attn_q.weight", matrix(heads * head_dim, d))
        writer.add_tensor(blk + "attn_k.weight", matrix(kv_heads * head_dim, d))
        writer.add_tensor(blk + "attn_v.weight", matrix(kv_heads * head_dim, d))
        writer.add_tensor(blk + "attn_output.weight", matrix(d, heads * head_dim))
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            writer.add_tensor(blk + "attn_q_norm.weight", norm(head_dim))
            writer.add_tensor(blk + "attn_k_norm.weight", norm(head_dim))
        if gemma:
            writer.add_tensor(blk + "post_attention_norm.weight", norm(d))
            writer.add_tensor(blk + "post_ffw_norm.weight", norm(d))
        writer.add_tensor(blk + "ffn_norm.weight", norm(d))
        if "experts" in spec:  # a router and the experts stacked [E, ...]
            experts, width = spec["experts"], spec["expert_ffn"]
            writer.add_tensor(blk + "ffn_gate_inp.weight",
                              matrix(experts, d).astype(np.float32))
            for name, (rows, cols) in (("gate", (width, d)), ("up", (width, d)),
                                       ("down", (d, width))):
                writer.add_tensor(f"{blk}ffn_{name}_exps.weight",
                                  np.stack([matrix(rows, cols) for _ in range(experts)]))
            continue
        writer.add_tensor(blk + "ffn_gate.weight", matrix(ffn, d))
        writer.add_tensor(blk + "ffn_up.weight", matrix(ffn, d))
        writer.add_tensor(blk + "ffn_down.weight", matrix(d, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)


def _copy_tokenizer(writer: Any, source: Path, vocab: int) -> None:
    """The source file's tokenizer and chat template, its token list padded to `vocab`."""
    import gguf

    reader = gguf.GGUFReader(str(source))

    def field(name: str) -> Any:
        return reader.fields[name].contents()

    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type"))
    pad = vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(pad)]
    types += [gguf.TokenType.UNUSED] * pad
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(field("tokenizer.ggml.merges")))
    writer.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))
    writer.add_add_bos_token(False)
    writer.add_chat_template(field("tokenizer.chat_template"))
