"""Attention kernels on one GPU: our Triton kernels vs FlashInfer (and torch-native), plus the
fused elementwise kernels vs the torch ops they replace.

Decode: paged attention, one query per sequence; the floor is the KV bytes read over the
measured copy bandwidth of the card (--bandwidth, 4.1 TB/s on an H200). Extend: prefill chunks
over cached prefixes, in TFLOP/s of causal attention actually computed. Times are the median of
triton.testing.do_bench (CUDA events), attention kernels only (the K/V store is timed apart).
Also sweeps the Triton decode/extend tile configs and split counts, so the defaults can be
checked on the card.

    python benchmarks/attention_kernels.py [--out PATH] [--sweep full|splits|latency|none]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from radixlm.kernels import fused
from radixlm.kernels import triton_attention as ta
from radixlm.runtime.attention.backend import FULL_ATTENTION, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.attention.torch_native import TorchNativeAttention
from radixlm.runtime.attention.triton_backend import TritonAttention

from results_dir import results_dir

HEADS, KV_HEADS, DIM, DTYPE = 32, 8, 128, torch.bfloat16
DECODE = {  # name: (batch, context, page_size)
    "B64 ctx2048 page16": (64, 2048, 16),
    "B64 ctx2048 page1": (64, 2048, 1),
    "B8 ctx16384 page16": (8, 16384, 16),
    "B1 ctx32768 page16": (1, 32768, 16),
    "B256 ctx1024 page16": (256, 1024, 16),
}
EXTEND = {  # name: (q_lens, kv_lens), page 16
    "prefill 4x2048": ([2048] * 4, [2048] * 4),
    "prefill 1x8192": ([8192], [8192]),
    "chunk 8x512 after 3584": ([512] * 8, [4096] * 8),
    "mixed 32 decode@2048 + 2x1024 after 1024": ([1] * 32 + [1024] * 2, [2048] * 32 + [2048] * 2),
}
DECODE_SWEEP = [ta.DecodeConfig(n, w, s) for n, w, s in ((32, 4, 2), (64, 4, 2), (64, 4, 3),
                                                           (64, 8, 2), (128, 4, 2), (128, 8, 2),
                                                           (128, 8, 3))]
EXTEND_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                (128, 32, 4, 2), (64, 32, 4, 3)]


def make_batch(q_lens: list[int], kv_lens: list[int], page_size: int, seed: int = 0,
               storage: torch.dtype | None = None):
    """storage: a float8 dtype for a float8 KV cache (scales 1.0), else the model's."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 1
    cache = KVCache(1, num_pages * page_size, KV_HEADS, DIM, DTYPE, torch.device("cuda"),
                    page_size, storage_dtype=storage)
    for pool in (cache.k, cache.v):
        pool.copy_(torch.randn(pool.shape, device="cuda", dtype=DTYPE, generator=gen))
    perm = torch.randperm(num_pages, device="cuda", generator=gen)
    width = max(kv_lens)
    table = torch.zeros(len(kv_lens), -(-width // page_size) * page_size, dtype=torch.int64,
                        device="cuda")
    used = 0
    for i, n in enumerate(kv_lens):
        pages = perm[used:used + -(-n // page_size)]
        used += pages.numel()
        slots = (pages[:, None] * page_size + torch.arange(page_size, device="cuda")).flatten()
        table[i, : slots.numel()] = slots
    table = table[:, :width].contiguous()
    out_slots = torch.cat([table[i, kv - q:kv] for i, (q, kv) in enumerate(zip(q_lens,
                                                                               kv_lens))])
    total = sum(q_lens)
    q = torch.randn(total, HEADS, DIM, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(total, KV_HEADS, DIM, device="cuda", dtype=DTYPE, generator=gen)
    ids = torch.zeros(total, dtype=torch.int64, device="cuda")
    return ForwardBatch(ids, ids, q_lens, kv_lens, out_slots, table, cache), q, k, v


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def triton_attention_only(backend: TritonAttention, batch: ForwardBatch, q: torch.Tensor,
                          out: torch.Tensor):
    """A closure running the planned backend's attention kernels alone (no K/V store)."""
    k_cache, v_cache = batch.kv_cache.layer(0)

    def run():
        ta.decode_attention(q, k_cache, v_cache, out, batch.slot_table, backend.kv_lens,
                            backend.decode_rows, backend.decode_q_rows, backend.scale,
                            backend.num_splits, backend.decode_cfg)
        ta.extend_attention(q, k_cache, v_cache, out, batch.slot_table, backend.q_starts,
                            backend.q_lens, backend.kv_lens, backend.block_rows,
                            backend.block_m0, backend.scale, backend.extend_cfg)
    return run


def planned(batch: ForwardBatch, **options) -> TritonAttention:
    backend = TritonAttention(DIM ** -0.5, **options)
    backend.plan(batch)
    return backend


def flashinfer_runner(batch, q, k, v, tensor_cores: bool = False):
    """(first-call seconds, a closure running FlashInfer's attention alone, its output), or
    None without FlashInfer."""
    try:
        from radixlm.runtime.attention.flashinfer_backend import FlashInferAttention
        backend = FlashInferAttention(DIM ** -0.5, decode_tensor_cores=tensor_cores)
    except ImportError:
        return None
    backend.plan(batch)
    start = time.perf_counter()
    out = backend.forward(q, k, v, 0, batch)  # first call JIT-compiles the kernels
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    wrapper = backend._plan_wrapper(HEADS, KV_HEADS, DIM, q.device, FULL_ATTENTION)
    pages = batch.kv_cache.layer_pages(0)
    return first, (lambda: wrapper.run(q, pages)), out


def bench_decode(name, spec, bandwidth, rows):
    batch_size, ctx, page_size = spec
    batch, q, k, v = make_batch([1] * batch_size, [ctx] * batch_size, page_size)
    kv_bytes = batch_size * ctx * KV_HEADS * DIM * 2 * q.element_size()
    floor = kv_bytes / bandwidth * 1e3
    backend = planned(batch)
    ref = backend.forward(q, k, v, 0, batch)  # stores K/V; the output is our reference
    out = torch.empty_like(q)
    row = {"case": name, "kind": "decode", "kv_bytes": kv_bytes, "floor_ms": floor,
           "triton_splits": backend.num_splits}
    row["triton_ms"] = ms(triton_attention_only(backend, batch, q, out))
    k_cache, v_cache = batch.kv_cache.layer(0)
    row["store_kv_ms"] = ms(lambda: ta.store_kv(k, v, batch.out_slots, k_cache, v_cache))
    for label, cores in (("flashinfer", False), ("flashinfer_tc", True)):
        runner = flashinfer_runner(batch, q, k, v, cores)
        if runner is not None:
            first, fn, fi_out = runner
            row[f"{label}_first_call_s"] = round(first, 2)
            row[f"{label}_ms"] = ms(fn)
            row[f"{label}_rel_err_vs_triton"] = rel(fi_out, ref)
    if page_size == 16 and batch_size >= 8:
        torch_backend = TorchNativeAttention(DIM ** -0.5)
        torch_backend.plan(batch)
        row["torch_native_ms"] = ms(lambda: torch_backend.forward(q, k, v, 0, batch))
        row["torch_rel_err_vs_triton"] = rel(torch_backend.forward(q, k, v, 0, batch), ref)
    rows.append(row)


def time_decode_configs(batch, q, ref, configs, splits_list, timer) -> list[dict]:
    """The Triton decode kernels under each DecodeConfig and split count: timer(fn) in ms, and
    the output's relative error against ref; fastest first."""
    out = torch.empty_like(q)
    results = []
    for cfg in configs:
        for splits in splits_list:
            fn = triton_attention_only(planned(batch, num_splits=splits, decode_config=cfg),
                                       batch, q, out)
            fn()
            results.append({**dataclasses.asdict(cfg), "splits": splits, "ms": timer(fn),
                            "rel_err": rel(out, ref)})
    return sorted(results, key=lambda r: r["ms"])


def sweep_decode(spec, configs=DECODE_SWEEP, splits_list=(1, 2, 4, 8, 16, 32)) -> list[dict]:
    batch_size, ctx, page_size = spec
    batch, q, k, v = make_batch([1] * batch_size, [ctx] * batch_size, page_size)
    ref = planned(batch).forward(q, k, v, 0, batch)
    return time_decode_configs(batch, q, ref, configs, splits_list, ms)


# The decode steps of one_batch.py / offline_throughput.py, kernel by kernel: batch 1 at the
# Llama-3-8B run's ~1088-token context (latency-bound: a few microseconds a layer) and batch
# 256 at ~1536 (bandwidth-bound), the latter over bf16 and float8 caches. Timed as CUDA graph
# replays, as the engine runs them, so launch overhead is not counted.
# The configs are the front runners of wider sweeps (2026-12-04: tiles of 16-128 tokens, 2-8
# warps, 1-3 stages, 1-64 splits); the float8 cases also read V as float8 (not as int16 pairs)
# and widen to bfloat16 once each, and e4m3 by integer ops (fp8_v_cvt off), for scale;
# e4m3 also with q.k multiplied in float8 (fp8_qk), whose output differs by the query's rounding.
_DECODE = ta.DecodeConfig
_FP8_BASELINES = [_DECODE(128, 4, 3, fp8_v_pairs=False),
                  _DECODE(128, 4, 3, fp8_as_fp16=False, fp8_v_pairs=False)]
LATENCY = {  # name: (batch, context, storage dtype, configs, split counts)
    "B1 ctx1088 bf16": (1, 1088, None, [_DECODE(n, w, s) for n, w, s in (
        (32, 4, 1), (64, 4, 1), (64, 2, 2), (128, 4, 2), (128, 4, 3))], (16, 32)),
    "B1 ctx1088 fp8_e4m3": (1, 1088, torch.float8_e4m3fn, [_DECODE(n, w, s) for n, w, s in (
        (64, 4, 1), (64, 2, 2), (128, 4, 3))] + _FP8_BASELINES[:1]
        + [_DECODE(n, w, s, fp8_qk=True) for n, w, s in ((64, 4, 1), (128, 4, 3))], (16, 32)),
    "B256 ctx1536 bf16": (256, 1536, None, [_DECODE(n, w, s) for n, w, s in (
        (64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 4, 2))], (1,)),
    "B256 ctx1536 fp8_e4m3": (256, 1536, torch.float8_e4m3fn, [_DECODE(n, w, s) for n, w, s in (
        (128, 4, 3), (128, 4, 4), (64, 4, 3), (64, 4, 4), (256, 4, 3), (128, 8, 3))]
        + [_DECODE(n, 4, s, fp8_v_cvt=False) for n, s in ((128, 3), (64, 4))]
        + [_DECODE(n, w, s, fp8_qk=True) for n, w, s in (
            (128, 4, 3), (128, 4, 4), (64, 4, 3), (64, 4, 4), (256, 4, 3), (128, 8, 3))]
        + _FP8_BASELINES, (1,)),
    "B256 ctx1536 fp8_e5m2": (256, 1536, torch.float8_e5m2, [_DECODE(128, 4, 3)]
                              + _FP8_BASELINES[:1], (1,)),
}


def sweep_latency(spec, bandwidth: float) -> dict:
    batch_size, ctx, storage, configs, splits_list = spec
    batch, q, k, v = make_batch([1] * batch_size, [ctx] * batch_size, 16, storage=storage)
    kv_bytes = 2 * batch_size * ctx * KV_HEADS * DIM * batch.kv_cache.k.element_size()
    ref = planned(batch).forward(q, k, v, 0, batch, kv_stored=True)
    results = time_decode_configs(
        batch, q, ref, configs, splits_list,
        lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median"))
    for r in results:
        r["tb_s"] = kv_bytes / r["ms"] / 1e9
    record = {"kv_bytes": kv_bytes, "floor_us": kv_bytes / bandwidth * 1e6,
              "default_splits": planned(batch).num_splits, "triton": results}
    try:  # the Triton sweep is kept if FlashInfer fails
        runner = flashinfer_runner(batch, q, k, v)
    except Exception as exc:
        record["flashinfer_error"], runner = repr(exc), None
    if runner is not None:
        _, fn, fi_out = runner
        record["flashinfer_us"] = 1e3 * do_bench_cudagraph(fn, rep=50, return_mode="median")
        record["flashinfer_rel_err_vs_triton"] = rel(fi_out, ref)
    return record


def extend_flops(q_lens, kv_lens) -> float:
    pairs = sum(q * (kv - q) + q * (q + 1) / 2 for q, kv in zip(q_lens, kv_lens))
    return 4 * HEADS * DIM * pairs


def bench_extend(name, spec, rows):
    q_lens, kv_lens = spec
    batch, q, k, v = make_batch(q_lens, kv_lens, 16)
    flops = extend_flops(q_lens, kv_lens)
    backend = planned(batch)
    ref = backend.forward(q, k, v, 0, batch)
    out = torch.empty_like(q)
    row = {"case": name, "kind": "extend", "tflop": flops / 1e12}
    row["triton_ms"] = ms(triton_attention_only(backend, batch, q, out))
    row["triton_tflops"] = flops / row["triton_ms"] / 1e9
    runner = flashinfer_runner(batch, q, k, v)
    if runner is not None:
        first, fn, fi_out = runner
        row["flashinfer_first_call_s"] = round(first, 2)
        row["flashinfer_ms"] = ms(fn)
        row["flashinfer_tflops"] = flops / row["flashinfer_ms"] / 1e9
        row["flashinfer_rel_err_vs_triton"] = rel(fi_out, ref)
    rows.append(row)


def sweep_extend(spec) -> list[dict]:
    q_lens, kv_lens = spec
    batch, q, k, v = make_batch(q_lens, kv_lens, 16)
    flops = extend_flops(q_lens, kv_lens)
    ref = planned(batch).forward(q, k, v, 0, batch)
    out = torch.empty_like(q)
    results = []
    for block_m, block_n, warps, stages in EXTEND_SWEEP:
        cfg = ta.ExtendConfig(block_m, block_n, warps, stages)
        fn = triton_attention_only(planned(batch, extend_config=cfg), batch, q, out)
        fn()
        t = ms(fn)
        results.append({"block_m": block_m, "block_n": block_n, "warps": warps,
                        "stages": stages, "ms": t, "tflops": flops / t / 1e9,
                        "rel_err": rel(out, ref)})
    return sorted(results, key=lambda r: r["ms"])


def bench_fused(rows):
    import torch.nn.functional as F

    from radixlm.runtime.models.layers.rotary import apply_rotary

    tokens, hidden, inter = 4096, 4096, 14336
    x, r = (torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE)
    qk = torch.randn(tokens, HEADS + KV_HEADS, DIM, device="cuda", dtype=DTYPE)
    cos, sin = (torch.randn(tokens, DIM // 2, device="cuda") for _ in range(2))
    def torch_add_norm():
        summed = x + r
        return w * F.rms_norm(summed, (hidden,), eps=1e-6), summed

    def torch_silu_mul():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def torch_rotary():
        return apply_rotary(qk, cos.unsqueeze(1).to(DTYPE), sin.unsqueeze(1).to(DTYPE))

    cases = {  # name: (ours, torch, bytes moved once)
        "add + rms_norm [4096, 4096]": (lambda: fused.rms_norm(x, w, 1e-6, residual=r),
                                        torch_add_norm, 4 * tokens * hidden * 2),
        "silu_and_mul [4096, 2x14336]": (lambda: fused.silu_and_mul(gate_up), torch_silu_mul,
                                         3 * tokens * inter * 2),
        "rotary [4096, 40, 128]": (lambda: fused.rotary_embedding(qk, cos, sin), torch_rotary,
                                   2 * qk.numel() * 2),
    }
    for name, (ours, theirs, nbytes) in cases.items():
        a, b = ours(), theirs()
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        t_ours, t_torch = ms(ours), ms(theirs)
        differ = a != b
        rows.append({"case": name, "kind": "fused", "triton_ms": t_ours, "torch_ms": t_torch,
                     "triton_tb_s": nbytes / t_ours / 1e9, "bit_exact": torch.equal(a, b),
                     "mismatch_fraction": differ.float().mean().item(),
                     "max_abs_diff": (a.float() - b.float()).abs().max().item(),
                     "max_rel_diff": ((a.float() - b.float()).abs()
                                      / b.float().abs().clamp_min(1e-6))[differ].max().item()
                     if differ.any() else 0.0})


def _cell(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "-"


def print_table(rows: list[dict]) -> None:
    print(f"{'case':44} {'triton':>8} {'flashinfer':>10} {'fi tc':>8} {'torch':>8} "
          f"{'floor':>7}  (ms)")
    for r in rows:
        if r["kind"] == "decode":
            note = (f"splits {r['triton_splits']}, {r['kv_bytes'] / r['triton_ms'] / 1e9:.2f} "
                    f"TB/s, store {r['store_kv_ms'] * 1e3:.0f} us")
        elif r["kind"] == "extend":
            note = f"{r['triton_tflops']:.0f} TFLOP/s"
            if "flashinfer_tflops" in r:
                note += f" (flashinfer {r['flashinfer_tflops']:.0f})"
        else:
            note = f"{r['triton_tb_s']:.2f} TB/s, bit-exact {r['bit_exact']}"
        torch_key = "torch_native_ms" if r["kind"] != "fused" else "torch_ms"
        print(f"{r['case']:44} {_cell(r, 'triton_ms'):>8} {_cell(r, 'flashinfer_ms'):>10} "
              f"{_cell(r, 'flashinfer_tc_ms'):>8} {_cell(r, torch_key):>8} "
              f"{_cell(r, 'floor_ms'):>7}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bandwidth", type=float, default=4.1e12, help="bytes/s ceiling")
    parser.add_argument("--sweep", choices=("full", "splits", "latency", "none"),
                        default="full",
                        help="full: tile configs x split counts; splits: split counts of the "
                             "default decode config on the long-context cases; latency: only "
                             "the decode steps of the 8B benchmarks (batch 1 and 256, bf16 and "
                             "float8 caches), timed as graph replays")
    parser.add_argument("--cases", default="",
                        help="with --sweep latency: only the steps whose name contains this "
                             "(e.g. 'fp8_e4m3')")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    try:
        import flashinfer
        fi_version = flashinfer.__version__
    except ImportError:
        fi_version = None
    gpu = torch.cuda.get_device_name()
    rows, sweeps, errors = [], {}, {}
    result = {
        "benchmark": "attention_kernels",
        "date": datetime.date.today().isoformat(),
        "machine": {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                    "flashinfer": fi_version, "cuda": torch.version.cuda},
        "config": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": str(DTYPE),
                   "bandwidth_ceiling_bytes_s": args.bandwidth},
        "results": rows, "sweeps": sweeps, "errors": errors,
    }
    out = args.out or results_dir() / (
        f"attention_kernels_{gpu.split()[-1].lower()}_{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Each step is recorded as it finishes (and a failure noted, not fatal): a run that is
    # cut short still leaves everything measured so far.
    if args.sweep == "latency":
        steps = [(f"latency {name}", lambda n=name: sweeps.__setitem__(
            n, sweep_latency(LATENCY[n], args.bandwidth))) for name in LATENCY
            if args.cases in name]
    else:
        steps = [(name, lambda n=name, s=spec: bench_decode(n, s, args.bandwidth, rows))
                 for name, spec in DECODE.items()]
        steps += [(name, lambda n=name, s=spec: bench_extend(n, s, rows))
                  for name, spec in EXTEND.items()]
        steps.append(("fused", lambda: bench_fused(rows)))
    if args.sweep == "full":
        steps += [(f"sweep {name}", lambda n=name: sweeps.__setitem__(n, sweep_decode(DECODE[n])))
                  for name in ("B64 ctx2048 page16", "B8 ctx16384 page16")]
        steps += [(f"sweep {name}", lambda n=name: sweeps.__setitem__(n, sweep_extend(EXTEND[n])))
                  for name in ("prefill 4x2048", "chunk 8x512 after 3584")]
    elif args.sweep == "splits":
        cfg = [ta.DecodeConfig()]
        for name in ("B64 ctx2048 page16", "B8 ctx16384 page16", "B1 ctx32768 page16"):
            steps.append((f"sweep {name}", lambda n=name: sweeps.__setitem__(
                n, sweep_decode(DECODE[n], cfg, (1, 2, 4, 8, 9, 16, 32, 64, 128)))))
    for name, step in steps:
        start = time.perf_counter()
        try:
            step()
        except Exception as exc:
            errors[name] = repr(exc)
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
        out.write_text(json.dumps(result, indent=2))
    for name, best in sweeps.items():
        if isinstance(best, dict):  # a latency sweep
            print(f"{name}: floor {best['floor_us']:.1f} us, default splits "
                  f"{best['default_splits']}, flashinfer {best.get('flashinfer_us', 0):.1f} us")
            default = dataclasses.asdict(ta.DecodeConfig())
            for r in best["triton"][:5] + [r for r in best["triton"]
                                           if all(r[k] == v for k, v in default.items())]:
                print(f"   {r}")
        else:
            print(f"sweep {name}: best {best[:3]}")
    if errors:
        print("errors:", json.dumps(errors, indent=2))
    print_table(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
