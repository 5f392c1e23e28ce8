"""Absurd or inconsistent model configs are refused, naming the field, before anything is
allocated: config fields are checked on their own, against the checkpoint's tensors, and (for
weight-less dummy loads) against a parameter-memory estimate and the memory available."""

from __future__ import annotations

import json

import pytest
import torch

from radixlm.runtime.models import loader
from radixlm.runtime.models.architecture.model_config import ModelConfig
from radixlm.runtime.models.loader import load_model

from conftest import save_tiny_hf_model, tiny_config

CPU = torch.device("cpu")


@pytest.mark.parametrize("changes,field", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_attention_heads": -4}, "num_attention_heads"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"num_hidden_layers": 1e9}, "num_hidden_layers"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"intermediate_size": -1}, "intermediate_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 4 query heads: not a multiple
    ({"num_attention_heads": 5}, "hidden_size"),  # 64 channels do not split into 5 heads
    ({"head_dim": 0}, "head_dim"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
])
def test_bad_config_fields_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(tiny_config("llama") | changes)


def test_the_tiny_config_itself_is_accepted():
    cfg = ModelConfig.from_dict(tiny_config("llama"))
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim) == (2, 4, 16)


def test_more_layers_than_the_checkpoint_holds_is_refused_before_building(tmp_path,
                                                                          monkeypatch):
    folder = save_tiny_hf_model(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 1000}))
    built = []
    monkeypatch.setattr(loader, "model_class", lambda arch: built.append(arch))
    with pytest.raises(ValueError, match=r"num_hidden_layers.*1000.*2 layers"):
        load_model(str(folder), "auto", torch.float32, CPU)
    assert built == []  # refused before a layer was allocated


def test_sizes_the_checkpoint_contradicts_are_refused(tmp_path):
    folder = save_tiny_hf_model(tmp_path, "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"vocab_size": 4_000_000}))
    with pytest.raises(ValueError, match=r"vocab_size.*4000000.*512"):
        load_model(str(folder), "auto", torch.float32, CPU)


def test_a_dummy_model_bigger_than_memory_is_refused_clearly(tmp_path):
    # Within every per-field bound, but ~2 * 10^13 parameters: no machine holds that.
    cfg = tiny_config("llama") | {"hidden_size": 65536, "intermediate_size": 262144,
                                  "num_attention_heads": 512, "num_key_value_heads": 64,
                                  "num_hidden_layers": 1000, "vocab_size": 262144}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"needs about .* GiB.*available"):
        load_model(str(tmp_path), "dummy", torch.bfloat16, CPU)


def test_a_dummy_model_is_refused_when_memory_is_short(tmp_path, monkeypatch):
    folder = save_tiny_hf_model(tmp_path, "llama")
    monkeypatch.setattr(loader, "available_memory", lambda device: 1 << 16)
    with pytest.raises(ValueError, match=r"needs about .* for its weights.*available"):
        load_model(str(folder), "dummy", torch.float32, CPU)
    monkeypatch.setattr(loader, "available_memory", lambda device: 1 << 40)
    assert load_model(str(folder), "dummy", torch.float32, CPU).config.num_layers == 2


@pytest.mark.parametrize("name", sorted(loader.ARCHITECTURE_PRESETS))
def test_the_parameter_estimate_is_a_close_lower_bound(name):
    from radixlm.runtime.models.architecture.model_size import parameter_count

    config = ModelConfig.from_dict(loader.ARCHITECTURE_PRESETS[name])
    with torch.device("meta"):  # shapes only, no memory
        model = loader.model_class(config.architecture)(config, torch.bfloat16, max_positions=16)
    params = sum(p.numel() for p in model.parameters())
    assert 0.99 * params <= parameter_count(config) <= params
