"""The decoder's linear layers at decode batch sizes: cuBLAS against our float-weight GEMV
(radixlm.kernels.gemv) at several tilings, on one GPU, beside the bandwidth floor.

For each linear of a model shape (Llama-3-8B by default: qkv, o, gate_up, down, and the output
head) and each row count, the layer's weight is allocated once per decoder layer (32 distinct
copies, so that nothing is served from L2) and a CUDA graph runs the linear on every copy;
the median replay over the copies gives one call's time. Every tiling in the sweep runs, each
is checked against cuBLAS (relative error), and the table shows cuBLAS, the best tiling and
the floor: the weight's bytes at the card's copy bandwidth (4.1 TB/s read + write on the
H200, as docs/performance.md counts it; a copy timed in the run is recorded beside it).

    python benchmarks/gemv.py [--rows 1 2 4 8] [--shapes qkv o] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from radixlm.kernels.gemv import MAX_ROWS, NARROW, GemvConfig, gemv
from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir

COPY_BANDWIDTH = 4.1e12  # bytes/s, device-to-device copy measured on the H200 (docs/performance.md)


def linear_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the model's linears (one layer's), the output head included."""
    cfg = ARCHITECTURE_PRESETS[preset]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
            "o": (hidden, heads * head_dim), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (cfg["vocab_size"], hidden)}


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    graph = capture(lambda: dst.copy_(src), count=4)
    ms = median_replay_ms(graph, 10) / 4
    return 2 * src.numel() * 2 / (ms / 1e3)


def sweep_configs() -> list[GemvConfig]:
    """The tilings tried: the one the model uses first, then a grid around it."""
    configs = [NARROW] + [GemvConfig(block_n, block_k, 4, stages) for block_n, block_k, stages
                          in itertools.product((32, 64, 128), (64, 128, 256), (3, 5))]
    return list(dict.fromkeys(configs))


def time_calls(fn_for_layer, layers: int) -> float:
    """Median ms of one call, from a graph of one call per layer copy."""
    def all_layers():
        for i in range(layers):
            fn_for_layer(i)

    graph = capture(all_layers)
    return median_replay_ms(graph, 15) / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(ARCHITECTURE_PRESETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--shapes", nargs="+", default=None, help="subset of the linears")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if max(args.rows) > MAX_ROWS:
        parser.error(f"--rows: the GEMV takes at most {MAX_ROWS} rows")
    torch.manual_seed(0)
    measured_copy = copy_bandwidth()
    bandwidth = COPY_BANDWIDTH
    shapes = linear_shapes(args.model)
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes}
    results = []
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(args.layers if name != "lm_head" else 4)]
        floor_ms = n * k * 2 / bandwidth * 1e3
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            cublas = time_calls(lambda i: F.linear(x, weights[i]), len(weights))
            entry = {"linear": name, "n": n, "k": k, "rows": rows, "floor_ms": floor_ms,
                     "cublas_ms": cublas, "configs": []}
            for cfg in sweep_configs():
                try:
                    out = gemv(x, weights[0], cfg).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    ms = time_calls(lambda i, c=cfg: gemv(x, weights[i], c), len(weights))
                except Exception as exc:  # a tiling that does not compile or fit: recorded
                    entry["configs"].append({"config": cfg.__dict__, "error": repr(exc)[:200]})
                    continue
                entry["configs"].append({"config": cfg.__dict__, "ms": ms, "rel_err": err})
            timed = [c for c in entry["configs"] if "ms" in c and c["rel_err"] < 1e-2]
            best = min(timed, key=lambda c: c["ms"]) if timed else None
            entry["best"] = best
            results.append(entry)
            best_ms = best["ms"] if best else float("nan")
            print(f"{name:8s} N={n:6d} K={k:5d} rows={rows:2d}  floor {floor_ms * 1e3:7.1f} us"
                  f"  cuBLAS {cublas * 1e3:7.1f} us ({floor_ms / cublas:5.1%})"
                  f"  ours {best_ms * 1e3:7.1f} us ({floor_ms / best_ms:5.1%})"
                  f"  {best['config'] if best else '-'}", flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    print(f"\nfloor at {bandwidth / 1e12:.2f} TB/s; a copy in this run: "
          f"{measured_copy / 1e12:.2f} TB/s")
    print(f"{'rows':>4s} {'cuBLAS ms/layer':>16s} {'ours ms/layer':>14s} {'floor':>8s}")
    per_layer = [s for s in shapes if s != "lm_head"]
    for rows in args.rows:
        mine = [r for r in results if r["rows"] == rows and r["linear"] in per_layer]
        cub = sum(r["cublas_ms"] for r in mine)
        ours = sum(min(r["cublas_ms"], r["best"]["ms"]) if r["best"] else r["cublas_ms"]
                   for r in mine)
        floor = sum(r["floor_ms"] for r in mine)
        print(f"{rows:4d} {cub * 1e3:13.1f} us {ours * 1e3:11.1f} us {floor * 1e3:6.1f} us")
    record = {"benchmark": "gemv", "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name(), "host": platform.node(),
              "torch": torch.__version__, "copy_bandwidth": bandwidth,
              "measured_copy_bandwidth": measured_copy, "model": args.model,
              "results": results}
    out = args.out or results_dir() / f"gemv_{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
