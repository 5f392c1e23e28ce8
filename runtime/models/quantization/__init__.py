"""Quantized linears (FP8, INT8, AWQ and GPTQ INT4, GGUF blocks) and our own quantizers (RTN,
AWQ, GPTQ). On the CPU every format runs through one form (cpu_weights.py).

`QuantConfig` says how a model's decoder linears are stored; `resolve_quant_config` reads it
from a checkpoint's config.json or the user's `quantization` option. Each scheme is a linear
method (base.py) that a `Linear` delegates to. `radixlm quantize` (quantize.py) writes
checkpoints in the AWQ and GPTQ formats that this package, and other readers, load.
"""

from radixlm.runtime.models.quantization.config import (
    QUANTIZATION_METHODS,
    QuantConfig,
    resolve_quant_config,
)

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "resolve_quant_config"]
