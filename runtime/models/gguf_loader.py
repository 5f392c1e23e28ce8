"""Convert a GGUF model file into a Hugging Face-format model folder, cached on disk.

The engine loads HF folders (config.json + safetensors + tokenizer files), so a GGUF file is
written once as such a folder (its tensors in shards of about SHARD_BYTES); later loads find
it in the cache (gguf_cache.py) and skip the conversion.
Tensors of the block types our kernels run as they are (`gguf_blocks.NATIVE_TYPES`: Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) keep their blocks: uint8 [rows, bytes per row], their types in
the safetensors metadata (`gguf_types`) and `quantization_config.quant_method = "gguf"` in
config.json. Every other type is dequantized to float32 here. The loader decides per run
whether the blocks are used packed (quantization "gguf") or dequantized to float.
Mixture-of-experts files (Mixtral, Qwen2-MoE, Qwen3-MoE) add their config fields and expert
tensors through `gguf_moe`; experts keep their blocks as the other linears do (one slice per
expert), routers are always dequantized here. Gemma 2,
Gemma 3 and Phi-3 add theirs through `gguf_families` (Gemma's norms without llama.cpp's +1,
Phi-3's fused projections cut, its LongRoPE factors into the config).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from typing import Any, Iterator

import numpy as np

from radixlm.runtime.models import gguf_cache, gguf_families, gguf_moe
from radixlm.runtime.models.architecture.model_config import SIZE_LIMITS, check_fields
from radixlm.runtime.models.quantization.gguf_blocks import BLOCK_TYPES, NATIVE_TYPES, type_id

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_GGUF_ARCHITECTURES", "convert_gguf"]

# Bump when the output of the conversion changes, so that stale cache folders are not reused.
CONVERTER_VERSION = 3
TYPES_METADATA = "gguf_types"  # safetensors metadata: {tensor name: block type} as JSON

# GGUF architecture -> (HF architectures entry, HF model_type); "llama" with experts is
# Mixtral (gguf_moe.MIXTRAL).
_HF_CLASSES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    **gguf_families.HF_CLASSES,
}
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(_HF_CLASSES)

# llama.cpp stores q/k rows of these architectures in the interleaved-pairs rotary layout.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<kind>weight|bias)")


def convert_gguf(
    gguf_path: str | os.PathLike, cache_root: str | os.PathLike | None = None
) -> pathlib.Path:
    """Return a folder with config.json, safetensors, tokenizer files (incl. chat template)
    and generation_config.json for this GGUF file, converting it on first use."""
    return gguf_cache.converted_folder(gguf_path, _convert, CONVERTER_VERSION, cache_root)


def _convert(path: pathlib.Path, out_dir: pathlib.Path) -> None:
    # Heavy imports live here so that the cached path stays cheap.
    import gguf
    import torch

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # truncated or not a GGUF file at all
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(exc).__name__}: {exc}") from None
    arch = _field(reader, "general.architecture")
    if arch not in _HF_CLASSES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    config = _build_config(reader, arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    layer_table = (_LAYER_TENSORS | gguf_moe.layer_tensors(config["model_type"])
                   | gguf_families.layer_tensors(arch))
    config_tensors = gguf_families.config_tensors(arch)

    from tqdm.auto import tqdm

    shards = _ShardWriter(out_dir)
    for tensor in tqdm(reader.tensors, desc=f"converting {path.name}", unit="tensor",
                       leave=False, disable=None):
        if tensor.name in config_tensors:
            continue  # read into the config (Phi-3's LongRoPE factors)
        layer, base, kind = _parse_name(tensor.name, layer_table)
        # GGUF lists dimensions innermost-first; the numpy data is already row-major [out, in].
        expected = _expected_shape(arch, base, kind == "bias", config)
        type_name = tensor.tensor_type.name
        blocks = (type_name in NATIVE_TYPES and base not in gguf_moe.FLOAT_TENSORS
                  and (len(expected) == 2 or base in gguf_moe.EXPERT_TENSORS))
        if blocks:
            # [(experts,) rows, bytes per row]: the blocks, copied off the map
            data = np.array(tensor.data)
            _, per_block, block_bytes = BLOCK_TYPES[type_id(type_name)]
            shape = (*data.shape[:-1], data.shape[-1] // block_bytes * per_block)
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            data = gguf_families.hf_values(arch, base, gguf_moe.hf_layout(base, data))
            shape = data.shape
        if shape != expected:
            raise ValueError(f"{tensor.name}: shape {shape}, expected {expected} from config")
        data = rows_to_hf(arch, base, data, heads, kv_heads)  # whole rows: blocks too
        for part_base, part in gguf_families.split_fused(arch, base, data, config):
            for hf_name, array in _hf_tensors(layer, part_base, kind, part, layer_table):
                shards.add(hf_name, torch.from_numpy(np.ascontiguousarray(array)),
                           type_name if blocks else None)
    if shards.close():
        config["quantization_config"] = {"quant_method": "gguf"}

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        generation["pad_token_id"] = int(pad_id)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_tokenizer(path, out_dir, _field(reader, "tokenizer.chat_template"))


SHARD_BYTES = 2 << 30  # the converted tensors held in memory at a time


class _ShardWriter:
    """The converted tensors written as safetensors files of about SHARD_BYTES each, so
    that converting holds one shard in memory, not the model (an 18 GB mixture-of-experts
    file): `model.safetensors` when one file holds them all, else
    `model-0000i-of-0000n.safetensors` and their index. Each file's metadata names the
    GGUF block types of its tensors stored as blocks (TYPES_METADATA)."""

    def __init__(self, out_dir: pathlib.Path) -> None:
        self.out_dir = out_dir
        self.pending: dict[str, Any] = {}
        self.types: dict[str, str] = {}
        self.pending_bytes = 0
        self.written: list[tuple[pathlib.Path, list[str]]] = []
        self.any_blocks = False

    def add(self, name: str, tensor: Any, block_type: str | None) -> None:
        self.pending[name] = tensor
        if block_type is not None:
            self.types[name] = block_type
            self.any_blocks = True
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out_dir / f"part-{len(self.written)}.safetensors"
        save_file(self.pending, str(path),
                  metadata={"format": "pt", TYPES_METADATA: json.dumps(self.types)})
        self.written.append((path, list(self.pending)))
        self.pending, self.types, self.pending_bytes = {}, {}, 0

    def close(self) -> bool:
        """Write what is pending, name the files (and the index); whether any tensor kept
        its blocks."""
        self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.out_dir / "model.safetensors")
            return self.any_blocks
        weight_map = {}
        count = len(self.written)
        for i, (path, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return self.any_blocks


def _build_config(reader: Any, arch: str) -> dict[str, Any]:
    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    _check_sizes(arch, meta, shapes)
    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    # Without metadata, the embedding's row count (GGUF lists it last) is what the weights need;
    # the token list can be shorter when the embedding was padded.
    vocab_size = meta("vocab_size") or shapes["token_embd.weight"][-1]
    architecture, model_type = _HF_CLASSES[arch]
    if arch == "llama" and meta("expert_count"):
        architecture, model_type = gguf_moe.MIXTRAL
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }
    if arch != "qwen2":  # Qwen2 always has q/k/v biases; the others make them optional.
        config["attention_bias"] = any(f"blk.0.{b}.bias" in shapes
                                       for b in ("attn_q", "attn_qkv"))
    if model_type == "qwen2_moe":  # transformers' name for the same switch
        config["qkv_bias"] = config["attention_bias"]
    if model_type in gguf_moe.MOE_TYPES:
        config.update(gguf_moe.moe_config(model_type, meta, shapes, config["num_hidden_layers"]))
    if arch == "mistral":
        config["sliding_window"] = meta("attention.sliding_window")
    config.update(gguf_families.family_config(
        arch, meta, config, {t.name: t for t in reader.tensors}))
    if "rope_freqs.weight" in shapes:
        # Llama 3.1-style per-frequency factors: HF wants the formula's parameters, which the
        # tensor does not state, and silently dropping them would give a subtly wrong model.
        raise ValueError(f"{arch} GGUF with a rope_freqs tensor (llama3 rope scaling): unsupported")
    rope_type = meta("rope.scaling.type")
    if rope_type not in (None, "none") and "rope_scaling" not in config:
        factor = float(meta("rope.scaling.factor", 1.0))
        scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
        original = meta("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = scaling
    check_fields(config)
    return config


# GGUF size keys -> the config.json field each becomes (whose bound applies); optional ones
# have defaults.
_SIZE_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
              "feed_forward_length": "intermediate_size",
              "attention.head_count": "num_attention_heads"}
_OPTIONAL_SIZE_KEYS = {"attention.head_count_kv": "num_key_value_heads",
                       "attention.key_length": "head_dim",
                       "context_length": "max_position_embeddings"}


def _check_sizes(arch: str, meta: Any, shapes: dict[str, list[int]]) -> None:
    """Refuse missing or absurd sizes, naming the GGUF key, before any is used: a head count
    of 0 must not be a ZeroDivisionError, nor a block_count of 10^9 a billion layers built
    later. block_count must be the number of layers the file's tensors hold."""
    layers = {int(m["layer"]) for name in shapes
              if (m := _TENSOR_NAME.fullmatch(name)) and m["layer"] is not None}
    found = max(layers) + 1 if layers else 0
    blocks = meta("block_count")
    if isinstance(blocks, int) and blocks != found:
        raise ValueError(f"{arch}.block_count is {blocks}, but the file's tensors hold {found} "
                         f"layers" + (f" (blk.0 to blk.{found - 1})" if found else ""))
    for key, field in [*_SIZE_KEYS.items(), *_OPTIONAL_SIZE_KEYS.items()]:
        value = meta(key)
        if value is None and key in _OPTIONAL_SIZE_KEYS:
            continue
        if value is None:
            raise ValueError(f"the GGUF file lacks {arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, int) or not (
                1 <= value <= SIZE_LIMITS[field]):
            raise ValueError(f"{arch}.{key} must be an integer in [1, {SIZE_LIMITS[field]}], "
                             f"got {value!r}")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    if meta("attention.key_length") is None and hidden % heads:
        raise ValueError(f"{arch}.embedding_length ({hidden}) does not split into "
                         f"{arch}.attention.head_count ({heads}) heads, and there is no "
                         f"{arch}.attention.key_length")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


