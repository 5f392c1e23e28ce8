"""The linear-method interface: how one quantization scheme stores and runs a linear layer.

A `Linear` built with a QuantConfig holds one LinearMethod and delegates to it: the method
registers the layer's checkpoint parameters (`create_weights`), places each checkpoint tensor
(`load`), converts them once loading is done (`process_weights_after_loading`: quantize float
weights, repack a format into our runtime layout) and computes the layer (`apply`). The layer
keeps its bias and its shard bookkeeping; the method never sees checkpoint names.

Merged layers (qkv, gate_up) receive one tensor per part (q, k, v) and write it at the part's
output offset. Where that offset lies depends on the tensor: `ParamSpec.out_axis` names the
axis of output channels and `out_pack` how many channels share an element along it (AWQ packs
8 output channels into an int32; GPTQ packs along the input, so its qweight has out_pack 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from radixlm.runtime.models.quantization.quant_config import QuantConfig
from radixlm.runtime.models.weights.loading import copy_weight

# (shape, device) -> random float32 weights, for load_format="dummy".
RandomWeights = Callable[[tuple[int, ...], torch.device], torch.Tensor]


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_axis: int | None  # None: one tensor shared by every part (e.g. GPTQ's g_idx)
    out_pack: int = 1
    required: bool = True  # False: a checkpoint may leave it out


class LinearMethod(ABC):
    """One per layer. `in_features` inputs; `output_sizes` the parts' output channels."""

    # Checkpoint tensor names this method reads past (e.g. FP8 static `input_scale`: we always
    # scale activations per token, dynamically).
    ignored_checkpoint_names: tuple[str, ...] = ()

    def __init__(self, config: QuantConfig, in_features: int, output_sizes: list[int],
                 params_dtype: torch.dtype) -> None:
        self.config = config
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.params_dtype = params_dtype
        self.group = config.group_for(in_features)  # INT methods: input channels per group
        self.offsets = [0]
        for size in output_sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.specs = self.checkpoint_params()
        self._shared_loaded: dict[str, bool] = {}

    @abstractmethod
    def checkpoint_params(self) -> dict[str, ParamSpec]:
        """The parameters a checkpoint (or the dummy initialiser) fills, by name."""

    @abstractmethod
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into the ones `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype, without the bias."""

    @abstractmethod
    def init_dummy(self, layer: nn.Module, random: RandomWeights) -> None:
        """Fill the checkpoint parameters as if loaded from a checkpoint of random weights."""

    def create_weights(self, layer: nn.Module) -> None:
        for name, spec in self.specs.items():
            # torch.empty: weights always come from a loader (checkpoint or dummy init).
            layer.register_parameter(name, nn.Parameter(
                torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False))

    def load(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor,
             part: int) -> None:
        """Write one checkpoint tensor (the whole layer's, or part `part`'s) into `param`."""
        spec = self.specs[name]
        if spec.out_axis is None:
            if self._shared_loaded.get(name) and not torch.equal(
                    param.data, loaded.to(param.device, param.dtype)):
                raise ValueError(f"the parts of a merged layer disagree on {name!r}; they must "
                                 "share it (e.g. q/k/v quantized with one act-order)")
            copy_weight(param.data, loaded)
            self._shared_loaded[name] = True
            return
        copy_weight(self.part_view(param.data, spec, part), loaded)

    def part_view(self, tensor: torch.Tensor, spec: ParamSpec, part: int) -> torch.Tensor:
        """The slice of `tensor` that holds part `part`'s output channels."""
        start, end = self.offsets[part], self.offsets[part + 1]
        if start % spec.out_pack or end % spec.out_pack:
            raise ValueError(f"output channels {start}:{end} do not fall on the {spec.out_pack}"
                             f"-channel words of this format")
        return tensor.narrow(spec.out_axis, start // spec.out_pack,
                             (end - start) // spec.out_pack)

    def loaded_shared(self, name: str) -> bool:
        return self._shared_loaded.get(name, False)


def replace_parameter(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swap (or, with None, drop) one of the layer's parameters after loading."""
    if name in layer._parameters:
        del layer._parameters[name]
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
