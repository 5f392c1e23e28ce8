"""GGUF mixture-of-experts files (Mixtral as "llama" with experts, "qwen2moe", "qwen3moe").

A tiny random transformers model is saved as a safetensors folder, and the same weights are
written as a GGUF file the way llama.cpp lays them out (the gguf package's tensor names and
metadata keys, experts stacked [E, ...], q/k rows permuted for "llama", the shared expert's
gate a vector). Loaded from the GGUF, our model gives transformers' logits on the folder and
its greedy tokens through the engine: with F32 tensors, and with Q8_0 experts and linears
against the folder holding the dequantized weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radixlm.runtime.models import gguf_loader, gguf_moe
from radixlm.runtime.models.loader import load_model

from conftest import save_tiny_hf_model, tiny_config
from gguf_files import Q8_0, gguf_writer, write_tensors
from test_models import check_converted_logits, check_engine_greedy, run_chunks

CPU = torch.device("cpu")
# name -> (GGUF architecture, transformers config on top of conftest's tiny Llama). Qwen2-MoE
# has a dense layer (the GGUF says so by its tensors) and a shared expert 48 wide, which Q8_0
# cannot block (its down projection stays F32 in the Q8_0 file).
CASES = {
    "mixtral": ("llama", dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                              num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=None)),
    "qwen2-moe": ("qwen2moe", dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                                   num_experts=8, num_experts_per_tok=3,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                   norm_topk_prob=False, mlp_only_layers=[1],
                                   use_sliding_window=False)),
    "qwen3-moe": ("qwen3moe", dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                   num_experts=16, num_experts_per_tok=4,
                                   moe_intermediate_size=32, norm_topk_prob=True, head_dim=32)),
}
_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
          "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


class MoEFiles(NamedTuple):
    folder: Path  # the transformers model (with the dequantized weights for Q8_0)
    gguf: Path
    arch: str
    config: dict  # the transformers config it was made from
    original: dict[str, torch.Tensor]  # the folder's weights before any Q8_0 rounding
    q8_0: frozenset[str]  # GGUF tensors stored as Q8_0


def _gguf_names(hf_names, arch: str, layers: int) -> dict[str, str]:
    """HF checkpoint name -> GGUF tensor name, from the gguf package's tables (an expert's
    tensor -> its layer's stack). qwen2moe's table has no dense FFN (llama.cpp makes every
    layer sparse): a dense layer's tensors take the standard names."""
    tables = [gguf.get_tensor_name_map(_ARCHS[arch], layers),
              gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)]
    names = {}
    for hf_name in hf_names:
        merged = _EXPERT.sub(".experts.", hf_name)
        name = next(filter(None, (t.get_name(merged, try_suffixes=(".weight", ".bias"))
                                  for t in tables)), None)
        assert name is not None, hf_name
        names[hf_name] = name
    return names


def _takes_q8_0(name: str, array: np.ndarray) -> bool:
    """Every linear Q8_0 can block (rows a multiple of 32 inputs): experts, attention, dense
    and shared-expert projections. Routers stay F32 (as llama.cpp keeps them), and so do the
    norms, the embedding and the head."""
    return (name.startswith("blk.") and array.ndim == 2 and array.shape[-1] % 32 == 0
            and not name.endswith(_ROUTERS))


