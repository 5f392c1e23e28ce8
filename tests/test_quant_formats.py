"""Quantized checkpoint formats: bit layouts round-trip and match the published word orders;
quantization_config detection, and clear errors for what we cannot run."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.models.quantization import QUANTIZATION_METHODS, packing, resolve_quant_config

GEN = torch.Generator().manual_seed(0)


def rand_ints(shape, bits):
    return torch.randint(0, 2 ** bits, shape, generator=GEN, dtype=torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_unpack_round_trip(bits, dim):
    values = rand_ints((64, 48), bits)
    words = packing.pack(values, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == values.shape[dim] * bits // 32
    assert torch.equal(packing.unpack(words, bits, dim), values)


def test_pack_puts_the_first_value_in_the_low_bits_and_fills_the_sign_bit():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    assert packing.pack(values, 4, dim=1).item() == 0xF7654321 - 2 ** 32


def test_awq_word_order():
    # AutoAWQ packs columns 0 2 4 6 1 3 5 7 into word slots 0..7: column 1 sits in slot 4.
    values = torch.zeros(1, 8, dtype=torch.int32)
    values[0, 1] = 5
    values[0, 6] = 9
    word = packing.pack_awq(values).item() & 0xFFFFFFFF
    assert word == (5 << 16) | (9 << 12)
    wide = rand_ints((16, 64), 4)
    assert torch.equal(packing.unpack_awq(packing.pack_awq(wide)), wide)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_layouts(bits):
    q = rand_ints((64, 32), bits)  # [K, N]
    words = packing.pack_gptq_weight(q, bits)
    assert words.shape == (64 * bits // 32, 32)
    assert torch.equal(packing.unpack_gptq_weight(words, bits), q)
    # Zero points: v1 stores zero - 1 (so 1..2**bits round-trip), v2 stores them as they are.
    zeros = 1 + rand_ints((3, 32), bits).clamp(max=2 ** bits - 2)
    stored = packing.pack_gptq_zeros(zeros, bits, v1=True)
    assert torch.equal(packing.unpack(stored, bits, dim=1), zeros - 1)
    assert torch.equal(packing.unpack_gptq_zeros(stored, bits, v1=True), zeros)
    zeros_v2 = rand_ints((3, 32), bits)
    round_trip = packing.unpack_gptq_zeros(packing.pack_gptq_zeros(zeros_v2, bits, False), bits,
                                           False)
    assert torch.equal(round_trip, zeros_v2)


def test_detection_from_config_json():
    awq = resolve_quant_config(None, {"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
        "version": "gemm"}})
    assert (awq.method, awq.bits, awq.group_size, awq.prequantized) == ("awq", 4, 64, True)
    gptq = resolve_quant_config("gptq", {"quantization_config": {
        "quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": True}})
    assert (gptq.bits, gptq.group_for(576), gptq.desc_act, gptq.zero_point) == (8, 576, True,
                                                                                 False)
    fp8 = resolve_quant_config(None, {"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}})
    assert fp8.method == "fp8" and fp8.prequantized
    assert resolve_quant_config(None, {}) is None
    online = resolve_quant_config("int8", {})
    assert online.method == "int8" and not online.prequantized
    dummy = resolve_quant_config("awq", {}, dummy=True)
    assert dummy.prequantized and dummy.bits == 4 and dummy.group_size == 128


@pytest.mark.parametrize("forced, config, field", [
    ("fp8", {"quant_method": "gptq", "bits": 4}, "quant_method"),
    (None, {"quant_method": "bitsandbytes"}, "quant_method"),
    (None, {"quant_method": "awq", "version": "gemv"}, "version"),
    (None, {"quant_method": "awq", "bits": 3}, "bits"),
    (None, {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
     "checkpoint_format"),
    (None, {"quant_method": "gptq", "bits": 4, "modules_to_not_convert": ["mlp.down_proj"]},
     "modules_to_not_convert"),
    (None, {"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ("gptq", {"quant_method": "fp8", "weight_block_size": [128, 128]},
     "conflicts.*weight_block_size"),
])
def test_unsupported_or_conflicting_configs_name_the_field(forced, config, field):
    with pytest.raises(ValueError, match=field):
        resolve_quant_config(forced, {"quantization_config": config})


def test_awq_on_a_float_checkpoint_says_how_to_quantize():
    with pytest.raises(ValueError, match="radixlm quantize --method awq"):
        resolve_quant_config("awq", {})


def test_engine_config_validates_quantization():
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")
    for method in QUANTIZATION_METHODS:  # the config's list and the package's agree
        EngineConfig(quantization=method)
