"""The batch-invariant kernels of deterministic inference against the default ones, alone, at
Llama-3-8B's shapes (bf16, CUDA-graph timed):

- each decoder linear and the output head at 1 to 16384 rows: the default product (the GEMV
  for o / down up to 16 rows, else cuBLAS) against kernels/invariant_matmul.py;
- decode attention at batch 1 and 256 and a prefill of 16 x 1024 tokens: the default Triton
  kernels against kernels/invariant_attention.py.

`--sweep` instead times the invariant matmul's candidate tilings (rows per program, warps,
pipeline stages, one loop or a loop per segment, two segment policies, and tiles loaded by
the copy engine (TMA), one program per tile or a few per SM walking them) at each row count
(`--rows`) against cuBLAS, and checks that every tiling gives the same bits as the shipped
one's (InvariantConfig.tilings was chosen from this table). `--segments` times each count of K
segments (each its own invariant sum) with the decode tilings' pipeline depths at 1-64 rows
and the shipped tilings at more rows, checking each for one set of bits at every row count
(the segment policy, InvariantConfig's, was chosen from this table).

    python benchmarks/invariant_kernels.py [--sweep [--rows 1,64,256,2048] |
        --segments [--shipped-segments]] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from radixlm.kernels import invariant_attention as ia
from radixlm.kernels import invariant_matmul as invariant_matmul_module
from radixlm.kernels import triton_attention as ta
from radixlm.kernels.gemv import NARROW_MAX_N, gemv
from radixlm.kernels.invariant_matmul import InvariantConfig, Tiling, invariant_matmul, segments_for

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir

LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336), "head": (128256, 4096)}
ROWS = [1, 8, 64, 256, 2048, 16384]


def time_us(fn: Callable[[], object], calls: int = 10) -> float:
    graph = capture(fn, calls)
    return 1e3 * median_replay_ms(graph, 20) / calls


def default_linear(x: torch.Tensor, w: torch.Tensor, head: bool) -> torch.Tensor:
    if not head and x.shape[0] <= 16 and w.shape[0] <= NARROW_MAX_N:
        return gemv(x, w)
    return F.linear(x, w)


def linears() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in LINEARS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        for m in ROWS:
            if name == "head" and m > 256:
                continue  # the head sees sampled rows only
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            calls = 10 if m <= 256 else 2
            out_dtype = torch.float32 if name == "head" else None
            base = time_us(lambda: default_linear(x, w, name == "head"), calls)
            ours = time_us(lambda: invariant_matmul(x, w, out_dtype), calls)
            rows.append({"linear": name, "n": n, "k": k, "rows": m, "default_us": base,
                         "invariant_us": ours, "ratio": ours / base,
                         "segments": segments_for(n, k, x.device)[1]})
            print(f"{name:>8} {m:>6} rows: default {base:9.1f} us, invariant {ours:9.1f} us "
                  f"({ours / base:.2f}x)")
    return rows


def time_variants(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None,
                  configs: dict[str, InvariantConfig], reference: torch.Tensor,
                  calls: int) -> dict[str, dict]:
    """Each configuration's time and whether it gives `reference`'s bits; one whose pipeline
    does not fit the shared memory is left out."""
    out = {}
    for label, cfg in configs.items():
        try:
            same = torch.equal(invariant_matmul(x, w, out_dtype, config=cfg), reference)
        except triton.runtime.errors.OutOfResources:
            continue
        except Exception as error:  # a variant this Triton cannot build: say so, go on
            print(f"    {label}: {type(error).__name__}: {str(error)[:200]}")
            continue
        us = time_us(lambda: invariant_matmul(x, w, out_dtype, config=cfg), calls)
        out[label] = {"us": us, "same_bits": same}
    return out


def same_bits(row: dict) -> str:
    """How many of a row's variants gave the reference's bits, as 'k/n'."""
    return f"{sum(v['same_bits'] for v in row['variants'].values())}/{len(row['variants'])}"


SWEEP_ROWS = [1, 8, 64, 128, 256, 512, 2048, 16384]
ANY = 1 << 62


def sweep_variants(m: int) -> dict[str, InvariantConfig]:
    """The candidate configurations for m rows, by name (segment policy `seg<max>/<min>`)."""
    def config(tiling: Tiling, flat: bool = True,
               segs: tuple[int, int] = (16, 4)) -> InvariantConfig:
        return InvariantConfig(max_segs=segs[0], min_seg_blocks=segs[1],
                               tilings=((ANY, tiling),), flat_max_tiles=1 << 30 if flat else 0)

    out = {}
    if m <= 64:
        for segs in ((16, 4), (32, 2)):
            for stages in (2, 3, 4):
                out[f"split64w4s{stages} seg{segs[0]}/{segs[1]}"] = config(
                    Tiling(64, 4, stages, split=True), segs=segs)
        for stages in (4, 5, 6):
            out[f"tma split64w4s{stages}"] = config(Tiling(64, 4, stages, split=True, tma=True))
        out["tile64w4s4 flat"] = config(Tiling(64, 4, 4))
        return out
    for block_m, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 8, 4)):
        out[f"tile{block_m}w{warps}s{stages} flat"] = config(Tiling(block_m, warps, stages))
    out["tile64w4s4 nest"] = config(Tiling(64, 4, 4), flat=False)
    # The copy engine's loads (TMA), one program per tile or a few per SM walking the tiles.
    for block_m, warps, stages, per_sm in ((64, 4, 3, 0), (64, 4, 4, 0), (64, 4, 5, 0),
                                          (128, 4, 4, 0), (128, 8, 3, 0), (128, 8, 4, 0),
                                          (64, 4, 4, 2), (64, 4, 4, 1), (128, 8, 4, 1),
                                          (128, 8, 3, 1)):
        label = f"tma tile{block_m}w{warps}s{stages}" + (f" p{per_sm}" if per_sm else "")
        out[label] = config(Tiling(block_m, warps, stages, tma=True, persistent=per_sm))
    return out


def sweep(row_counts: list[int]) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in LINEARS.items():
        counts = [m for m in row_counts if name != "head" or m <= 256]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        x_all = torch.randn(max(counts), k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out_dtype = torch.float32 if name == "head" else None
        shipped = invariant_matmul(x_all, w, out_dtype)  # every row through the defaults
        for m in counts:
            x = x_all[:m].clone()
            calls = 10 if m <= 512 else 2
            row = {"linear": name, "rows": m,
                   "cublas_us": time_us(lambda: default_linear(x, w, name == "head"), calls),
                   "shipped_us": time_us(lambda: invariant_matmul(x, w, out_dtype), calls),
                   "variants": time_variants(x, w, out_dtype, sweep_variants(m), shipped[:m],
                                             calls)}
            best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
            print(f"{name:>8} {m:>6} rows: cuBLAS {row['cublas_us']:8.1f} us, shipped "
                  f"{row['shipped_us'] / row['cublas_us']:.2f}x, best {best[0]} "
                  f"{best[1]['us'] / row['cublas_us']:.2f}x; same bits: "
                  f"{same_bits(row)}", flush=True)
            rows.append(row)
    return rows


SEGMENT_ROWS = [1, 8, 64, 256, 4096]


def forced(segs: int, tiling: Tiling) -> InvariantConfig:
    """A configuration with `segs` segments of K (fewer where K has fewer tiles; with the
    SM count lifted, see sweep_segments) and one tiling for every row count."""
    return InvariantConfig(max_segs=segs, min_seg_blocks=1, tilings=((ANY, tiling),))


def sweep_segments(shipped_only: bool = False) -> list[dict]:
    """Segment counts (a change of the numerics: each count is its own invariant sum) against
    the split tilings' pipeline depth at 1-64 rows, and the shipped tilings at more rows,
    each also with two K tiles a loop step (u2); every variant of a count is checked for the
    same bits as that count's 128-row tiling over all the rows. `shipped_only`: only the
    count the shipped policy picks for each linear."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.device("cuda")
    shipped = {name: segments_for(n, k, device)[1] for name, (n, k) in LINEARS.items()}
    sms = invariant_matmul_module.num_sms
    # Segment counts beyond the shipped policy's (one row's programs within one per SM):
    # with the SM count lifted, max_segs alone sets the count.
    invariant_matmul_module.num_sms = lambda device: 1 << 30
    try:
        for name, (n, k) in LINEARS.items():
            counts = (shipped[name],) if shipped_only else (1, 2, 4, 8, 16)
            rows += _sweep_segments_of(name, n, k, gen, counts)
    finally:
        invariant_matmul_module.num_sms = sms
    return rows


