"""GGUF blocks run as they are (quantization "gguf"): block decoding against the gguf
package's reference, the int4-plane matmul against float, a tiny quantized GGUF model packed
and dequantized, the option rules, and the embedded model's default CPU path."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from radixlm.runtime.models import gguf_loader
from radixlm.runtime.models.quantization.cpu_weights import CpuWeights, dequantize_planes
from radixlm.runtime.models.quantization.gguf_blocks import (
    BLOCK_TYPES,
    NATIVE_TYPES,
    GGUFBlocks,
)
from radixlm.runtime.models.quantization.quant_config import resolve_quant_config

from test_models import run_chunks


def _random_blocks(name: str, rows: int, columns: int, seed: int = 0) -> GGUFBlocks:
    """Random codes, with float16 scales (and mins) of a realistic size in their slots."""
    rng = np.random.default_rng(seed)
    _, per_block, size = next(v for v in BLOCK_TYPES.values() if v[0] == name)
    raw = rng.integers(0, 256, (rows, columns // per_block, size), dtype=np.uint8)
    halves = 1 if name in ("Q4_0", "Q5_0", "Q8_0", "Q6_K") else 2  # d, or d and m / dmin
    at = size - 2 if name == "Q6_K" else 0  # Q6_K keeps its d last
    for i in range(halves):
        values = rng.normal(0, 0.01, raw.shape[:2]).astype(np.float16)
        raw[..., at + 2 * i: at + 2 * i + 2] = values[..., None].view(np.uint8)
    return GGUFBlocks.from_rows(name, torch.from_numpy(raw.reshape(rows, -1)))


@pytest.mark.parametrize("name", sorted(NATIVE_TYPES))
def test_planes_are_exactly_the_reference_dequantization(name):
    blocks = _random_blocks(name, 5, 512)
    planes = blocks.planes()
    assert len(planes) == (1 if name in ("Q4_0", "Q4_1", "Q4_K") else 2)
    assert all(int(p.codes.max()) <= 15 for p in planes)
    want = blocks.dequantize()  # equal up to float32 rounding of the folded zeros
    torch.testing.assert_close(dequantize_planes(planes), want, rtol=0,
                               atol=1e-6 * want.abs().max().item())


def test_dequantize_by_blocks_of_rows_to_a_dtype(monkeypatch):
    """A table decoded a block of rows at a time (smaller blocks here) and rounded to
    bfloat16 is the whole float32 decode, rounded."""
    import gguf

    from radixlm.runtime.models.quantization import gguf_blocks

    blocks = _random_blocks("Q6_K", 37, 256)
    whole = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(),
                                                    gguf.GGMLQuantizationType.Q6_K))
    monkeypatch.setattr(gguf_blocks, "_DEQUANTIZE_ROWS", 8)
    assert torch.equal(blocks.dequantize(), whole)
    assert torch.equal(blocks.dequantize(torch.bfloat16), whole.to(torch.bfloat16))


def test_int4_planes_matmul_matches_float_over_mixed_parts():
    # A merged layer whose parts have one and two planes: the one-plane part gets an empty
    # second plane that must add exactly nothing.
    # Q6_K's groups of 16 inputs beside the others' 32: theirs are split in two.
    parts = [_random_blocks("Q4_K", 64, 256, 1), _random_blocks("Q8_0", 32, 256, 2),
             _random_blocks("Q5_1", 48, 256, 3), _random_blocks("Q6_K", 16, 256, 4)]
    planes = CpuWeights.stack([p.planes() for p in parts], [64, 32, 48, 16], 256)
    weight = torch.cat([p.dequantize() for p in parts])  # [160, 256]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = planes(x).float()
    want = x.float() @ weight.t()
    # bfloat16 scales and output (a bfloat16 step is 2^-8 of a value): a few steps of the
    # output's scale.
    assert (got - want).abs().max() <= 8e-3 * want.abs().max()


def _tile_bytes(weights: CpuWeights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.kernel_form()[2])


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_scales_kept_as_the_file_factors_them(name):
    """K-quants' scales (and mins) are a 6- or 8-bit code per sub-block times the block's
    float16 d: tiled that way they take about the file's bytes, and give the same outputs,
    bit for bit, as the float32 scales and zeros they stand for."""
    blocks = _random_blocks(name, 48, 512, 7)
    factored = CpuWeights(blocks.planes())
    if not factored.tiled:
        pytest.skip("the CPU kernels do not build here")
    plain = CpuWeights([plane._replace(factors=None) for plane in blocks.planes()])
    tiles = factored.kernel_form()[2]
    assert tiles[2].dtype == torch.int8 and tiles[3].dtype == torch.float16
    assert (tiles[5].dtype == torch.int8) == (name != "Q6_K")  # Q6_K has no mins
    # Q4_K: 4.625 bits a weight against the file's 4.5, and a zero factor per channel
    assert _tile_bytes(factored) <= 1.05 * blocks.data.numel() < _tile_bytes(plain)
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(9, 512, generator=gen).to(dtype)
        got = factored(x, float_out=True)
        assert torch.equal(got, plain(x, float_out=True))
        assert torch.equal(factored(x[4:5], float_out=True), got[4:5])


def test_parts_of_different_types_run_each_in_its_own_form():
    """Q4_K_M's qkv: Q4_K q and k beside a Q6_K v. Each run of parts of one form is a
    segment of the outputs tiled in that form (not one 6-bit stack): about the file's bytes,
    and every output the one its part's own linear gives."""
    parts = [_random_blocks("Q4_K", 64, 256, 1), _random_blocks("Q4_K", 32, 256, 2),
             _random_blocks("Q6_K", 32, 256, 3)]
    stacked = CpuWeights.stack([p.planes() for p in parts], [64, 32, 32], 256)
    if not stacked.tiled:
        pytest.skip("the CPU kernels do not build here")
    assert stacked.plane_counts == [1, 2]
    assert _tile_bytes(stacked) <= 1.05 * sum(p.data.numel() for p in parts)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    q_k = CpuWeights.stack([p.planes() for p in parts[:2]], [64, 32], 256)
    v = CpuWeights(parts[2].planes())
    assert torch.equal(stacked(x, float_out=True),
                       torch.cat([q_k(x, float_out=True), v(x, float_out=True)], 1))
    weight = torch.cat([p.dequantize() for p in parts])
    want = x.double() @ weight.double().t()
    got = stacked(x, float_out=True).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_head_tiled_by_blocks_of_rows_is_the_whole_head(name, monkeypatch):
    """A vocabulary-sized head is decoded and tiled 32 rows at a time here (16384 in the
    loader): the same tensors as tiling it whole. Blocks in different forms stay segments."""
    blocks = _random_blocks(name, 100, 256, 5)
    whole = CpuWeights(blocks.planes())
    by_rows = CpuWeights.from_row_blocks(blocks.planes_by_rows(32))
    if not whole.tiled:
        pytest.skip("the CPU kernels do not build here")
    assert by_rows.segments == 1 and by_rows.out_features == 100
    for a, b in zip(whole.kernel_form()[2], by_rows.kernel_form()[2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    mixed = CpuWeights.from_row_blocks(iter([_random_blocks("Q4_K", 32, 256, 6).planes(),
                                             blocks.planes()]))
    # a Q4_K block first: joined with Q4_K's (one form), a segment of its own beside the others
    assert mixed.plane_counts == ([1] if name == "Q4_K" else [1, 2])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = torch.cat([_random_blocks("Q4_K", 32, 256, 6).dequantize(), blocks.dequantize()])
    got = mixed(x, float_out=True).double()
    assert (got - x.double() @ want.double().t()).abs().max() <= 1e-5 * got.abs().max()
    from radixlm.runtime.models.quantization import cpu_weights

    monkeypatch.setattr(cpu_weights, "linear_kernel", lambda: None)  # torch's int4 kernel
    fallback = CpuWeights.from_row_blocks(blocks.planes_by_rows(32))
    assert not fallback.tiled and fallback.out_features == 100
    ours, theirs = whole(x, float_out=True), fallback(x, float_out=True)
    assert (ours - theirs).abs().max() <= 1e-2 * ours.abs().max()


def test_torch_int4_fallback_matches_our_tiles(monkeypatch):
    """Without a C++ compiler the planes run through torch's int4 kernel (bfloat16 scales):
    the same products within bfloat16 rounding."""
    from radixlm.runtime.models.quantization import cpu_weights

    parts = [_random_blocks("Q4_1", 64, 256, 4), _random_blocks("Q8_0", 32, 256, 5)]
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    tiled = CpuWeights.stack([p.planes() for p in parts], [64, 32], 256)
    monkeypatch.setattr(cpu_weights, "linear_kernel", lambda: None)
    fallback = CpuWeights.stack([p.planes() for p in parts], [64, 32], 256)
    if not tiled.tiled:
        pytest.skip("the CPU kernels do not build here")
    assert not fallback.tiled and fallback.kernel_form() is None
    ours, torch_int4 = tiled(x).float(), fallback(x).float()
    assert (ours - torch_int4).abs().max() <= 1e-2 * ours.abs().max()


def test_option_rules():
    gguf_cfg = {"quantization_config": {"quant_method": "gguf"}}
    assert resolve_quant_config(None, gguf_cfg, gguf_packable=True).method == "gguf"
    assert resolve_quant_config(None, gguf_cfg, gguf_packable=False) is None
    assert resolve_quant_config("none", gguf_cfg, gguf_packable=True) is None
    assert resolve_quant_config("int8", gguf_cfg, gguf_packable=True).method == "int8"
    with pytest.raises(ValueError, match="device cpu, dtype bfloat16 and tp_size 1"):
        resolve_quant_config("gguf", gguf_cfg, gguf_packable=False)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        resolve_quant_config("gguf", {})
    with pytest.raises(ValueError, match="conflicts"):
        resolve_quant_config("awq", gguf_cfg, gguf_packable=True)
    with pytest.raises(ValueError, match="not dequantized"):
        resolve_quant_config("none", {"quantization_config": {"quant_method": "awq"}})


def test_tiny_gguf_model_packed_matches_dequantized(tiny_gguf, monkeypatch, tmp_path):
    from radixlm.runtime.models.loader import load_model

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    packed = load_model(tiny_gguf, "auto", torch.bfloat16, cpu)
    dense = load_model(tiny_gguf, "auto", torch.bfloat16, cpu, quantization="none")
    exact = load_model(tiny_gguf, "auto", torch.float32, cpu)
    assert (packed.model.quant.method == "gguf" and dense.model.quant is None
            and exact.model.quant is None)
    mlp = packed.model.model.layers[0].mlp
    # Q4_1 gate (one plane) and Q8_0 up (two): each part in its own form
    assert mlp.gate_up_proj.cpu_weights.plane_counts == [1, 2]
    assert mlp.down_proj.cpu_weights.plane_counts == [1]
    assert packed.model.model.embed_tokens.packed_logits is not None  # the tied Q8_0 head
    ids = [1, 5, 9, 33, 64, 100, 127, 2]
    want = run_chunks(exact, ids, [len(ids)])
    for loaded in (packed, dense):
        got = run_chunks(loaded, ids, [len(ids)])
        assert (got - want).abs().max() <= 0.03 * want.abs().max()
    # Packed and dense bfloat16 differ only by the scales' rounding to bfloat16.
    assert torch.equal(run_chunks(packed, ids, [len(ids)]).argmax(-1),
                       run_chunks(dense, ids, [len(ids)]).argmax(-1))


def test_embedded_model_runs_its_blocks_by_default():
    from radixlm.runtime import Engine

    prompts = ["Explain why the sky is blue.", "List three uses of Python."]
    with Engine(max_total_tokens=2048, dtype="float32") as exact:
        ids = [exact.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        outs = [o.token_ids for o in exact.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0})]
        want = [exact.score(i, [o])[0] for i, o in zip(ids, outs)]
    with Engine(max_total_tokens=2048) as fast:
        assert fast.dtype == torch.bfloat16
        assert fast.core.runner.model.quant.method == "gguf"
        got = [fast.score(i, [o])[0] for i, o in zip(ids, outs)]
    deltas = [abs(a - b) for w, g in zip(want, got) for a, b in zip(w, g)]
    # Measured 0.02 (bfloat16 activations account for most of it; docs/quantization.md).
    assert statistics.mean(deltas) < 0.06, statistics.mean(deltas)


def test_engine_options_list_every_quantization():
    from radixlm.runtime.config.engine_config import QUANTIZATIONS as ENGINE_CHOICES
    from radixlm.runtime.models.quantization.quant_config import QUANTIZATIONS

    assert ENGINE_CHOICES == QUANTIZATIONS