def _gguf_tensors(weights: dict[str, torch.Tensor], names: dict[str, str], arch: str,
                  cfg: dict) -> dict[str, np.ndarray]:
    stacks: dict[str, dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in weights.items():
        array, name = tensor.numpy(), names[hf_name]
        expert = _EXPERT.search(hf_name)
        if expert is not None:
            stacks.setdefault(name, {})[int(expert[1])] = array
            continue
        if name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # llama.cpp's [d]
        if arch == "llama" and re.search(r"attn_[qk]\.weight$", name):
            # llama.cpp's rotary layout: head row 2i + s holds HF row s * d/2 + i.
            heads = cfg["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            head_dim = array.shape[0] // heads
            array = array.reshape(heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(
                array.shape)
        out[name] = np.ascontiguousarray(array)
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def _write_gguf(path: Path, arch: str, cfg: dict, tensors: dict[str, np.ndarray],
                q8_0: frozenset[str]) -> None:
    writer = gguf_writer(path, arch, cfg)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "head_dim" in cfg:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    # As llama.cpp's converter: a Mixtral's expert width is its feed_forward_length (read from
    # the tensors by ours); Qwen's have their own keys. norm_topk_prob is left to the
    # architecture's default, as llama.cpp's files do.
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if "shared_expert_intermediate_size" in cfg:
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    write_tensors(writer, tensors, q8_0)


def _make_files(root: Path, case: str, quantized: bool) -> MoEFiles:
    arch, overrides = CASES[case]
    cfg = tiny_config("llama") | overrides
    folder = save_tiny_hf_model(root / "hf", "llama", **overrides)
    weights = load_file(str(folder / "model.safetensors"))
    original = {name: t.clone() for name, t in weights.items()}
    names = _gguf_names(weights, arch, cfg["num_hidden_layers"])
    q8_0 = frozenset(names[n] for n, t in weights.items()
                     if quantized and _takes_q8_0(names[n], t.numpy()))
    for hf_name in weights:
        if names[hf_name] in q8_0:
            # Q8_0 blocks each row on its own, so stacking experts and permuting q/k rows
            # commute with its rounding: the folder gets exactly the weights the GGUF holds.
            array = weights[hf_name].numpy()
            rounded = gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0)
            weights[hf_name] = torch.from_numpy(rounded.astype(np.float32))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = root / f"tiny-{case}.gguf"
    _write_gguf(path, arch, cfg, _gguf_tensors(weights, names, arch, cfg), q8_0)
    return MoEFiles(folder, path, arch, cfg, original, q8_0)


@pytest.fixture(scope="module", params=[(c, q) for c in CASES for q in ("F32", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def moe_files(request, tmp_path_factory) -> MoEFiles:
    case, kind = request.param
    return _make_files(tmp_path_factory.mktemp(f"{case}-{kind}"), case, kind == "Q8_0")


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory, monkeypatch) -> Path:
    """Conversions land in one cache for this module; these files have no vocabulary, so the
    tokenizer step (covered in test_gguf_loader.py) is skipped."""
    root = tmp_path_factory.getbasetemp() / "gguf-moe-cache"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(root))
    monkeypatch.setattr(gguf_loader, "_save_tokenizer", lambda *args: None)
    return root


def test_converted_folder_holds_the_transformers_checkpoint(moe_files):
    """Config fields and every tensor: the converted folder is the transformers checkpoint
    (names, expert order, un-permuted q/k); routers always float; Q8_0 experts keep their
    blocks, one slice per expert, and are the original weights within Q8_0's rounding."""
    from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks

    folder = gguf_loader.convert_gguf(moe_files.gguf)
    config = json.loads((folder / "config.json").read_text())
    cfg = moe_files.config
    assert config["architectures"] == cfg["architectures"]
    assert config["model_type"] == cfg["model_type"]
    assert config["num_experts_per_tok"] == cfg["num_experts_per_tok"]
    if moe_files.arch == "llama":
        assert config["num_local_experts"] == cfg["num_local_experts"]
        assert config["intermediate_size"] == cfg["intermediate_size"]
    else:
        for key in ("num_experts", "moe_intermediate_size", "norm_topk_prob"):
            assert config[key] == cfg[key], key
        assert config["mlp_only_layers"] == cfg.get("mlp_only_layers", [])
        assert config.get("shared_expert_intermediate_size", 0) == cfg.get(
            "shared_expert_intermediate_size", 0)
    assert ("quantization_config" in config) == bool(moe_files.q8_0)

    reference = load_file(str(moe_files.folder / "model.safetensors"))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        types = json.loads(f.metadata()[gguf_loader.TYPES_METADATA])
        converted = {name: f.get_tensor(name) for name in f.keys()}
    assert set(converted) == set(reference)
    assert not any(name.endswith(".gate.weight") for name in types)  # the routers
    experts = {name for name in converted if ".experts." in name}
    assert (experts <= set(types)) == bool(moe_files.q8_0)
    for name, tensor in converted.items():
        if name in types:
            tensor = GGUFBlocks.from_rows(types[name], tensor).dequantize()
        assert torch.equal(tensor, reference[name]), name
    if moe_files.q8_0:
        assert types  # the attention's blocks were kept
        for name, tensor in converted.items():
            if ".experts." in name:
                tensor = GGUFBlocks.from_rows(types[name], tensor).dequantize()
                # Half a step (max |block| / 127), plus the step's float16 rounding times
                # up to 127 codes: 127 * 2^-11 of a step.
                original = moe_files.original[name]
                step = original.reshape(original.shape[0], -1, 32).abs().amax(-1) / 127
                error = (tensor - original).abs().reshape(step.shape + (32,))
                assert (error <= 0.57 * step[..., None] + 1e-7).all(), name
                assert not torch.equal(tensor, original)


def test_logits_match_transformers(moe_files):
    """Whole prompt and chunked prefill with single decode steps, float32: within 1e-4 of
    transformers on the folder. For Q8_0 both hold the same dequantized weights, so Q8_0's
    rounding is in both and the float32 tolerance applies."""
    check_converted_logits(moe_files.folder, moe_files.gguf,
                           moe_files.config["architectures"][0], 60, [7, 1, 31, 1, 20])


def test_greedy_matches_transformers_through_the_engine(moe_files):
    """Prompts sharing a prefix (cache hits), prefilled in chunks mixed with decode steps:
    transformers' greedy tokens."""
    check_engine_greedy(moe_files.folder, moe_files.gguf, shared=30)


@pytest.mark.parametrize("kernel", [True, False], ids=["our-kernel", "no-compiler"])
def test_bfloat16_cpu_runs_the_files_blocks(tmp_path, monkeypatch, kernel):
    """The CPU default for a GGUF model (quantization "gguf", bfloat16): attention, dense and
    shared-expert linears run their Q8_0 blocks packed, and so do the experts, stacked over
    the experts in our kernel's tiles; the routers are bfloat16 floats. Logits stay close to
    the float32 model's. Without our kernel (no compiler) the experts are bfloat16 floats."""
    from radixlm.runtime.models.layers.moe import FusedMoE
    from radixlm.runtime.models.quantization import cpu_weights
    from radixlm.runtime.models.quantization.gguf import GGUFLinearMethod

    if not kernel:
        monkeypatch.setattr(cpu_weights, "linear_kernel", lambda: None)
    files = _make_files(tmp_path, "qwen2-moe", quantized=True)
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    loaded = load_model(str(files.gguf), "auto", torch.bfloat16, CPU)
    model = loaded.model
    assert model.quant.method == "gguf"
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj.quant_method, GGUFLinearMethod)
    assert isinstance(layers[0].mlp.shared_expert.gate_up_proj.quant_method, GGUFLinearMethod)
    assert isinstance(layers[1].mlp.gate_up_proj.quant_method, GGUFLinearMethod)  # dense layer
    experts = layers[0].mlp.experts
    assert isinstance(experts, FusedMoE) and experts.quant is None
    if kernel:
        cfg = files.config
        stacked = experts.gguf.linears
        assert experts.w13.numel() == 0 and stacked["gate_up"].segments == 1
        assert stacked["gate_up"].width == 2 * cfg["moe_intermediate_size"]
        assert all(t.shape[0] == cfg["num_experts"] for s in stacked.values()
                   for t in s.tensors)
        # Q8_0 as a 4-bit plane and a compact high plane: about a byte per weight, where
        # bfloat16 copies take two.
        held = sum(t.numel() * t.element_size() for t in experts.buffers())
        weights = 3 * cfg["num_experts"] * cfg["moe_intermediate_size"] * cfg["hidden_size"]
        assert held < 1.3 * weights, held / weights
    else:
        assert experts.gguf is None
        assert experts.w13.dtype == torch.bfloat16 and experts.w13_scale is None
    assert layers[0].mlp.gate.quant_method is None
    got = run_chunks(loaded, ids, [len(ids)])
    want = run_chunks(load_model(str(files.gguf), "auto", torch.float32, CPU), ids, [len(ids)])
    error = ((got - want).norm() / want.norm()).item()
    assert error < 3e-2, error  # measured 0.7%: bfloat16 activations and weights


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel_matches_eager_and_keeps_rows_apart(tmp_path, monkeypatch, case):
    """The C++ forward step runs the sparse layers too (routing, the experts' MLPs, the
    shared expert, a dense layer beside them): a decode step gives the eager path's hidden
    states, on the file's Q8_0 blocks in bfloat16 and on float experts in float32; and a
    row's hidden state is the same bits whether its prompt was prefilled whole, in chunks,
    decoded or beside other sequences (whose tokens route to other experts)."""
    from test_cpu_decode import LAYOUTS, _decode_both, _rows_of

    from radixlm.kernels import cpu_decode as kernel_build
    from radixlm.runtime.attention.kv_cache import KVCache
    from radixlm.runtime.attention.torch_native import TorchNativeAttention
    from radixlm.runtime.execution.cpu_decode import unsupported

    kernel = kernel_build.load()
    if kernel is None:
        pytest.skip("the CPU decode kernel does not build here (no C++ compiler?)")
    files = _make_files(tmp_path, case, quantized=True)
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(str(files.gguf), "auto", dtype, CPU).model
        cfg = model.config
        assert unsupported(model, TorchNativeAttention(0.1), KVCache(
            1, 8, cfg.num_kv_heads, cfg.head_dim, dtype, CPU, page_size=4)) is None
        fast, eager = _decode_both(model, kernel, [5, 17, 9], dtype)
        tolerance = 0.03 if dtype == torch.bfloat16 else 1e-5
        assert (fast.float() - eager.float()).abs().max() <= tolerance * eager.abs().max()
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, cfg.vocab_size, (40,), generator=gen) for _ in range(3)]
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(str(files.gguf), "auto", dtype, CPU).model
        alone = _rows_of(model, kernel, [[(0, 40)]], ids[:1], dtype)
        for steps in LAYOUTS:
            rows = _rows_of(model, kernel, steps, ids, dtype)
            for position in range(40):
                if (0, position) in rows:
                    assert torch.equal(rows[(0, position)], alone[(0, position)]), (
                        dtype, steps, position)