def _sweep_segments_of(name: str, n: int, k: int, gen: torch.Generator,
                       segment_counts: tuple[int, ...]) -> list[dict]:
    rows = []
    counts = [m for m in SEGMENT_ROWS if name != "head" or m <= 256]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    x_all = torch.randn(max(counts), k, device="cuda", dtype=torch.bfloat16, generator=gen)
    out_dtype = torch.float32 if name == "head" else None
    seen = set()
    for segs in segment_counts:
        actual = segments_for(n, k, x_all.device, forced(segs, Tiling(128, 8, 4)))
        if actual in seen or (name == "head" and segs > 2):
            continue
        seen.add(actual)
        reference = invariant_matmul(x_all, w, out_dtype,
                                     config=forced(segs, Tiling(128, 8, 4)))
        for m in counts:
            x = x_all[:m].clone()
            calls = 10 if m <= 512 else 2
            if m <= 64:
                variants = {f"split s{st}": forced(segs, Tiling(64, 4, st, split=True))
                            for st in (3, 4, 5, 6)}
                variants |= {f"split s{st} u2": forced(segs, Tiling(64, 4, st, True, 2))
                             for st in (2, 3, 4)}
            else:
                shipped = InvariantConfig().tiling(m)
                variants = {"shipped tiling": forced(segs, shipped)}
                variants |= {f"shipped tiling s{st} u2": forced(segs, replace(
                    shipped, num_stages=st, unroll=2)) for st in (3, 4)}
            row = {"linear": name, "rows": m, "segments": actual[1], "seg_len": actual[0],
                   "cublas_us": time_us(lambda: default_linear(x, w, name == "head"), calls),
                   "variants": time_variants(x, w, out_dtype, variants, reference[:m], calls)}
            best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
            print(f"{name:>8} {m:>6} rows {actual[1]:>3} segs: cuBLAS {row['cublas_us']:8.1f}"
                  f" us, best {best[0]} {best[1]['us']:8.1f} us "
                  f"({best[1]['us'] / row['cublas_us']:.2f}x); same bits "
                  f"{same_bits(row)}", flush=True)
            rows.append(row)
    return rows


