"""The in-run `transformers` peer of the GPU benchmarks: a Hugging Face model of one of our
architecture presets with random weights (our engines run the same shapes with
`load_format="dummy"`), eager, in bf16."""

from __future__ import annotations

import torch

from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def hf_dummy_model(preset_name: str, device: str = "cuda",
                   dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """transformers' model of a preset (Llama or Qwen2 shapes), randomly initialised on
    `device`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = dict(ARCHITECTURE_PRESETS[preset_name])
    architecture = preset.pop("architectures")[0]
    if architecture not in MODEL_TYPES:
        raise ValueError(f"no transformers peer for {preset_name!r} ({architecture})")
    config = AutoConfig.for_model(MODEL_TYPES[architecture], **preset)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
