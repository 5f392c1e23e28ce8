"""The decoder's linears in FP8 W8A8 against bf16 cuBLAS, at decode and prefill row counts.

For each linear of a model shape (Llama-3-8B by default: qkv, o, gate_up, down) and each row
count M, on one GPU, timed as CUDA graph replays (as the engine runs them, so host launch
costs do not count):

- bf16: `F.linear` (cuBLAS), the baseline;
- quantize: our per-token e4m3 quantization of the activations (radixlm.kernels.fp8);
- rowwise: `torch._scaled_mm` with a scale per token and per output channel, what the model
  runs (radixlm.runtime.models.quantization.fp8);
- tensorwise: `torch._scaled_mm` with one scale per operand, for scale (coarser activations);
- fp8_linear: quantize + rowwise as the model calls them.

Each is reported in microseconds and TFLOP/s, beside the card's measured bf16 GEMM rate and
the fp8 rate it would take to halve that. The rowwise result is checked against the bf16
product of the dequantized operands.

    python benchmarks/w8a8_gemm.py [--rows 256 512 2048 16384] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from gemv import linear_shapes

from radixlm.kernels.fp8 import per_token_fp8
from radixlm.runtime.models.quantization.fp8 import fp8_linear, quantize_fp8_rows

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir


def graph_us(fn, calls: int = 10) -> float:
    """Median microseconds of one call, from a graph of `calls` back-to-back calls."""
    return 1e3 * median_replay_ms(capture(fn, count=calls), 20) / calls


def gemm_rate() -> float:
    """bf16 FLOP/s of an 8192^3 cuBLAS product on this card: the ceiling the rows compare to."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (graph_us(lambda: a @ b, 4) / 1e6)


def time_linear(m: int, n: int, k: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    w8, w_scale = quantize_fp8_rows(w)
    w_scale = w_scale.view(-1).contiguous()
    x8, x_scale = per_token_fp8(x)
    one = torch.ones((), device="cuda")
    flop = 2 * m * n * k
    row = {"m": m, "n": n, "k": k, "gflop": flop / 1e9}
    row["bf16_us"] = graph_us(lambda: F.linear(x, w))
    row["quantize_us"] = graph_us(lambda: per_token_fp8(x))
    row["rowwise_us"] = graph_us(lambda: torch._scaled_mm(
        x8, w8.t(), scale_a=x_scale, scale_b=w_scale.view(1, n), out_dtype=torch.bfloat16))
    row["tensorwise_us"] = graph_us(lambda: torch._scaled_mm(
        x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    row["fp8_linear_us"] = graph_us(lambda: fp8_linear(x, w8, w_scale))
    for name in ("bf16", "rowwise", "tensorwise", "fp8_linear"):
        row[f"{name}_tflops"] = flop / row[f"{name}_us"] / 1e6
    row["speedup_fp8_linear_vs_bf16"] = row["bf16_us"] / row["fp8_linear_us"]
    ref = (x8.float() * x_scale) @ (w8.float() * w_scale.view(n, 1)).t()
    got = fp8_linear(x, w8, w_scale).float()
    row["rel_err_vs_dequantized"] = ((got - ref).norm() / ref.norm()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512, 2048, 16384])
    parser.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    shapes = linear_shapes(args.model)
    rate = gemm_rate()
    rows = []
    print(f"bf16 8192^3 GEMM: {rate / 1e12:.0f} TFLOP/s on {torch.cuda.get_device_name()}")
    print(f"{'M':>6} {'linear':>8} {'N x K':>12} {'bf16 us':>8} {'quant us':>8} "
          f"{'rowwise us':>10} {'tensor us':>9} {'fp8_linear':>10} {'speedup':>8} "
          f"{'bf16 TF/s':>9} {'fp8 TF/s':>8}")
    for m in args.rows:
        for name in args.shapes:
            n, k = shapes[name]
            row = {"linear": name, **time_linear(m, n, k)}
            rows.append(row)
            print(f"{m:>6} {name:>8} {f'{n}x{k}':>12} {row['bf16_us']:>8.1f} "
                  f"{row['quantize_us']:>8.1f} {row['rowwise_us']:>10.1f} "
                  f"{row['tensorwise_us']:>9.1f} {row['fp8_linear_us']:>10.1f} "
                  f"{row['speedup_fp8_linear_vs_bf16']:>7.2f}x {row['bf16_tflops']:>9.0f} "
                  f"{row['fp8_linear_tflops']:>8.0f}")
    record = {
        "benchmark": "w8a8_gemm", "date": datetime.date.today().isoformat(),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "host": platform.machine()},
        "config": {"model": args.model, "bf16_gemm_tflops_8192": rate / 1e12},
        "rows": rows, "command": "python benchmarks/w8a8_gemm.py",
    }
    out = Path(args.out) if args.out else results_dir() / "w8a8_gemm.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
