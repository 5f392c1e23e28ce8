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
    python benchmarks/quant_speed.py --sweep [--write-tuned]   # small-batch kernel tilings

The sweep times, at batch 1, 2 and 4 on the 8B shapes, the one-launch INT4/INT8 GEMV over a
grid of tilings and K splits, the earlier two-launch GEMV's best tilings, the tensor-core
kernel (batch 2 and 4), bf16 `F.linear`, and the fp8 GEMV against `torch._scaled_mm`. Each
configuration is checked against the reference, then timed by replaying a CUDA graph of
calls that cycle through enough copies of the weights (256 MB) that none is read from L2.
Kernels are compiled first, in parallel processes (about 70 kernels).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from radixlm.runtime import Engine
from radixlm.runtime.models.layers.linear import Linear

from gpu_timing import median_replay_ms
from results_dir import results_dir

COPY_BANDWIDTH = 4.1e12  # bytes/s, device-to-device copy measured on the H200
QUANTIZATION = {"bf16": None, "fp8": "fp8", "int8": "int8", "int4": "awq"}
# The decoder linears of the 8B shape as (N, K): qkv, o, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TUNED_MODULE = Path(__file__).resolve().parent.parent / "kernels" / "w4a16_tuned.py"


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


# --sweep: the small-batch kernels at the 8B shapes. Tilings of the one-launch GEMV as
# (BLOCK_N, BLOCK_W, num_warps), each with every K split below; Triton compiles a tiling once
# per batch size (the split is a runtime value).
SWEEP_ROWS = (1, 2, 4)
GEMV_TILINGS = [(128, 16, 4), (256, 16, 4), (64, 16, 2), (256, 16, 8)]
SPLITS = (1, 2, 4, 8, 16)
# The earlier two-launch GEMV's best tilings on the H200 (BLOCK_N, BLOCK_W, MODE, num_stages).
OLD_GEMV_TILINGS = [(128, 16, 2, 4), (256, 16, 2, 4)]
FP8_TILINGS = [(16, 256, 4), (32, 256, 4), (8, 512, 4), (32, 512, 8)]  # BLOCK_N, BLOCK_K, warps
L2_FLUSH_BYTES = 256 << 20  # each timed graph cycles through enough weight copies to miss L2


@functools.lru_cache(maxsize=None)
def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def splits_for(tiles: int, blocks: int) -> list[int]:
    """The K splits worth timing: 1 to 32 programs per SM, no split without a K block."""
    return [s for s in SPLITS if sms() <= tiles * s <= 32 * sms() and s <= blocks]


