"""Deterministic inference (`deterministic=True`) on the CPU: the option's plumbing, and the
batch-invariant kernels under the Triton interpreter.

On the CPU the option is accepted and changes nothing. The GPU's batch-invariant kernels
(kernels/invariant_matmul.py, kernels/invariant_attention.py) are checked here in float32
under the interpreter, for their logic: a row's result must be the same bits whatever the
row count, the chunking of a prompt, or whether a query is a decode step. Whether the GPU's
tensor cores keep that promise is tests/test_gpu_deterministic.py's job.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from interpreter_cases import collect_cases, main, results_under_interpreter

# -- configuration and command line (plain CPU tests) -----------------------------------------


def test_config_accepts_deterministic_and_refuses_flashinfer():
    from radixlm.runtime.config.engine_config import EngineConfig

    assert EngineConfig(deterministic=True).deterministic
    assert not EngineConfig().deterministic
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(deterministic=True, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        EngineConfig(deterministic="yes")
    assert EngineConfig.from_kwargs(None, deterministic=True).deterministic


def test_flags_of_serve_and_generate():
    from radixlm.runtime.cli import build_parser
    from radixlm.runtime.server.args import engine_options

    parser = build_parser()
    serve = parser.parse_args(["serve", "--deterministic"])
    assert engine_options(serve)["deterministic"] is True
    assert engine_options(parser.parse_args(["serve"]))["deterministic"] is False
    assert parser.parse_args(["generate", "hi", "--deterministic"]).deterministic is True
    assert parser.parse_args(["generate", "hi"]).deterministic is False


def test_cuda_only_switches():
    from radixlm.runtime.attention import create_backend
    from radixlm.runtime.config.engine_config import EngineConfig

    config = EngineConfig(deterministic=True)
    assert not config.deterministic_on(torch.device("cpu"))
    assert config.deterministic_on(torch.device("cuda"))
    assert not EngineConfig().deterministic_on(torch.device("cuda"))
    with pytest.raises(ValueError, match="attention_backend"):
        create_backend("torch", 0.125, torch.device("cpu"), deterministic=True)


def test_deterministic_is_a_no_op_on_cpu(tmp_path):
    from radixlm.runtime import Engine

    from conftest import save_tiny_hf_model

    folder = save_tiny_hf_model(tmp_path, "llama")
    prompts = [[5 + i, 17, 99, 3 + i * 7] * (i + 2) for i in range(4)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "logprobs": True}
    runs = []
    for deterministic in (False, True):
        with Engine(str(folder), device="cpu", max_total_tokens=512, page_size=4,
                    chunked_prefill_size=8, deterministic=deterministic) as engine:
            model = engine.core.runner.model
            assert model.invariant_head is None  # no GPU kernels switched on
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            runs.append([(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs])
    assert runs[0] == runs[1]


# -- the compiled matmul (ahead of time for Hopper, no GPU needed) ---------------------------


def _mma_instructions(kernel, tiling, block_n: int, block_k: int, operand: str, flat: bool,
                      capability: int = 90) -> set:
    """The tensor-core instructions in the kernel's PTX for sm_<capability>, compiled with the
    pointer and stride alignment a real launch gets (Triton specializes those); with the copy
    engine's loads where the tiling asks for them (Hopper only), and PDL where the GPU has
    it, as a launch there does."""
    import re

    from sm90_ptx import compile_for_cuda

    hopper = capability >= 90
    names = kernel.arg_names
    if tiling.tma:
        sources = {"x_src": f"tensordesc<{operand}[{tiling.block_m}, {block_k}]>",
                   "w_src": f"tensordesc<{operand}[{block_n}, {block_k}]>"}
    else:
        sources = {"x_src": f"*{operand}", "w_src": f"*{operand}"}
    signature = sources | {"out_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
                           "partials_ptr": "*fp32", "counters_ptr": "*i32"}
    constants = {"BLOCK_M": tiling.block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                 "GROUP_M": 8, "SPLIT": tiling.split, "SCALED": operand != "bf16", "FLAT": flat,
                 "UNROLL": tiling.unroll, "TMA": tiling.tma,
                 "PERSISTENT": bool(tiling.persistent), "PDL": hopper}
    aligned = [name for name in names if name.endswith("_ptr") or name.startswith("stride")
               or (name.endswith("_src") and not tiling.tma)]
    ptx = compile_for_cuda(kernel, signature, constants, aligned + ["N", "K", "seg_len"],
                           tiling.num_warps, tiling.num_stages, capability).asm["ptx"]
    loads = "cp.async.bulk.tensor" if tiling.tma else "cp.async"
    assert loads in ptx, "the loads must be pipelined"
    instruction = r"wgmma\.mma_async\.[\w.]+" if hopper else r"mma\.sync\.aligned\.[\w.]+"
    return set(re.findall(instruction, ptx))


@pytest.mark.parametrize("operand", ["bf16", "fp8e4nv"])
def test_every_tiling_issues_the_same_tensor_core_instruction(operand):
    """Deterministic mode picks the matmul's tiling by row count, and the copy engine's loads
    where the GPU and the operands allow them; that is only invariant if every tiling, with
    either kind of load, adds a dot's products with the same instruction. Checked on the
    PTX."""
    from dataclasses import replace

    pytest.importorskip("triton.backends.nvidia")
    from radixlm.kernels.invariant_matmul import DEFAULT, _invariant_mm_kernel

    tilings = {replace(tiling, tma=tma) for _, tiling in DEFAULT.tilings for tma in (False, True)}
    tilings |= {replace(tiling, persistent=1) for tiling in tilings if not tiling.split}
    shapes = {(tiling, flat): _mma_instructions(_invariant_mm_kernel, tiling, DEFAULT.block_n,
                                                DEFAULT.block_k, operand, flat)
              for tiling in tilings for flat in (False, True)}
    found = set().union(*shapes.values())
    assert len(found) == 1 and all(shapes.values()), shapes
    k = 16 if operand == "bf16" else 32
    assert next(iter(found)).startswith(f"wgmma.mma_async.sync.aligned.m64n{DEFAULT.block_n}k{k}")


@pytest.mark.parametrize("operand", ["bf16", "fp8e4nv"])
def test_every_tiling_issues_one_instruction_on_ada_too(operand):
    """Before Hopper the dots are warp-level `mma.sync` (m16n8k16, k32 for float8 on Ada):
    each warp walks its part of the tile in the same k steps whatever the tiling, so one
    instruction again means one order of the products. sm_89 (RTX 40x0, L4), plain loads (no
    copy engine there)."""
    from dataclasses import replace

    pytest.importorskip("triton.backends.nvidia")
    from radixlm.kernels.invariant_matmul import DEFAULT, _invariant_mm_kernel

    tilings = {replace(tiling, tma=False) for _, tiling in DEFAULT.tilings}
    shapes = {(tiling, flat): _mma_instructions(_invariant_mm_kernel, tiling, DEFAULT.block_n,
                                                DEFAULT.block_k, operand, flat, capability=89)
              for tiling in tilings for flat in (False, True)}
    found = set().union(*shapes.values())
    assert len(found) == 1 and all(shapes.values()), shapes
    k = 16 if operand == "bf16" else 32
    assert next(iter(found)).startswith(f"mma.sync.aligned.m16n8k{k}.row.col.f32")


def test_a_pipeline_too_deep_for_the_gpus_shared_memory_is_made_shallower():
    """float32 operands, or a GPU with 99 KB of shared memory, cannot hold every tiling's
    pipeline: the launch retries with fewer stages (the same float operations) and remembers
    the depth that fitted, so the next call compiles nothing that fails."""
    from triton.runtime.errors import OutOfResources

    from radixlm.kernels.shared_memory import launch_within_shared_memory

    tried = []

    def launch(stages: int) -> None:
        tried.append(stages)
        if stages > 3:
            raise OutOfResources(stages * 49152, 3 * 49152 + 1024, "shared memory")

    key = ("a tiling", "float32", "this test")
    launch_within_shared_memory(launch, 5, key)
    assert tried == [5, 4, 3]
    launch_within_shared_memory(launch, 5, key)
    assert tried == [5, 4, 3, 3]

    def never_fits(stages: int) -> None:
        raise OutOfResources(1 << 20, 1024, "shared memory")

    with pytest.raises(OutOfResources):
        launch_within_shared_memory(never_fits, 2, ("another", "key"))


def test_a_tiling_that_would_split_columns_is_refused():
    from radixlm.kernels.invariant_matmul import InvariantConfig, Tiling

    with pytest.raises(ValueError, match="block_m"):
        InvariantConfig(tilings=((1 << 62, Tiling(64, 8, 3)),))


# -- the kernels under the Triton interpreter (cases run in a subprocess) --------------------


def case_matmul_rows_do_not_depend_on_m():
    """Every tiling (split path: one program per segment, ticket sum; one program per tile
    with 64 or 128 rows) gives each row the same bits, at any offset in the batch."""
    from radixlm.kernels.invariant_matmul import (
        InvariantConfig,
        Tiling,
        invariant_matmul,
        segments_for,
    )

    gen = torch.Generator().manual_seed(0)
    n, k = 256, 1000
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    x = torch.randn(150, k, generator=gen)
    seg_len, segs = segments_for(n, k, torch.device("cpu"))
    assert segs > 1, "the case must exercise segments"
    full = invariant_matmul(x, weight)
    err = ((full - x @ weight.T).norm() / (x @ weight.T).norm()).item()
    assert err < 1e-6, err
    small = InvariantConfig(tilings=((8, Tiling(64, 4, 2, split=True)), (40, Tiling(64, 4, 3)),
                                     (1 << 62, Tiling(128, 8, 4))))
    nested = InvariantConfig(flat_max_tiles=0)  # a loop per segment
    # Two K tiles a loop step: the same dots in the same order (the last segment of K has an
    # odd tile here, past K, that adds zeros).
    paired = InvariantConfig(tilings=((8, Tiling(64, 4, 2, split=True, unroll=2)),
                                      (40, Tiling(64, 4, 3, unroll=2)),
                                      (1 << 62, Tiling(128, 8, 3, unroll=2))))
    paired_nested = InvariantConfig(tilings=paired.tilings, flat_max_tiles=0)
    assert (seg_len // 64) % 2 == 0, "the case must exercise paired tiles"
    for lo, hi in ((0, 1), (0, 3), (7, 20), (0, 64), (10, 75), (3, 150)):
        rows = invariant_matmul(x[lo:hi].clone(), weight)
        assert torch.equal(rows, full[lo:hi]), (lo, hi)
    for lo, hi in ((0, 3), (7, 30), (3, 150)):  # every tiling, and a loop per segment
        for config in (small, nested, paired, paired_nested):
            rows = invariant_matmul(x[lo:hi].clone(), weight, config=config)
            assert torch.equal(rows, full[lo:hi]), (lo, hi, config)
    head = invariant_matmul(x[:5], weight, torch.float32)
    assert head.dtype == torch.float32
    return f"{segs} segments of {seg_len}; rel err {err:.1e}"


def case_int4_rows_do_not_depend_on_m():
    """INT4 weights through the w4a16 kernel with deterministic inference's fixed tiling."""
    from radixlm.kernels.reference import w4a16_matmul_reference
    from radixlm.kernels.w4a16 import invariant_config, w4a16_matmul
    from radixlm.runtime.models.quantization.packing import pack_gptq_weight

    gen = torch.Generator().manual_seed(0)
    n, k, group = 128, 256, 128
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    qweight = pack_gptq_weight(q, 4)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    x = torch.randn(100, k, generator=gen)

    def product(rows: torch.Tensor) -> torch.Tensor:
        return w4a16_matmul(rows, qweight, scales, zeros, group, 4, invariant_config(group))

    full = product(x)
    err = (full - w4a16_matmul_reference(x, qweight, scales, zeros, group)).abs().max().item()
    assert err < 1e-4, err
    for m in (1, 5, 64, 70):
        assert torch.equal(product(x[3:3 + m].clone()), full[3:3 + m]), m
    return f"max abs err {err:.1e}"


