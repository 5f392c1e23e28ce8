"""Quantized linears (FP8, INT8, AWQ and GPTQ INT4, GGUF blocks), and round-to-nearest for the
formats quantized on load (rtn.py). On the CPU every format runs through one form
(cpu_weights.py).

`QuantConfig` says how a model's decoder linears are stored; `resolve_quant_config` reads it
from a checkpoint's config.json or the user's `quantization` option. Each scheme is a linear
method (linear_method.py) that a `Linear` delegates to; this file is the registry
(`create_linear_method`). Our quantizers and `radixlm quantize`, which write checkpoints in the
AWQ and GPTQ formats that this package and other readers load, are in `radixlm.runtime.quantize`.
"""

from __future__ import annotations

import torch

from radixlm.runtime.models.quantization.awq import AWQLinearMethod
from radixlm.runtime.models.quantization.fp8 import Fp8LinearMethod
from radixlm.runtime.models.quantization.gguf import GGUFLinearMethod
from radixlm.runtime.models.quantization.gptq import GPTQLinearMethod
from radixlm.runtime.models.quantization.int8 import Int8LinearMethod
from radixlm.runtime.models.quantization.linear_method import LinearMethod
from radixlm.runtime.models.quantization.quant_config import (
    QUANTIZATION_METHODS,
    QuantConfig,
    resolve_quant_config,
)

LINEAR_METHODS: dict[str, type[LinearMethod]] = {
    "fp8": Fp8LinearMethod, "int8": Int8LinearMethod, "awq": AWQLinearMethod,
    "gptq": GPTQLinearMethod, "gguf": GGUFLinearMethod}


def create_linear_method(quant: QuantConfig, in_features: int, output_sizes: list[int],
                         params_dtype: torch.dtype) -> LinearMethod:
    """A fresh linear method (one per layer) that makes and runs this layer's weights."""
    return LINEAR_METHODS[quant.method](quant, in_features, output_sizes, params_dtype)


__all__ = ["LINEAR_METHODS", "QUANTIZATION_METHODS", "QuantConfig", "create_linear_method",
           "resolve_quant_config"]