def test_speculation_and_batching_leave_a_request_unchanged(tmp_path):
    """Through the engine on the default CPU path (the file's Q8_0 blocks, bfloat16, the
    kernel's sparse layers): a greedy request's tokens and logprobs are the same bits with
    n-gram speculation on, beside other requests, and with a prefix cached, as alone on a cold
    engine; the speculator did draft (its verification steps ran), and no page leaked."""
    from test_engine import assert_no_leak

    from radixlm.kernels import cpu_decode as kernel_build
    from radixlm.runtime import Engine, SamplingParams

    if kernel_build.load() is None:
        pytest.skip("the CPU decode kernel does not build here (no C++ compiler?)")
    files = _make_files(tmp_path, "qwen3-moe", quantized=True)
    gen = torch.Generator().manual_seed(4)
    # Repeated phrases give the n-gram speculator drafts to verify.
    phrase = torch.randint(3, 512, (6,), generator=gen).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() + phrase * 4 + phrase[:3]
               for n in (3, 11, 20)]
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=True,
                            top_logprobs_num=3)
    options = dict(max_total_tokens=2048, page_size=4, chunked_prefill_size=8,
                   max_num_batched_tokens=24)
    with Engine(str(files.gguf), **options) as plain:
        assert plain.core.runner.cpu_decode is not None
        alone = []
        for ids in prompts:
            plain.flush_cache()
            alone.append(plain.generate(input_ids=ids, sampling_params=params))
    with Engine(str(files.gguf), speculative="ngram", **options) as speculating:
        speculating.generate(input_ids=prompts[1][:9], sampling_params={"max_new_tokens": 1})
        got = speculating.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        assert speculating.stats()["spec_drafted_tokens"] > 0
        assert_no_leak(speculating)
    for want, out in zip(alone, got):
        assert out.token_ids == want.token_ids
        assert out.logprobs == want.logprobs


