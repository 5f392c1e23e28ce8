"""Linear layers with their own weight loaders.

Each layer knows how a checkpoint tensor lands in its parameters (`weight_loader`), so tensor
parallelism (shard the rows or columns) and quantized linears (other parameters, another
`forward`) can replace a layer without the model code changing.

Tensor parallelism (a `LinearShard`): a column-parallel layer holds a slice of each part's
output rows, a row-parallel layer a slice of the input columns, and sums the ranks' partial
products with an all-reduce. Sizes given to the constructors are always this rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.groups import all_reduce
from radixlm.runtime.models.quantization import QuantConfig, create_linear_method
from radixlm.runtime.models.weights.loading import copy_weight, narrow, tensor_shape


@dataclass(frozen=True)
class LinearShard:
    """Where this rank's share of a layer sits in the full (checkpoint) layer."""

    # Column-parallel: the first checkpoint row of each part held here.
    part_starts: tuple[int, ...] | None = None
    # Row-parallel: the first checkpoint input column held here; outputs are all-reduced.
    in_start: int | None = None


# The most rows a small-batch GEMV takes (radixlm.kernels.gemv.MAX_ROWS); more go to
# F.linear.
GEMV_MAX_ROWS = 16

# Quantized formats whose parameters shard like a float weight ([out, in], and per-output
# scales): the others pack or group along the input and are refused with tp_size > 1.
_SHARDABLE_QUANT_PARAMS = {"weight", "weight_scale"}


class Linear(nn.Module):
    """y = x @ W.T + b, with W stored [out_features, in_features] as in Hugging Face files.

    With a QuantConfig the weight belongs to a linear method (radixlm.runtime.models.quantization):
    it makes the parameters (e.g. qweight/qzeros/scales instead of weight), places checkpoint
    tensors, converts them after loading and computes the product. The bias stays here.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, quant: QuantConfig | None = None, *,
                 output_sizes: Sequence[int] | None = None,
                 shard_names: Sequence[int | str | None] | None = None,
                 shard: LinearShard | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.in_features = in_features
        self.out_features = out_features
        # Parts of a merged layer: output channels [offsets[i], offsets[i + 1]) are part i.
        self.output_sizes = list(output_sizes or [out_features])
        self.shard_names = list(shard_names or [None])
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        self.offsets = offsets
        self.quant_method = None
        if quant is None:
            # torch.empty: weights always come from a loader (checkpoint or dummy init).
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                       requires_grad=False)
        else:
            self.quant_method = create_linear_method(quant, in_features, self.output_sizes,
                                                     dtype or torch.get_default_dtype())
            self.quant_method.create_weights(self)
            if shard is not None and set(self.quant_method.specs) - _SHARDABLE_QUANT_PARAMS:
                raise ValueError(
                    f"{type(self.quant_method).__name__}: this quantization format packs or "
                    "groups weights along the input dimension and is not supported with "
                    "tp_size > 1 yet; use fp8 or int8, or tp_size=1")
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        # A GEMV kernel (x, weight) -> x @ weight^T for a few rows, where it beats the
        # library's (set by use_small_batch_gemv on CUDA); None: F.linear always.
        self.small_batch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Deterministic inference (use_batch_invariant_linears): every product, float or
        # quantized, through a kernel whose reduction over K does not depend on the row count.
        self.batch_invariant = False
        # LoRA adapters served over this layer (radixlm.runtime.models.lora.slots.LoRALinear):
        # each row's adapter update is added to the product, before a row-parallel layer's
        # all-reduce (the update of this rank's input columns is a partial sum like the rest).
        self.lora: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduce = self.shard is not None and self.shard.in_start is not None
        if (self.quant_method is None and not reduce and self.small_batch is None
                and not self.batch_invariant and self.lora is None):
            return F.linear(x, self.weight, self.bias)
        out = (self._float_product(x) if self.quant_method is None
               else self.quant_method.apply(self, x))
        if self.lora is not None:
            out = self.lora.add(x, out)
        if reduce:  # partial sums over this rank's input columns; the bias is added once
            out = all_reduce(out)
        return out if self.bias is None else out + self.bias

    def _float_product(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            from radixlm.kernels.invariant_matmul import invariant_matmul

            return invariant_matmul(x, self.weight)
        if (self.small_batch is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS
                and x.stride(-1) == 1):
            return self.small_batch(x, self.weight)
        return F.linear(x, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: int | str | None = None) -> None:
        part = self._part_index(shard_id)
        loaded = self._my_share(param, loaded, part)
        if self.quant_method is not None and param is not self.bias:
            name = next(n for n, p in self._parameters.items() if p is param)
            self.quant_method.load(self, name, param, loaded, part)
            return
        rows = slice(self.offsets[part], self.offsets[part + 1])
        copy_weight(param.data[rows], loaded)

    def _my_share(self, param: nn.Parameter, loaded: Any, part: int) -> Any:
        """The rows (column-parallel) or columns (row-parallel) of a checkpoint tensor this
        rank holds; 1-D tensors (biases, per-output scales) follow the output rows."""
        shard = self.shard
        if shard is None:
            return loaded
        if shard.part_starts is not None:
            return narrow(loaded, 0, shard.part_starts[part], self.output_sizes[part])
        if shard.in_start is not None and len(tensor_shape(loaded)) == 2:
            return narrow(loaded, 1, shard.in_start, self.in_features)
        return loaded

    def required_in_checkpoint(self, param_name: str) -> bool:
        """Whether a complete checkpoint must hold this parameter (for each part)."""
        if self.quant_method is None or param_name == "bias":
            return True
        return self.quant_method.specs[param_name].required

    def ignores_checkpoint_tensor(self, param_name: str) -> bool:
        """Checkpoint tensors of this layer that are read past on purpose."""
        return (self.quant_method is not None
                and param_name in self.quant_method.ignored_checkpoint_names)

    def _part_index(self, shard_id: int | str | None) -> int:
        if shard_id not in self.shard_names:
            if self.shard_names == [None]:
                raise ValueError(f"{type(self).__name__} has no shards, got shard {shard_id!r}")
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {self.shard_names}")
        return self.shard_names.index(shard_id)


class MergedLinear(Linear):
    """Several linears over the same input fused into one matmul (e.g. gate and up).

    The output rows are the concatenation of the parts; checkpoint tensors arrive per part and
    are written at that part's row offset.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False,
                 dtype: torch.dtype | None = None, shard_names: Sequence[str] | None = None,
                 quant: QuantConfig | None = None, shard: LinearShard | None = None):
        super().__init__(in_features, sum(output_sizes), bias, dtype, quant,
                         output_sizes=output_sizes,
                         shard_names=list(shard_names or range(len(output_sizes))),
                         shard=shard)


