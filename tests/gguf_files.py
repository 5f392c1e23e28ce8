"""Writing tiny GGUF files in llama.cpp's layout, for the conversion tests: the metadata keys
every family's file has, then the family's own, then the tensors (Q8_0 where asked).

    writer = gguf_writer(path, "qwen2moe", cfg)
    writer.add_expert_count(...)                  # the family's keys
    write_tensors(writer, tensors, q8_0)
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def gguf_writer(path: Path, arch: str, cfg: dict) -> gguf.GGUFWriter:
    """A writer with the keys llama.cpp's converter writes for every family, from the
    transformers config `cfg`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])  # min_new_tokens holds it back on both sides
    return writer


def write_tensors(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray],
                  q8_0: frozenset[str]) -> None:
    """Add the tensors (those named in `q8_0` quantized to Q8_0, the others as they are) and
    write the file."""
    for name, array in tensors.items():
        if name in q8_0:
            writer.add_tensor(name, gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