def _parse_name(gguf_name: str, layer_table: dict[str, str]) -> tuple[str | None, str, str]:
    """The layer (None for a global tensor), GGUF base name (e.g. "attn_q") and kind ("weight"
    or "bias") of a tensor, which must be one this model's tables know."""
    match = _TENSOR_NAME.fullmatch(gguf_name)
    layer, base = (match["layer"], match["base"]) if match else (None, "")
    table = _GLOBAL_TENSORS if layer is None else layer_table
    if base not in table:
        # Dropping an unknown tensor could silently change the model, so refuse instead.
        raise ValueError(f"Unexpected GGUF tensor {gguf_name!r}")
    return layer, base, match["kind"]


def _hf_tensors(layer: str | None, base: str, kind: str, data: np.ndarray,
                layer_table: dict[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """The HF checkpoint tensors of one GGUF tensor: itself under its HF name, or for stacked
    experts [E, ...] one slice per expert (copies: safetensors refuses tensors that share
    memory)."""
    if layer is None:
        yield f"{_GLOBAL_TENSORS[base]}.{kind}", data
        return
    module = f"model.layers.{layer}.{layer_table[base]}"
    if "{expert}" not in module:
        yield f"{module}.{kind}", data
        return
    for expert in range(data.shape[0]):
        yield f"{module.format(expert=expert)}.{kind}", data[expert].copy()


def _expected_shape(arch: str, base: str, is_bias: bool,
                    config: dict[str, Any]) -> tuple[int, ...]:
    hidden, head_dim, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    shapes = {
        "token_embd": (config["vocab_size"], hidden),
        "output": (config["vocab_size"], hidden),
        "output_norm": (hidden,),
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
        "attn_q": (q_rows, hidden),
        "attn_k": (kv_rows, hidden),
        "attn_v": (kv_rows, hidden),
        "attn_output": (hidden, q_rows),
        "attn_q_norm": (head_dim,),
        "attn_k_norm": (head_dim,),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
        **gguf_moe.expected_shapes(config),
        **gguf_families.expected_shapes(arch, config),
    }
    return shapes[base][:1] if is_bias else shapes[base]


def layer_module(arch: str, base: str) -> str | None:
    """The HF module under model.layers.N that a layer tensor named `base` ("attn_q", ...)
    of a dense `arch` file loads into; None for names the tables do not know."""
    return (_LAYER_TENSORS | gguf_families.layer_tensors(arch)).get(base)


def rows_to_hf(arch: str, base: str, rows: np.ndarray, heads: int, kv_heads: int
               ) -> np.ndarray:
    """A layer tensor's output rows (a weight's, a bias's, a LoRA's B) in HF's order: q/k of
    the architectures llama.cpp stores in its rotary layout are reordered, the rest kept."""
    if arch in _PERMUTED_ARCHITECTURES and base in ("attn_q", "attn_k"):
        return _unpermute_rotary_rows(rows, heads if base == "attn_q" else kv_heads)
    return rows


def _unpermute_rotary_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k projection rows (or biases) from llama.cpp's rotary layout to HF's.

    llama.cpp rotates adjacent pairs (x[2i], x[2i+1]) of each head, so its converter stores head
    row 2i+s at that position for the HF row s*head_dim/2 + i, since HF rotates (x[i], x[i+d/2]).
    Viewing each head as [d/2, 2] and transposing to [2, d/2] restores HF's order.
    """
    head_dim = rows.shape[0] // n_heads
    tail = rows.shape[1:]
    grouped = rows.reshape(n_heads, head_dim // 2, 2, *tail)
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def _save_tokenizer(path: pathlib.Path, out_dir: pathlib.Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))
