"""Block-wise FP8 checkpoints (`weight_block_size`, e4m3 `weight` + float32 `weight_scale_inv`
per block): dequantized at load into float weights, so a tiny Llama, Qwen3, Qwen3-MoE and
Mixtral written in that form give, in fp32, the logits (within 1e-4) and engine greedy tokens
of transformers running the dequantized weights as a plain float checkpoint. Layers the
checkpoint keeps in float stay exactly as stored; quantization="fp8" / "int8" on top
requantize the dequantized weights per channel, exactly as they quantize the float checkpoint;
malformed checkpoints and configs are refused naming the tensor or field.

The checkpoints are written here: every decoder linear (experts too, not the routers) cut
into blocks of BLOCK = 24 x 40, which divides none of the tiny models' dimensions (64, 32 and
128 rows or columns: narrower last blocks, and a block wider than a 32-column weight). For the
checks of where each scale goes, each block is scaled by its own power of two (1/2, 1 or 2)
first, so that a scale applied to the wrong block shows; the requantization checks keep the
weights as they are (a 4x spread within a row doubles int8's per-channel error).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_moe_quant import GREEDY_AGREEMENT, LOGITS_TOL, rel_err

from radixlm.runtime.models.loader import load_model
from radixlm.runtime.models.quantization.block_fp8 import (
    FP8,
    BlockFp8,
    dequantize_block_fp8,
    dequantized_tensors,
)
from radixlm.runtime.models.quantization.quant_config import resolve_quant_config

from conftest import save_tiny_hf_model
from test_model_families import save_family
from test_models import run_chunks

CPU = torch.device("cpu")
BLOCK = (24, 40)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "w1", "w2", "w3")


def quantize_blocks(w: torch.Tensor, block: tuple[int, int], gen: torch.Generator | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)], the dequantized [N, K]
    float32), block by block as a writer does: max|block| maps to 448. With `gen`, each block
    is first scaled by a random power of two."""
    (n, k), (bn, bk) = w.shape, block
    q = torch.empty(n, k, dtype=FP8)
    scales = torch.empty(-(-n // bn), -(-k // bk))
    deq = torch.empty(n, k)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            spread = 1 if gen is None else 2.0 ** torch.randint(-1, 2, (), generator=gen).item()
            blk = w[rows, cols] * spread
            scale = blk.abs().max() / 448
            q[rows, cols] = (blk / scale).clamp(-448, 448).to(FP8)
            scales[i, j] = scale
            deq[rows, cols] = q[rows, cols].float() * scale
    return q, scales, deq


def save_block_fp8(src: Path, dst: Path, keep: tuple[str, ...] = (), split: bool = False,
                   spread: bool = True) -> tuple[Path, Path]:
    """The float checkpoint `src` written block-wise FP8 in dst/fp8 (modules `keep` stored in
    float and listed in modules_to_not_convert; `split`: the scales in a first file and the
    weights in a second, so every scale reaches the loader before its weight), and the same
    model's dequantized weights as a plain float checkpoint in dst/float. `spread`: the blocks
    scaled by powers of two (see quantize_blocks)."""
    gen = torch.Generator().manual_seed(7) if spread else None
    tensors = load_file(str(src / "model.safetensors"))
    quantized, scales, floats = {}, {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in _LINEARS and module not in keep:
            quantized[name], scales[name + "_scale_inv"], floats[name] = quantize_blocks(
                tensor, BLOCK, gen)
        else:
            quantized[name] = floats[name] = tensor
    fp8, float_dir = dst / "fp8", dst / "float"
    for folder in (fp8, float_dir):
        shutil.copytree(src, folder)
        (folder / "model.safetensors").unlink()
    save_file(floats, str(float_dir / "model.safetensors"))
    if split:
        files = {"model-00001-of-00002.safetensors": scales,
                 "model-00002-of-00002.safetensors": quantized}
        weight_map = {name: file for file, part in files.items() for name in part}
        (fp8 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        for file, part in files.items():
            save_file(part, str(fp8 / file))
    else:
        save_file({**quantized, **scales}, str(fp8 / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK), "modules_to_not_convert": ["lm_head", *keep]}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, float_dir


def transformers_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def tiny(tmp_path: Path, family: str) -> Path:
    if family in ("llama", "qwen3"):
        return save_tiny_hf_model(tmp_path / "src", family)
    return save_family(tmp_path / "src", family)


# -- the dequantization ----------------------------------------------------------------------

@pytest.mark.parametrize("shape, block", [((40, 72), (16, 32)), ((64, 64), (16, 16)),
                                          ((5, 130), (8, 32)), ((30, 20), (128, 128))])
def test_dequantize_is_each_weight_times_its_blocks_scale(shape, block):
    gen = torch.Generator().manual_seed(0)
    q, scales, deq = quantize_blocks(torch.randn(shape, generator=gen), block, gen)
    assert torch.equal(dequantize_block_fp8(q, scales, block, torch.float32, "w"), deq)
    # bfloat16: the float32 product rounded once
    assert torch.equal(dequantize_block_fp8(q, scales, block, torch.bfloat16, "w"),
                       deq.bfloat16())


def test_pairs_are_found_in_any_order_and_lazily(tmp_path):
    """A scale before its weight (split files) or after it (one file), and safetensors slices
    (tensor-parallel loading reads lazily): the same float weights."""
    from radixlm.runtime.models.checkpoint_files import checkpoint_tensors

    src = save_tiny_hf_model(tmp_path / "src", "llama")
    fmt = BlockFp8(BLOCK)
    for split, lazy in ((False, False), (True, False), (True, True)):
        fp8, float_dir = save_block_fp8(src, tmp_path / f"{split}{lazy}", split=split)
        out = {name: t[:] if lazy and not isinstance(t, torch.Tensor) else t
               for name, t in dequantized_tensors(checkpoint_tensors(fp8, lazy), fmt,
                                                  torch.float32, CPU)}
        want = load_file(str(float_dir / "model.safetensors"))
        assert out.keys() == want.keys()
        assert all(torch.equal(out[name], want[name]) for name in want)


def test_unpaired_tensors_are_refused_by_name():
    w = torch.zeros(4, 4, dtype=FP8)
    fmt = BlockFp8((2, 2))
    with pytest.raises(ValueError, match=r"'a\.weight' is float8 without a 'a\.weight_scale_inv'"):
        list(dequantized_tensors(iter([("a.weight", w)]), fmt, torch.float32, CPU))
    with pytest.raises(ValueError, match=r"'b\.weight_scale_inv' has no float8 weight"):
        list(dequantized_tensors(iter([("b.weight", w.float()),
                                       ("b.weight_scale_inv", torch.ones(2, 2))]),
                                 fmt, torch.float32, CPU))


def test_a_malformed_scale_is_refused_naming_the_tensor(tmp_path):
    fp8, _ = save_block_fp8(save_tiny_hf_model(tmp_path / "src", "llama"), tmp_path)
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    assert tensors[name].shape == (2, 2)  # k_proj [32, 64] in 24 x 40 blocks
    tensors[name] = tensors[name][:1]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{name}.*\(1, 2\).*needs.*\(2, 2\)"):
        load_model(str(fp8), "auto", torch.float32, CPU)


# -- whole models against transformers -------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-moe", "mixtral"])
def test_logits_match_transformers_on_the_dequantized_weights(tmp_path, family, caplog):
    fp8, float_dir = save_block_fp8(tiny(tmp_path, family), tmp_path, split=family == "mixtral")
    ids = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.models.loader"):
        loaded = load_model(str(fp8), "auto", torch.float32, CPU)
    notes = [r.getMessage() for r in caplog.records if "block-wise FP8" in r.getMessage()]
    assert len(notes) == 1 and "they run as float32 (4 bytes a weight)" in notes[0]
    assert loaded.model.quant is None
    ours = run_chunks(loaded, ids, [40, 1, 29])
    assert (ours - transformers_logits(float_dir, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_engine_greedy_matches_transformers(tmp_path, family):
    """Chunked prefill, decode steps and a prefix-cache hit: transformers' greedy tokens on
    the dequantized checkpoint."""
    import transformers

    from radixlm.runtime import Engine

    fp8, float_dir = save_block_fp8(tiny(tmp_path, family), tmp_path)
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 20)]
    ref = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = [ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8,
                                 do_sample=False)[0, len(p):].tolist() for p in prompts]
    params = {"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8}
    with Engine(str(fp8), device="cpu", dtype="float32", page_size=4, max_total_tokens=1024,
                chunked_prefill_size=16, max_num_batched_tokens=32) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params).token_ids
        second = engine.generate(input_ids=prompts[1], sampling_params=params).token_ids
    assert [first, second] == expected


def test_modules_to_not_convert_stay_exactly_float(tmp_path):
    src = save_family(tmp_path / "src", "qwen3-moe")
    keep = ("model.layers.1.self_attn.q_proj", "model.layers.0.mlp.experts.3.down_proj")
    fp8, float_dir = save_block_fp8(src, tmp_path, keep=keep)
    stored = load_file(str(fp8 / "model.safetensors"))
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert stored["model.layers.1.self_attn.k_proj.weight"].dtype == FP8
    layers = load_model(str(fp8), "auto", torch.float32, CPU).model.model.layers
    q_rows = stored["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(layers[1].self_attn.qkv_proj.weight[:q_rows.shape[0]], q_rows)
    assert torch.equal(layers[0].mlp.experts.w2[3],
                       stored["model.layers.0.mlp.experts.3.down_proj.weight"])
    # Requantizing would round them too: refused, saying what to do.
    with pytest.raises(ValueError, match="modules_to_not_convert keeps.*leave quantization"):
        load_model(str(fp8), "auto", torch.float32, CPU, quantization="fp8")


@pytest.mark.parametrize("family, method", [("llama", "fp8"), ("qwen3-moe", "fp8"),
                                            ("qwen3-moe", "int8")])
def test_requantized_on_load_like_the_float_checkpoint(tmp_path, family, method):
    """quantization="fp8" / "int8" on a block-wise checkpoint: its dequantized weights
    quantized per channel, the same model as the float checkpoint quantized on load, and
    within that format's tolerance of the float model (test_moe_quant's bounds)."""
    fp8, float_dir = save_block_fp8(tiny(tmp_path, family), tmp_path, spread=False)
    ids = torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    loaded = load_model(str(fp8), "auto", torch.float32, CPU, quantization=method)
    assert loaded.model.quant.method == method and not loaded.model.quant.prequantized
    out = run_chunks(loaded, ids, [60])
    online = load_model(str(float_dir), "auto", torch.float32, CPU, quantization=method)
    assert torch.equal(out, run_chunks(online, ids, [60]))
    want = run_chunks(load_model(str(float_dir), "auto", torch.float32, CPU), ids, [60])
    assert rel_err(out, want) < LOGITS_TOL[method]
    agree = (out.argmax(-1) == want.argmax(-1)).double().mean().item()
    assert agree >= GREEDY_AGREEMENT[method]


# -- the config ------------------------------------------------------------------------------

BLOCKWISE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}


def test_block_wise_configs_resolve_like_float_checkpoints():
    declared = {"quantization_config": BLOCKWISE}
    assert resolve_quant_config(None, declared) is None
    assert resolve_quant_config("none", declared) is None
    for method in ("fp8", "int8"):
        config = resolve_quant_config(method, declared)
        assert config.method == method and not config.prequantized
    routers = {**BLOCKWISE, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    assert resolve_quant_config("fp8", {"quantization_config": routers}).method == "fp8"
    # Without a block size, fp8 is the per-tensor / per-channel checkpoint path.
    assert resolve_quant_config(None, {"quantization_config": {
        **BLOCKWISE, "weight_block_size": None}}).prequantized


@pytest.mark.parametrize("forced, change, message", [
    (None, {"weight_block_size": [128]}, "weight_block_size"),
    (None, {"weight_block_size": [128, 0]}, "weight_block_size"),
    (None, {"fmt": "e5m2"}, "fmt"),
    (None, {"activation_scheme": "static"}, "activation_scheme"),
    ("awq", {}, "conflicts.*only fp8 and int8"),
    ("gguf", {}, "conflicts"),
    ("int8", {"ignored_layers": ["re:.*self_attn.*"]}, "ignored_layers keeps"),
])
def test_block_wise_configs_we_cannot_honour_are_refused(forced, change, message):
    with pytest.raises(ValueError, match=message):
        resolve_quant_config(forced, {"quantization_config": {**BLOCKWISE, **change}})