def int_configs(bits: int, n: int, k: int, m: int) -> list[dict]:
    """Every configuration timed for one shape and batch size, as w4a16_matmul configs."""
    from radixlm.kernels.w4a16 import block_k_for

    configs = []
    for block_n, block_w, warps in GEMV_TILINGS:
        for split in splits_for(-(-n // block_n), -(-k // (block_w * 32 // bits))):
            configs.append(dict(KERNEL="gemv", BLOCK_N=block_n, BLOCK_W=block_w,
                                SPLIT_K=split, num_warps=warps))
    for block_n, block_w, mode, stages in OLD_GEMV_TILINGS:
        for split in (8, 16):
            configs.append(dict(KERNEL="gemv_split", BLOCK_N=block_n, BLOCK_W=block_w,
                                MODE=mode, SPLIT_K=split, num_warps=4, num_stages=stages))
    if m > 1:  # tensor cores on 16-row tiles, K split as pick_config would
        block_k = block_k_for(128 if bits == 4 else k)
        split = max(1, min(-(-k // block_k), -(-4 * sms() // -(-n // 64))))
        configs.append(dict(KERNEL="dot", BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k,
                            SPLIT_K=split, num_warps=4, num_stages=4))
    return configs


def fp8_configs(n: int, k: int) -> list[dict]:
    return [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps)
            for bn, bk, warps in FP8_TILINGS for split in splits_for(-(-n // bn), k // bk)]


def int_weights(bits: int, n: int, k: int, copies: int = 1) -> list[tuple]:
    """`copies` random (qweight, scales, zeros) of one shape (the speed does not depend on
    the values)."""
    group = 128 if bits == 4 else k
    out = []
    for _ in range(copies):
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k * bits // 32, n), device="cuda",
                                dtype=torch.int32)
        scales = torch.rand(k // group, n, device="cuda", dtype=torch.bfloat16) * 0.01
        zeros = torch.randint(0, 2 ** bits, (k // group, n), device="cuda", dtype=torch.uint8)
        out.append((qweight, scales, zeros))
    return out


def fp8_weights(n: int, k: int, copies: int = 1) -> list[tuple]:
    from radixlm.runtime.models.quantization.fp8 import quantize_fp8_rows

    w8, scale = quantize_fp8_rows(torch.randn(n, k, device="cuda"))
    return [(w8.clone(), scale.view(-1).clone()) for _ in range(copies)]


def int_call(x: torch.Tensor, weights: tuple, bits: int, cfg: dict) -> torch.Tensor:
    from radixlm.kernels.w4a16 import w4a16_matmul

    qweight, scales, zeros = weights
    group = 128 if bits == 4 else x.shape[1]
    return w4a16_matmul(x, qweight, scales, zeros, group, bits, config=cfg)


def fp8_call(x8: torch.Tensor, x_scale: torch.Tensor, weights: tuple,
             cfg: dict | None) -> torch.Tensor:
    from radixlm.kernels.fp8 import fp8_gemv

    w8, w_scale = weights
    if cfg is None:  # the tensor-core GEMM it replaces at small batches
        return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                                out_dtype=torch.bfloat16)
    return fp8_gemv(x8, x_scale, w8, w_scale, torch.bfloat16, config=cfg)


def _compile_task(task: tuple) -> str | None:
    """In a worker process: one call of a configuration, which leaves its compiled kernels in
    Triton's on-disk cache for the main process."""
    kind, bits, n, k, m, cfg = task
    try:
        if kind == "fp8":
            from radixlm.kernels.fp8 import per_token_fp8

            x8, x_scale = per_token_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            fp8_call(x8, x_scale, fp8_weights(n, k)[0], cfg)
        else:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            int_call(x, int_weights(bits, n, k)[0], bits, cfg)
        torch.cuda.synchronize()
    except Exception as exc:  # reported; the main process skips what fails
        return f"{kind} {cfg}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def precompile(tasks: list[tuple], workers: int) -> None:
    """Compile every kernel of the sweep in parallel processes (one compile per tiling, batch
    size and bit width; a serial compile of the sweep would take minutes)."""
    import concurrent.futures
    import multiprocessing

    unique = {}
    for task in tasks:  # kernels differ by tiling, rows (but the old GEMV's), bits, INT8's K
        kind, bits, n, k, m, cfg = task
        tiling = tuple(sorted((key, v) for key, v in cfg.items() if key != "SPLIT_K"))
        rows = 0 if cfg.get("KERNEL") == "gemv_split" else m
        unique.setdefault((kind, bits, rows, k if bits == 8 else 0, tiling), task)
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for error in pool.map(_compile_task, unique.values()):
            if error:
                print("compile failed:", error, flush=True)
    print(f"compiled {len(unique)} kernels in {time.perf_counter() - start:.0f} s", flush=True)


def graph_us(calls: list) -> float:
    """Median microseconds per call, from a CUDA graph of the calls replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()  # compile and allocate (split-K buffers) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return 1e3 * median_replay_ms(graph, 15) / len(calls)


def copies_for(nbytes: int) -> int:
    return max(2, -(-L2_FLUSH_BYTES // nbytes))


def time_configs(calls_for, configs: list, check) -> list[tuple[float, dict]]:
    """(us, config) for every configuration that gives the right answer, fastest first."""
    timings = []
    for cfg in configs:
        try:
            calls = calls_for(cfg)
            err = check(calls[0]())
            if err > 5e-3:
                print(f"    WRONG (rel err {err:.1e}): {cfg}", flush=True)
                continue
            timings.append((graph_us(calls), cfg))
        except Exception as exc:  # e.g. out of registers or shared memory
            print(f"    skip {cfg}: {type(exc).__name__}", flush=True)
    return sorted(timings, key=lambda t: t[0])


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def sweep_int(bits: int, n: int, k: int, m: int) -> tuple[dict, dict]:
    """One shape and batch size of W4A16 (group 128) or W8A16 (per channel): every
    configuration, the rule's choice and bf16, each checked against the reference."""
    from radixlm.kernels.reference import w4a16_matmul_reference
    from radixlm.kernels.w4a16 import gemv_config

    group = 128 if bits == 4 else k
    weights = int_weights(bits, n, k, copies_for(k * n * bits // 8))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = w4a16_matmul_reference(x, *weights[0], group, bits)
    nbytes = sum(t.nbytes for t in weights[0])

    def calls_for(cfg: dict) -> list:
        return [functools.partial(int_call, x, w, bits, cfg) for w in weights]

    timings = time_configs(calls_for, int_configs(bits, n, k, m),
                           lambda out: rel_err(out, want))
    rule = gemv_config(m, n, k, group, bits, x.device)
    rule_us = graph_us(calls_for(rule))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(copies_for(2 * n * k))]
    bf16_us = graph_us([functools.partial(torch.nn.functional.linear, x, w) for w in dense])
    best_of = {kind: next((t for t in timings if t[1]["KERNEL"] == kind), (float("nan"), None))
               for kind in ("gemv", "gemv_split", "dot")}
    row = {"bits": bits, "n": n, "k": k, "m": m, "floor_us": 1e6 * nbytes / COPY_BANDWIDTH,
           "bf16_us": bf16_us, "bf16_floor_us": 1e6 * 2 * n * k / COPY_BANDWIDTH,
           "rule_us": rule_us, "rule": rule,
           **{f"{kind}_best_us": best[0] for kind, best in best_of.items()},
           **{f"{kind}_best": best[1] for kind, best in best_of.items()}}
    return _with_best(row, timings)


def sweep_fp8(n: int, k: int, m: int) -> tuple[dict, dict]:
    """One shape and batch size of FP8 W8A8: the GEMV's tilings against torch._scaled_mm."""
    from radixlm.kernels.fp8 import fp8_gemv_rule, per_token_fp8

    weights = fp8_weights(n, k, copies_for(n * k))
    x8, x_scale = per_token_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    want = (x8.float() * x_scale) @ (weights[0][0].float() * weights[0][1][:, None]).t()

    def calls_for(cfg: dict | None) -> list:
        return [functools.partial(fp8_call, x8, x_scale, w, cfg) for w in weights]

    timings = time_configs(calls_for, fp8_configs(n, k), lambda out: rel_err(out, want))
    rule = fp8_gemv_rule(n, k, x8.device)
    row = {"n": n, "k": k, "m": m, "floor_us": 1e6 * (n * k + 4 * n) / COPY_BANDWIDTH,
           "scaled_mm_us": graph_us(calls_for(None)), "rule_us": graph_us(calls_for(rule)),
           "rule": rule}
    return _with_best(row, timings)


def _with_best(row: dict, timings: list[tuple[float, dict]]) -> tuple[dict, dict | None]:
    best_us, best = timings[0] if timings else (float("nan"), None)
    return dict(row, best_us=best_us, best=best, top=timings[:5]), best


def sweep(write_tuned: str | None, workers: int) -> dict:
    """Time the small-batch kernels at batch 1, 2 and 4 on the 8B shapes (see the tables it
    prints). With write_tuned, the fastest W4A16 configuration per shape and batch size (any
    kernel) and the fastest fp8 GEMV tiling become the module pick_config and fp8_gemv_config
    read (kernels/w4a16_tuned.py)."""
    from radixlm.kernels.w4a16 import rows_key

    tasks = [("int", bits, n, k, m, cfg) for bits in (4, 8) for n, k in SHAPES_8B
             for m in SWEEP_ROWS for cfg in int_configs(bits, n, k, m)]
    tasks += [("fp8", 8, n, k, m, cfg) for n, k in SHAPES_8B for m in SWEEP_ROWS
              for cfg in fp8_configs(n, k)]
    precompile(tasks, workers)
    int_rows, fp8_rows, tuned = [], [], {}
    print(f"{'bits':>4} {'N':>6} {'K':>6} {'m':>2} {'floor':>6} {'bf16':>6} {'old':>6} "
          f"{'dot':>6} {'rule':>6} {'best':>6} {'x floor':>7}  best config (us per call)")
    for bits in (4, 8):
        for n, k in SHAPES_8B:
            for m in SWEEP_ROWS:
                row, best = sweep_int(bits, n, k, m)
                int_rows.append(row)
                group = 128 if bits == 4 else k
                if best is not None:
                    tuned[f"{bits}:{group}:{n}:{k}:{rows_key(m)}"] = best
                print(f"{bits:>4} {n:>6} {k:>6} {m:>2} {row['floor_us']:6.1f} "
                      f"{row['bf16_us']:6.1f} {row['gemv_split_best_us']:6.1f} "
                      f"{row['dot_best_us']:6.1f} {row['rule_us']:6.1f} {row['best_us']:6.1f} "
                      f"{row['best_us'] / row['floor_us']:7.2f}  {best}", flush=True)
    print(f"\nfp8 {'N':>6} {'K':>6} {'m':>2} {'floor':>6} {'_scaled_mm':>10} {'rule':>6} "
          f"{'best':>6} {'x floor':>7}  best config")
    for n, k in SHAPES_8B:
        for m in SWEEP_ROWS:
            row, best = sweep_fp8(n, k, m)
            fp8_rows.append(row)
            if best is not None:
                tuned[f"fp8:{n}:{k}:{rows_key(m)}"] = best
            print(f"    {n:>6} {k:>6} {m:>2} {row['floor_us']:6.1f} {row['scaled_mm_us']:10.1f} "
                  f"{row['rule_us']:6.1f} {row['best_us']:6.1f} "
                  f"{row['best_us'] / row['floor_us']:7.2f}  {best}", flush=True)
    if write_tuned:
        card = torch.cuda.get_device_name()
        Path(write_tuned).write_text(
            '"""W4A16 configurations measured best at batch 1, 2 and 4, by GPU and '
            '"bits:group:N:K:m<rows>",\nand the fp8 GEMV\'s by "fp8:N:K:m<rows>"\n(written by '
            'benchmarks/quant_speed.py --sweep --write-tuned)."""\n\n'
            f"TUNED = {json.dumps({card: tuned}, indent=4)}\n")
        print(f"wrote {write_tuned}")
    return {"int": int_rows, "fp8": fp8_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(QUANTIZATION),
                        choices=list(QUANTIZATION))
    parser.add_argument("--large-batch", type=int, default=256)
    parser.add_argument("--large-batch-formats", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--sweep", action="store_true",
                        help="only the small-batch kernel sweep (W4A16, W8A16, FP8)")
    parser.add_argument("--write-tuned", nargs="?", default=None, const=str(TUNED_MODULE),
                        help="with --sweep: write the best tilings as this Python module "
                             "(default: kernels/w4a16_tuned.py)")
    parser.add_argument("--compile-workers", type=int, default=8,
                        help="with --sweep: processes compiling the kernels in parallel")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    card = torch.cuda.get_device_name()
    record = {"benchmark": "quant_speed", "date": datetime.date.today().isoformat(),
              "machine": {"gpu": card, "torch": torch.__version__},
              "config": {"model": "llama-3-8b", "input_len": args.input_len,
                         "output_len": args.output_len, "copy_bandwidth": COPY_BANDWIDTH}}
    if args.sweep:
        record["sweep"] = sweep(args.write_tuned, args.compile_workers)
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
    suffix = "_sweep" if args.sweep else ""
    out = Path(args.out or results_dir() /
               f"quant_speed_h200_{record['date']}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