def attention() -> list[dict]:
    heads, kv_heads, dim = 32, 8, 128
    results = []
    for kind, batch, ctx in (("decode", 1, 1088), ("decode", 64, 1536),
                             ("decode", 256, 1536), ("prefill", 16, 1024)):
        slots = batch * ctx
        k_cache = torch.randn(slots, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(slots, device="cuda").view(batch, ctx)
        kv_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
        rows = torch.arange(batch, device="cuda")
        scale = dim ** -0.5
        if kind == "decode":
            q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            splits = ta.choose_num_splits(batch, kv_heads, ctx, sms)
            workers = ia.decode_workers(batch, kv_heads, ctx, sms)

            def base() -> None:
                ta.decode_attention(q, k_cache, v_cache, out, table, kv_lens, rows, rows,
                                    scale, splits)

            def ours() -> None:
                ia.invariant_decode(q, k_cache, v_cache, out, table, kv_lens, rows, rows,
                                    scale, workers, -(-ctx // ia.SPLIT))
        else:
            q = torch.randn(slots, heads, dim, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            q_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
            q_starts = rows * ctx
            plans = {}
            for label, block in (("default", ta.extend_config(q.dtype, dim).block_m),
                                 ("invariant", ia.BLOCK_TOKENS)):
                b_rows, b_m0 = ta.extend_blocks([ctx] * batch, list(range(batch)), block)
                plans[label] = (torch.tensor(b_rows, device="cuda"),
                                torch.tensor(b_m0, device="cuda"))

            def base() -> None:
                ta.extend_attention(q, k_cache, v_cache, out, table, q_starts, q_lens, kv_lens,
                                    *plans["default"], scale)

            def ours() -> None:
                ia.invariant_extend(q, k_cache, v_cache, out, table, q_starts, q_lens,
                                    kv_lens, *plans["invariant"], scale)
        a, b = time_us(base, 5), time_us(ours, 5)
        results.append({"kind": kind, "batch": batch, "context": ctx, "default_us": a,
                        "invariant_us": b, "ratio": b / a})
        print(f"{kind:>8} batch {batch:>3} ctx {ctx}: default {a:9.1f} us, invariant "
              f"{b:9.1f} us ({b / a:.2f}x)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true",
                        help="time the matmul's candidate tilings instead (see the docstring)")
    parser.add_argument("--segments", action="store_true",
                        help="time segment counts against the decode tilings instead (see "
                             "sweep_segments)")
    parser.add_argument("--shipped-segments", action="store_true",
                        help="with --segments: only the count the segment policy picks")
    parser.add_argument("--rows", default=",".join(map(str, SWEEP_ROWS)),
                        help="with --sweep: the row counts, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    record = {"benchmark": "invariant_kernels", "date": datetime.date.today().isoformat(),
              "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}}
    if args.segments:
        record["segments"] = sweep_segments(args.shipped_segments)
    elif args.sweep:
        record["sweep"] = sweep([int(m) for m in args.rows.split(",")])
    else:
        record |= {"linears": linears(), "attention": attention()}
    kind = ("invariant_segments" if args.segments else "invariant_sweep" if args.sweep
            else "invariant_kernels")
    out = Path(args.out or results_dir() / f"{kind}_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
