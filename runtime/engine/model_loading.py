"""Loading an Engine's models as its EngineCore takes them: the target model (under tensor
parallelism, this rank's shard behind the stand-in that drives the other ranks) and, when
speculating with one, the draft model. Runs on the engine thread (see engine_thread).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.models.loader import ARCHITECTURE_PRESETS, LoadedModel, load_model
from radixlm.runtime.parallel.sharded import ShardedModel, TensorParallelGroup

if TYPE_CHECKING:
    from radixlm.runtime.models.architecture.model_config import ModelConfig


class EngineModels(NamedTuple):
    target: LoadedModel  # as the core runs it (with TP: this rank's KV heads, the stand-in)
    draft: LoadedModel | None
    model_config: ModelConfig  # the target's own (with TP: every rank's KV heads)


def load_engine_models(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                       tp: TensorParallelGroup | None) -> EngineModels:
    loaded = load_model(config.model, config.load_format, dtype, device,
                        max_positions=config.max_model_len, seed=config.seed,
                        quantization=config.quantization, tp=None if tp is None else tp.shard,
                        revision=config.revision, tokenizer=config.tokenizer,
                        chat_template=config.chat_template,
                        layer_range=None if tp is None else tp.layer_ranges[0])
    model_config = loaded.config
    # A draft model is not sharded: it runs on rank 0 only, on the host's side of the
    # broadcasts (its steps involve no other rank).
    draft = (load_draft(config, loaded, device, dtype) if config.speculative == "draft"
             else None)
    if tp is not None:
        # The core sizes and holds this rank's KV heads, and runs the model through the
        # stand-in that sends each call to the other ranks first.
        kv_heads = (loaded.config.num_kv_heads if tp.shard is None
                    else tp.shard.kv_heads(loaded.config.num_kv_heads)[1])
        loaded = dataclasses.replace(
            loaded, model=ShardedModel(loaded.model, tp),
            config=dataclasses.replace(loaded.config, num_kv_heads=kv_heads))
    return EngineModels(loaded, draft, model_config)


def load_draft(config: EngineConfig, target: LoadedModel, device: torch.device,
               dtype: torch.dtype) -> LoadedModel:
    """config.draft_model, which must share the target's tokenizer."""
    name = config.draft_model
    preset = config.load_format == "dummy" and name in ARCHITECTURE_PRESETS
    draft = load_model(name, "dummy" if preset else "auto", dtype, device,
                       max_positions=target.config.max_position_embeddings,
                       seed=config.seed + 1)
    if (draft.tokenizer is not None and target.tokenizer is not None
            and draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()):
        raise ValueError(f"draft_model {name!r} does not share the target's tokenizer")
    return draft