def test_conversion_writes_shards_of_bounded_size(tmp_path, monkeypatch):
    """A conversion holds one shard of tensors in memory at a time: with shards smaller than
    the model the folder has several files and an index, every tensor in one of them with
    its block type, and the model loads the same logits as from one file."""
    files = _make_files(tmp_path, "qwen3-moe", quantized=True)
    ids = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    whole = gguf_loader.convert_gguf(files.gguf, tmp_path / "one")
    assert (whole / "model.safetensors").is_file()
    monkeypatch.setattr(gguf_loader, "SHARD_BYTES", 64 << 10)
    sharded = gguf_loader.convert_gguf(files.gguf, tmp_path / "shards")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    names = sorted(set(index["weight_map"].values()))
    assert len(names) > 2 and not (sharded / "model.safetensors").exists()
    with safe_open(str(whole / "model.safetensors"), framework="pt") as f:
        want_types = json.loads(f.metadata()[gguf_loader.TYPES_METADATA])
        want = {name: f.get_tensor(name) for name in f.keys()}
    got, got_types = {}, {}
    for name in names:
        with safe_open(str(sharded / name), framework="pt") as f:
            got_types.update(json.loads(f.metadata()[gguf_loader.TYPES_METADATA]))
            got.update({key: f.get_tensor(key) for key in f.keys()})
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == name}
    assert got_types == want_types and set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    logits = [run_chunks(load_model(str(folder), "auto", torch.bfloat16, CPU), ids, [20])
              for folder in (whole, sharded)]
    assert torch.equal(*logits)


def _meta(values: dict):
    return lambda key, default=None: values.get(key, default)


_QWEN2_SHAPES = {"blk.0.ffn_gate_inp.weight": [64, 8], "blk.0.ffn_up_exps.weight": [64, 32, 8],
                 "blk.0.ffn_up_shexp.weight": [64, 48], "blk.1.ffn_up.weight": [64, 128]}


