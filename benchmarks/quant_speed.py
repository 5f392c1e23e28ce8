"""Quantized inference speed on one GPU, against each format's memory-bandwidth floor.

A Llama-3-8B-shaped model with random weights (`load_format="dummy"`) in bf16, fp8 (W8A8),
int8 (weight-only) and int4 (the AWQ format: random bf16 weights RTN-packed; the kernel's speed
does not depend on the values). For each format:

- weight memory: every parameter's bytes, and the decoder linears' alone (the embeddings and
  the output head stay bf16 in every format);
- linears at batch 1: all 32 x 4 decoder linears replayed in one CUDA graph, against their
  bytes at the card's copy bandwidth (4.1 TB/s): the kernels alone;
- decode at batch 1: the median engine step (schedule, forward in a CUDA graph, sampling)
  while one request decodes, against the floor of every weight read once per step (all but
  the input embedding table) plus the KV it attends to;
- large-batch decode (fp8 and bf16 by default): output tokens/s with `--large-batch`
  requests decoding together.

    python benchmarks/quant_speed.py [--formats bf16 fp8 int8 int4] [--large-batch 256]
    python benchmarks/quant_speed.py --sweep      # time W4A16 kernel tilings at batch 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from radixlm.runtime import Engine
from radixlm.runtime.layers.linear import Linear

from gpu_timing import median_replay_ms

COPY_BANDWIDTH = 4.1e12  # bytes/s, device-to-device copy measured on the H200
QUANTIZATION = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "awq"}
# The decoder linears of the 8B shape as (N, K): qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    linear = sum(p.numel() * p.element_size() for m in model.modules()
                 if isinstance(m, Linear) for p in m.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    embed_bytes = embed.numel() * embed.element_size()
    # Read per decode step: all but the input embedding table (the tied head reads it).
    streamed = total - (embed_bytes if model.lm_head is not None else 0)
    return {"total": total, "linears": linear, "streamed_per_step": streamed}


def linears_ms(model: torch.nn.Module, batch: int, reps: int = 50) -> float:
    """Median ms of every decoder linear at this batch size, replayed in one CUDA graph."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features, device="cuda",
                                         dtype=torch.bfloat16) for m in linears}

    def run() -> None:
        for m in linears:
            m(inputs[m.in_features])

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(3):
            run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    torch.cuda.synchronize()
    return median_replay_ms(graph, reps)


def decode(engine: Engine, batch: int, input_len: int, output_len: int) -> dict:
    """Prefill `batch` random prompts, then time each decode step until all finish."""
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, engine.model_config.vocab_size, (batch, input_len),
                            generator=gen).tolist()
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    requests = engine._make_requests(prompts, params, None, None, False)

    def drive(core) -> dict:  # on the engine thread
        for request in requests:
            core.add_request(request)
        while any(r.num_output_tokens == 0 for r in requests):
            core.step()
        torch.cuda.synchronize()
        first = sum(r.num_output_tokens for r in requests)
        steps, start = [], time.perf_counter()
        while core.has_work:
            t0 = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        produced = sum(r.num_output_tokens for r in requests) - first
        return {"step_ms": 1e3 * statistics.median(steps), "tokens_per_s": produced / elapsed}

    return engine._call(drive)


def measure(fmt: str, args: argparse.Namespace) -> dict:
    big = args.large_batch if fmt in args.large_batch_formats else 0
    requests = max(big, 1)
    engine = Engine("llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
                    quantization=QUANTIZATION[fmt], max_running_requests=requests,
                    max_total_tokens=requests * (args.input_len + args.output_len) + 4096,
                    max_num_batched_tokens=16384, chunked_prefill_size=4096,
                    disable_radix_cache=True)
    model, cfg = engine.core.runner.model, engine.model_config
    sizes = weight_bytes(model)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    row: dict = {"format": fmt, "weight_gb": sizes["total"] / 1e9,
                 "linear_weight_gb": sizes["linears"] / 1e9}
    row["linears_b1_ms"] = linears_ms(model, 1)
    row["linears_b1_floor_ms"] = 1e3 * sizes["linears"] / COPY_BANDWIDTH
    decode(engine, 1, args.input_len, 8)  # warm-up: compile and capture
    one = decode(engine, 1, args.input_len, args.output_len)
    kv = (args.input_len + args.output_len / 2) * kv_per_token
    row["decode_b1_ms"] = one["step_ms"]
    row["decode_b1_floor_ms"] = 1e3 * (sizes["streamed_per_step"] + kv) / COPY_BANDWIDTH
    if big:
        many = decode(engine, big, args.input_len, args.output_len)
        row.update({"large_batch": big, "large_batch_step_ms": many["step_ms"],
                    "large_batch_tokens_per_s": many["tokens_per_s"]})
    engine.close()
    del engine, model
    torch.cuda.empty_cache()
    return row