class QKVLinear(MergedLinear):
    """The q, k and v projections fused: rows are [q heads | k heads | v heads]. With tensor
    parallelism the head counts are this rank's, and `shard` says which heads they are."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype | None = None,
                 quant: QuantConfig | None = None, shard: LinearShard | None = None) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, dtype, shard_names=["q", "k", "v"],
                         quant=quant, shard=shard)


def use_small_batch_gemv(model: nn.Module, enabled: bool) -> None:
    """Send the few-row products (decode steps) of the float layers our GEMV runs faster than
    cuBLAS (radixlm.kernels.gemv: bf16/fp16 weights, at most NARROW_MAX_N outputs) to it, or
    (enabled False) every product back to F.linear. CUDA graphs captured before a switch keep
    the path they were captured with."""
    kernel = None
    if enabled:
        from radixlm.kernels import gemv as kernel
    for module in model.modules():
        if isinstance(module, Linear):
            eligible = (kernel is not None and module.quant_method is None
                        and module.weight.dtype in (torch.bfloat16, torch.float16)
                        and module.weight.shape[0] <= kernel.NARROW_MAX_N)
            module.small_batch = kernel.gemv if eligible else None


def use_batch_invariant_linears(model: nn.Module, enabled: bool) -> None:
    """Deterministic inference on CUDA: every Linear's product (and a quantized method's)
    through a batch-invariant kernel (radixlm.kernels.invariant_matmul; fixed tiles for INT
    weights), and no small-batch GEMV, whose split of K follows the row count. Off: the
    library and the GEMVs again (use_small_batch_gemv to turn those back on)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.batch_invariant = enabled
            if enabled:
                module.small_batch = None