def test_moe_config_reads_keys_and_falls_back_to_tensors():
    keys = {"expert_count": 8, "expert_used_count": 2}
    config = gguf_moe.moe_config("qwen2_moe", _meta(keys), _QWEN2_SHAPES, 2)
    assert config == {"num_experts_per_tok": 2, "num_experts": 8, "moe_intermediate_size": 32,
                      "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                      "shared_expert_intermediate_size": 48}
    # expert_weights_norm, where a file has it, overrides llama.cpp's per-architecture default.
    config = gguf_moe.moe_config("qwen2_moe", _meta(keys | {"expert_weights_norm": True}),
                                 _QWEN2_SHAPES, 2)
    assert config["norm_topk_prob"] is True
    shapes = {k: v for k, v in _QWEN2_SHAPES.items() if "shexp" not in k}
    config = gguf_moe.moe_config("qwen3_moe", _meta(keys), shapes, 2)
    assert config["norm_topk_prob"] is True and "shared_expert_intermediate_size" not in config


@pytest.mark.parametrize("model_type,extra,layers,match", [
    ("qwen3_moe", {"expert_gating_func": 2}, 1, "expert_gating_func"),
    ("qwen3_moe", {"expert_weights_scale": 2.5}, 1, "expert_weights_scale"),
    ("qwen3_moe", {"expert_used_count": 9}, 1, "expert_used_count"),
    ("mixtral", {}, 2, "no experts"),
    ("mixtral", {"expert_weights_norm": False}, 1, "expert_weights_norm"),
])
def test_moe_config_refuses_what_our_models_cannot_run(model_type, extra, layers, match):
    keys = {"expert_count": 8, "expert_used_count": 2} | extra
    with pytest.raises(ValueError, match=match):
        gguf_moe.moe_config(model_type, _meta(keys), _QWEN2_SHAPES, layers)


@pytest.mark.parametrize("form", ["blocks", "float-down", "forms-differ"])
def test_gguf_experts_stack_each_expert_as_its_own_linears(monkeypatch, form):
    """GGUFExperts tiles every expert's Q8_0 blocks into stacks over the experts; each
    expert's MLP equals the same expert run through its own CpuWeights (one linear per
    part, the kernel's own product), whether the parts are blocks, a part is float (a type
    without blocks: dense tiles for every expert), or one expert's compact form differs
    from the others' (then every expert is tiled in the uncompacted form)."""
    from radixlm.runtime.models.quantization import gguf_experts
    from radixlm.runtime.models.quantization.cpu_weights import CpuWeights, linear_kernel
    from radixlm.runtime.models.quantization.gguf_blocks import GGUFBlocks

    if linear_kernel() is None:
        pytest.skip("the CPU kernel does not build here (no C++ compiler?)")
    experts, hidden, inter = 4, 64, 32
    gen = torch.Generator().manual_seed(0)
    parts = {}
    for e in range(experts):
        for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                            ("down", (hidden, inter))):
            w = torch.randn(shape, generator=gen) * 0.1
            if form == "float-down" and part == "down":
                parts[e, part] = w
            else:
                blocks = gguf.quants.quantize(w.numpy(), Q8_0)
                parts[e, part] = GGUFBlocks.from_rows("Q8_0", torch.from_numpy(blocks))
    if form == "forms-differ":  # expert 2's compact tiles come out with float32 scales
        tile = gguf_experts.tile_planes
        calls = iter(range(10 ** 6))

        def odd_one(planes, compact=True, kept=True):
            tiled = tile(planes, compact, kept)
            if compact and next(calls) % experts == 2:
                tiled = tiled._replace(scales=tiled.scales.float())
            return tiled
        monkeypatch.setattr(gguf_experts, "tile_planes", odd_one)
    layer = gguf_experts.GGUFExperts(experts, hidden, inter)
    for (e, part), loaded in parts.items():
        layer.load(e, part, loaded)
    assert layer.linears and all(t.shape[0] == experts for s in layer.linears.values()
                                 for t in s.tensors)
    assert (layer.linears["down"].segments == 0) == (form == "float-down")
    x = (torch.randn(5, hidden, generator=gen)).to(torch.bfloat16)
    for e in range(experts):
        def own(part):
            p = parts[e, part]
            return (CpuWeights(dense=p) if isinstance(p, torch.Tensor)
                    else CpuWeights(p.planes()))
        gate, up = own("gate")(x), own("up")(x)
        want = own("down")(torch.nn.functional.silu(gate) * up)
        assert torch.equal(layer.expert_mlp(e, x), want), e