def attention_invariance(layer_kwargs: dict, device: str = "cpu",
                         dtype: torch.dtype = torch.float32, heads: int = 8, kv_heads: int = 2,
                         dim: int = 32, length: int = 600,
                         storage: torch.dtype | None = None,
                         chunks: tuple[tuple[int, int], ...] = ((0, 97), (97, 256), (256, 257),
                                                                 (257, 531), (531, 600)),
                         positions: tuple[int, ...] = (0, 256, 300, 599),
                         workers: tuple[int | None, ...] = (None, 3),
                         tol: float = 1e-5) -> str:
    """One sequence of `length` tokens (several 256-key splits): every query's output,
    computed as one prefill, as chunks beside other sequences, and as a decode step alone or
    in a batch with one program per sequence or several (partials and a merge), is the same
    bits; and the prefill is close to the reference. (Also run on the GPU at the 8B shape.)"""
    from radixlm.kernels.reference import paged_attention_reference
    from radixlm.runtime.attention.backend import ForwardBatch, LayerAttention
    from radixlm.runtime.attention.kv_cache import KVCache
    from radixlm.runtime.attention.triton_backend import TritonAttention

    page = 16
    gen = torch.Generator().manual_seed(0)
    num_pages = 3 * length // page + 16
    cache = KVCache(1, num_pages * page, kv_heads, dim, dtype, torch.device(device), page,
                    storage)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    free = torch.randperm(num_pages, generator=gen).tolist()

    def slots(n: int) -> torch.Tensor:
        pages = torch.tensor([free.pop() for _ in range(-(-n // page))])
        return (pages[:, None] * page + torch.arange(page)).flatten()[:n]

    seqs = {"main": slots(length), "a": slots(300), "b": slots(77)}
    queries = {name: torch.randn(len(s), heads, dim, generator=gen).to(device, dtype)
               for name, s in seqs.items()}
    layer = LayerAttention(**layer_kwargs)
    scale = dim ** -0.5

    def run(parts: list[tuple[str, int, int]], num_workers: int | None = None):
        """parts: (sequence, first query, end) -> the step's output rows."""
        kv_lens = [end for _, _, end in parts]
        table = torch.zeros(len(parts), max(kv_lens), dtype=torch.int64)
        for i, (name, _, end) in enumerate(parts):
            table[i, :end] = seqs[name][:end]
        q = torch.cat([queries[name][lo:end] for name, lo, end in parts])
        zeros = torch.zeros(q.shape[0], dtype=torch.int64, device=device)
        batch = ForwardBatch(input_ids=zeros, positions=zeros,
                             q_lens=[end - lo for _, lo, end in parts], kv_lens=kv_lens,
                             out_slots=zeros, slot_table=table.to(device), kv_cache=cache)
        backend = TritonAttention(scale, num_splits=num_workers, deterministic=True)
        backend.plan(batch)
        return backend.forward(q, q[:, :kv_heads], q[:, :kv_heads], 0, batch, layer,
                               kv_stored=True), batch, q

    full, batch, q = run([("main", 0, length)])
    ref = paged_attention_reference(q, cache.k[0].to(dtype), cache.v[0].to(dtype),
                                    batch.slot_table, batch.q_lens, batch.kv_lens, scale,
                                    layer.sliding_window, layer.logit_softcap)
    err = ((full.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, err
    for lo, end in chunks:
        out = run([("a", 0, 50), ("main", lo, end), ("b", 76, 77)])[0]
        assert torch.equal(out[50:50 + end - lo], full[lo:end]), ("chunk", lo, end)
    for pos in positions:
        for num in workers:
            alone = run([("main", pos, pos + 1)], num)[0]
            assert torch.equal(alone[0], full[pos]), ("decode", pos, num)
            mixed = run([("a", 5, 6), ("main", pos, pos + 1), ("b", 0, 20)], num)[0]
            assert torch.equal(mixed[1], full[pos]), ("decode in a batch", pos, num)
    return f"rel err {err:.1e}"


def case_attention_invariant_full():
    return attention_invariance({})


def case_attention_invariant_window_and_softcap():
    return attention_invariance({"sliding_window": 300, "logit_softcap": 20.0})


def case_engine_tokens_do_not_depend_on_the_batch():
    """The engine with the batch-invariant kernels switched on by hand on the CPU (the GPU's
    deterministic mode): a prompt alone, and beside others with another chunk size after a
    request that warmed the prefix cache with its first half, gets the same tokens and the
    same logprobs, bit for bit."""
    from radixlm.runtime import Engine

    from test_triton_kernels import save_llama

    folder = save_llama(Path(tempfile.mkdtemp()), head_dim=32)
    target = [(7 * i) % 500 + 3 for i in range(24)]
    others = [[(11 * i + j) % 500 + 3 for i in range(9 + 5 * j)] for j in range(2)]
    params = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "logprobs": True,
              "top_logprobs_num": 3}

    def deterministic(engine) -> None:
        core = engine.core
        core.runner.model.use_fused_kernels(True)
        core.runner.model.use_batch_invariant(True)
        core.runner.attn.deterministic = True

    def run(chunk: int, batch: list[list[int]], warm: list[int] | None):
        with Engine(str(folder), device="cpu", dtype="float32", max_total_tokens=1024,
                    chunked_prefill_size=chunk, page_size=4,
                    attention_backend="triton") as engine:
            deterministic(engine)
            if warm is not None:
                engine.generate(input_ids=[warm], sampling_params=params)
            outs = engine.generate(input_ids=batch, sampling_params=params)
            out = outs[batch.index(target)]
            return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]

    alone = run(16, [target], None)
    mixed = run(7, others[:1] + [target] + others[1:], target[:13] + [1, 2])
    assert mixed == alone, (mixed, alone)
    return f"tokens {alone[0]}"


CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", CASES)
def test_kernel_under_interpreter(interpreter_results, case):
    result = interpreter_results[case]
    assert result["ok"], result["detail"]


if __name__ == "__main__":
    main(globals())
