"""Block-wise FP8 checkpoints (Qwen's and DeepSeek's `-FP8` releases), loaded as float weights.

    quantization_config  {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [bn, bk]}
    <linear>.weight            [N, K]                         float8_e4m3fn
    <linear>.weight_scale_inv  [ceil(N / bn), ceil(K / bk)]   float32
    W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]

Despite its name, `weight_scale_inv` multiplies: it is the inverse of the factor the writer
multiplied each block by (448 / max|block|). When N or K is not a multiple of the block, the
last blocks of a row or column are narrower and still own one scale each.

We have no block-scaled FP8 product, so the faithful way to run these checkpoints is to
dequantize each such weight once at load, in float32, then cast it to the model's dtype: the
model runs as a float model (2 bytes a weight in bfloat16, where the checkpoint holds ~1),
with float activations (the writer's kernels would round them to e4m3 per 1 x bk group of each
token; ours are not rounded). `quantization="fp8"` or `"int8"` requantize those float weights
per output channel on load, as for any float checkpoint (config.resolve_quant_config decides).

Tensors the checkpoint keeps in float (`modules_to_not_convert` / `ignored_layers`, norms,
embeddings, routers) pass through as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from radixlm.runtime.models.weights.loading import materialize

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # <linear>.weight -> <linear>.weight_scale_inv


@dataclass(frozen=True)
class BlockFp8:
    block: tuple[int, int]  # (output rows, input columns) that share one scale


def block_fp8_format(qc: Any) -> BlockFp8 | None:
    """The block layout a config.json `quantization_config` declares: None unless it is
    `quant_method` fp8 with a `weight_block_size`. What we would read wrongly (another block
    shape, another float8 format, static activation scales) is refused naming the field."""
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "fp8":
        return None
    block = qc.get("weight_block_size")
    if not block:  # absent, null or []: per-tensor / per-channel fp8 (fp8.py)
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size = {block!r}: expected two "
                         "positive ints [output rows, input columns] per scale")
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt = {fmt!r}: block-wise FP8 weights are read "
                         "as e4m3 (float8_e4m3fn)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme = {scheme!r}: block-wise FP8 "
                         "checkpoints are read with dynamic activation scales only")
    return BlockFp8((block[0], block[1]))


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype, name: str) -> torch.Tensor:
    """weight [N, K] e4m3 and its scale_inv [ceil(N / bn), ceil(K / bk)] -> W [N, K] in
    `dtype`: every weight times its block's scale in float32, cast once. `name`: the weight's
    checkpoint name, for the errors."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} ({weight.dtype}, shape "
                         f"{tuple(weight.shape)}) has a {name + SCALE_SUFFIX!r}: a block-wise "
                         "FP8 weight is a 2-D float8_e4m3fn tensor")
    (n, k), (bn, bk) = weight.shape, block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want or not scale_inv.dtype.is_floating_point:
        raise ValueError(f"checkpoint tensor {name + SCALE_SUFFIX!r} ({scale_inv.dtype}, shape "
                         f"{tuple(scale_inv.shape)}): a weight of shape {(n, k)} in blocks of "
                         f"{bn} x {bk} needs float scales of shape {want}")
    # [ceil(N/bn), ceil(K/bk)] -> [N, K]: each scale repeated over its block's rows and columns,
    # the repeats of the last (narrower) blocks cut at N and K.
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float().mul_(scale).to(dtype)


def dequantized_tensors(tensors: Iterator[tuple[str, Any]], fmt: BlockFp8, dtype: torch.dtype,
                        device: torch.device) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each e4m3 `<x>.weight` and its
    `<x>.weight_scale_inv` replaced by one `<x>.weight` in `dtype` (computed on `device`);
    every other tensor as it came. Whichever of a pair comes first waits for the other, so
    the files may hold them in any order; one left without its partner is an error."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> its half of the pair
    for name, tensor in tensors:
        if name.endswith(".weight" + SCALE_SUFFIX):
            weight_name, role = name.removesuffix(SCALE_SUFFIX), "scale"
        elif name.endswith(".weight") and _is_fp8(tensor):
            weight_name, role = name, "weight"
        else:
            yield name, tensor
            continue
        pair = waiting.setdefault(weight_name, {})
        pair[role] = materialize(tensor).to(device)
        if len(pair) == 2:
            del waiting[weight_name]
            yield weight_name, dequantize_block_fp8(pair["weight"], pair["scale"], fmt.block,
                                                    dtype, weight_name)
    for weight_name, pair in waiting.items():
        if "weight" in pair:
            raise ValueError(f"checkpoint tensor {weight_name!r} is float8 without a "
                             f"{weight_name + SCALE_SUFFIX!r}: a block-wise FP8 checkpoint "
                             "stores one beside every quantized weight")
        raise ValueError(f"checkpoint tensor {weight_name + SCALE_SUFFIX!r} has no float8 "
                         f"weight {weight_name!r} to scale")


def _is_fp8(tensor: Any) -> bool:
    """A tensor, or a lazy safetensors slice (whose dtype is a name such as "F8_E4M3")."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == FP8
    return str(tensor.get_dtype()).upper() == "F8_E4M3"
