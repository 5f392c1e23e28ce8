"""A LoRA adapter in llama.cpp's GGUF format, read as the PEFT tensors it was converted from.

llama.cpp's adapter files (`general.type` "adapter", `adapter.type` "lora") hold, per module,
`blk.N.<tensor>.weight.lora_a` ([r, in] in numpy order) and `...lora_b` ([out, r]), named as the
base model's GGUF tensors, and one `adapter.lora.alpha`: the product is scaled by alpha / r, or
by 1 when alpha is 0 (llama.cpp's rule). As in the model files, B's rows of q and k of the
Llama-layout architectures are in llama.cpp's rotary order and are put back in HF's, so the
adapter runs on the same model whether that was loaded from GGUF or from a HF folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.runtime.models.gguf_loader import layer_module, rows_to_hf

_TENSOR = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<base>\w+)\.weight\.lora_(?P<which>[ab])$")


def read_gguf_adapter(name: str, path: Path, heads: int, kv_heads: int
                      ) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """({HF module: {"A": [r, in], "B": [out, r]}}, alpha) of the GGUF adapter at `path`, for
    a model of `heads` / `kv_heads` attention heads; ValueError naming what is wrong."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"lora {name!r}: {path.name} is not a readable GGUF file: {exc}") \
            from None

    def field(key: str) -> Any:
        value = reader.fields.get(key)
        return None if value is None else value.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ValueError(f"lora {name!r}: {path.name} is not a GGUF LoRA adapter "
                         f"(general.type {field('general.type')!r}, adapter.type "
                         f"{field('adapter.type')!r})")
    arch = field("general.architecture") or ""
    alpha = float(field("adapter.lora.alpha") or 0.0)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = _TENSOR.match(tensor.name)
        module = None if match is None else layer_module(arch, match["base"])
        if module is None:
            raise ValueError(f"lora {name!r}: tensor {tensor.name!r} is not a LoRA A or B of "
                             f"a decoder layer of a {arch!r} model")
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if match["which"] == "b":
            data = rows_to_hf(arch, match["base"], data, heads, kv_heads)
        key = f"model.layers.{match['layer']}.{module}"
        pairs.setdefault(key, {})[match["which"].upper()] = torch.from_numpy(
            np.ascontiguousarray(data))
    return pairs, alpha