def sweep_configs(bits: int) -> list[dict]:
    configs = []
    for block_n in ((64, 128, 256) if bits == 4 else (128, 256)):
        for warps, stages in ((4, 3), (4, 4), (8, 3)):
            for split in (4, 8, 16):
                configs.append(dict(KERNEL="gemv", BLOCK_N=block_n, BLOCK_W=16, MODE=2,
                                    SPLIT_K=split, num_warps=warps, num_stages=stages))
    for mode, block_w in ((0, 16), (0, 32), (1, 8)):
        for split in (8, 16):
            configs.append(dict(KERNEL="gemv", BLOCK_N=128, BLOCK_W=block_w, MODE=mode,
                                SPLIT_K=split, num_warps=4, num_stages=3))
    return configs


def sweep(write_tuned: str | None) -> list[dict]:
    """Time W4A16 GEMV tilings at batch 1 on the 8B shapes: 4-bit at group 128 (AWQ/GPTQ)
    and 8-bit per channel (INT8). With write_tuned, the best per shape becomes a module that
    pick_config reads (kernels/w4a16_tuned.py)."""
    import triton

    from radixlm.kernels.w4a16 import pick_config, w4a16_matmul

    def bench(fn) -> float:
        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=20)  # us

    card = torch.cuda.get_device_name()
    results, tuned = [], {}
    for bits in (4, 8):
        for n, k in SHAPES_8B:
            group = 128 if bits == 4 else k
            pack = 32 // bits
            qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // pack, n), device="cuda",
                                    dtype=torch.int32)
            scales = torch.rand(k // group, n, device="cuda", dtype=torch.bfloat16) * 0.01
            zeros = torch.randint(0, 2 ** bits, (k // group, n), device="cuda",
                                  dtype=torch.uint8)
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            floor_us = 1e6 * (qweight.nbytes + scales.nbytes + zeros.nbytes) / COPY_BANDWIDTH
            default = pick_config(1, n, k, group, bits, x.device)
            timings = []
            for cfg in sweep_configs(bits):
                try:
                    us = bench(lambda: w4a16_matmul(x, qweight, scales, zeros, group, bits,
                                                    config=cfg))
                except Exception as exc:  # e.g. out of shared memory
                    print(f"skip {cfg}: {type(exc).__name__}")
                    continue
                timings.append((us, cfg))
            timings.sort(key=lambda t: t[0])
            default_us = bench(lambda: w4a16_matmul(x, qweight, scales, zeros, group, bits))
            tuned[f"{bits}:{group}:{n}:{k}"] = timings[0][1]
            results.append({"bits": bits, "n": n, "k": k, "floor_us": floor_us,
                            "default": default, "default_us": default_us,
                            "best": timings[:6]})
            print(f"{bits}-bit N={n} K={k}: floor {floor_us:.1f} us, default "
                  f"{default_us:.1f} us, best {timings[0][0]:.1f} us {timings[0][1]}",
                  flush=True)
            for us, cfg in timings[1:4]:
                print(f"    {us:.1f} us {cfg}")
    if write_tuned:
        Path(write_tuned).write_text(
            '"""Batch-1 W4A16 GEMV configurations measured best, by GPU and "bits:group:N:K"'
            '\n(written by benchmarks/quant_speed.py --sweep --write-tuned)."""\n\n'
            f"TUNED = {json.dumps({card: tuned}, indent=4)}\n")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(QUANTIZATION),
                        choices=list(QUANTIZATION))
    parser.add_argument("--large-batch", type=int, default=256)
    parser.add_argument("--large-batch-formats", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--sweep", action="store_true", help="only the W4A16 tiling sweep")
    parser.add_argument("--write-tuned", default=None,
                        help="with --sweep: write the best tilings as this Python module")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    card = torch.cuda.get_device_name()
    record = {"benchmark": "quant_speed", "date": datetime.date.today().isoformat(),
              "machine": {"gpu": card, "torch": torch.__version__},
              "config": {"model": "llama-3-8b", "input_len": args.input_len,
                         "output_len": args.output_len, "copy_bandwidth": COPY_BANDWIDTH}}
    if args.sweep:
        record["sweep"] = sweep(args.write_tuned)
    else:
        rows = []
        for fmt in args.formats:
            rows.append(measure(fmt, args))
            row = rows[-1]
            print(f"{fmt:>5}: weights {row['weight_gb']:.2f} GB (linears "
                  f"{row['linear_weight_gb']:.2f}), linears b1 {row['linears_b1_ms']:.3f} ms "
                  f"(floor {row['linears_b1_floor_ms']:.3f}), decode b1 "
                  f"{row['decode_b1_ms']:.2f} ms/token (floor {row['decode_b1_floor_ms']:.2f})"
                  + (f", batch {row['large_batch']}: {row['large_batch_tokens_per_s']:.0f} "
                     "tokens/s" if "large_batch" in row else ""), flush=True)
        record["rows"] = rows
    out = Path(args.out or Path(__file__).parent / "results" /
               f"quant_speed_h200_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
