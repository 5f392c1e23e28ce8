"""One batch at a time on CUDA: prefill, then decode, against the memory-bandwidth floor.

For each batch size B: B random prompts of `--input-len` tokens go in together, each gets
`--output-len` new tokens (greedy, EOS ignored), on a Llama-3-8B-shaped model with random bf16
weights. Per row:

- prefill ms: from submission until every request has its first token;
- decode ms/token: the median wall time of one engine step while all B requests decode
  (scheduling, input prep, the forward, sampling and bookkeeping: what a user waits);
- GPU ms: the same step's captured CUDA graph replayed alone (CUDA events), so
  decode - GPU is the host's share of a step;
- the floor: weights (all but the input embedding table, which is only gathered) plus the KV
  the step reads, at the card's measured copy bandwidth.
- with `--trace-steps N`: N more decode steps traced, host and device (graphs and overlap as
  configured): the device's busy and idle time per step and its busy time by kernel kind;
  the Chrome trace is written beside the JSON.

    python benchmarks/one_batch.py [--batch-sizes 1 8 32 128 256] [--attention-backend triton]
        [--kv-cache-dtype fp8_e4m3] [--quantization fp8] [--profile] [--deterministic]
        [--trace-steps N]
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from radixlm.runtime import Engine

from gpu_timing import median_replay_ms
from hf_dummy import hf_dummy_model
from results_dir import results_dir

COPY_BANDWIDTH = 4.1e12  # bytes/s, device-to-device copy measured on the H200
GEMM_RATE = 753e12  # bf16 FLOP/s, 8192^3 GEMM measured on the same card


def model_costs(engine: Engine) -> dict[str, int]:
    """Bytes and FLOPs the floors count: weight bytes read per step (all but the input
    embedding table, which is only gathered; the output head is read in full), KV bytes per
    token of context, matmul FLOPs per token in the layers and per sampled row in the head."""
    model = engine.core.runner.model
    embed = model.model.embed_tokens.weight
    size = embed.element_size()
    head = embed if model.lm_head is None else model.lm_head.weight
    # Bytes as stored, so that quantized (packed) linears count what they really stream.
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    streamed_bytes = (stored - embed.numel() * size
                      + (head.numel() * size if model.lm_head is None else 0))
    cfg = engine.model_config
    # FLOPs from the logical shapes: 2 per multiply-add of each decoder linear.
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * i
    return {"weight_bytes": streamed_bytes,
            "kv_bytes_per_token": (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                                   * engine.core.kv_cache.k.element_size()),
            "layer_flops_per_token": 2 * cfg.num_layers * per_layer,
            "head_flops_per_row": 2 * head.numel()}


def time_graph(engine: Engine, batch: int, reps: int = 20) -> float | None:
    """Median ms of replaying the captured graph of this batch (the last step's inputs are
    still staged, so a replay recomputes that step: same values to the same KV slots)."""
    graphs = engine.core.runner.cuda_graphs
    if graphs is None or batch > graphs.max_bs:  # larger batches run eagerly
        return None
    graph = graphs.graphs[graphs.padded_size(batch), False]  # the graph without adapters
    return median_replay_ms(graph, reps)


# Kernel name fragments -> what they do, for the per-step GPU time breakdown.
KERNEL_KINDS = [("attention", ("decode_split", "decode_merge", "store_kv", "extend_kernel",
                               "BatchDecode", "BatchPrefill", "index_copy")),
                ("norm", ("rms_norm",)), ("rotary", ("rotary",)), ("silu_and_mul", ("silu",)),
                ("quantize", ("per_token_fp8", "quantize")),
                ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitK", "Kernel2"))]


def profile_step(core) -> dict[str, float]:
    """One engine step run eagerly (graph off) under the profiler: ms of GPU time per kind of
    kernel. A graph replays the same kernels, minus the launch gaps between them."""
    graphs, core.runner.cuda_graphs = core.runner.cuda_graphs, None
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            core.step()
            torch.cuda.synchronize()
    finally:
        core.runner.cuda_graphs = graphs
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        ms = getattr(event, "device_time_total", 0) / 1e3
        if ms <= 0:
            continue
        kind = kernel_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    kinds["total"] = sum(kinds.values())
    top = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:12]
    kinds["top_kernels"] = [(e.key[:90], round(e.device_time_total / 1e3, 4)) for e in top]
    return kinds


def kernel_kind(name: str) -> str:
    return next((k for k, names in KERNEL_KINDS if any(n in name for n in names)), "other")


def summarize_trace(device: list[tuple[float, float, str]], launches: list[float],
                    steps: int) -> dict:
    """Device activity (start us, end us, name) of `steps` traced steps, and the host times of
    their graph launches (us, the same clock): see trace_steps."""
    device = sorted(device)
    marks = [next(s for s, _, _ in device if s >= t) for t in sorted(launches)
             if any(s >= t for s, _, _ in device)]
    if len(marks) >= 4:  # the first two steps settle (the trace starts from a drained device)
        start, end, counted = marks[2], marks[-1], len(marks) - 3
    else:
        start, end, counted = device[0][0], device[-1][1], steps
    busy, cursor, kinds = 0.0, start, {}
    for s, e, name in device:
        if e <= start or s >= end:
            continue
        s, e = max(s, start), min(e, end)
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + (e - s) / 1e3
        if e > cursor:
            busy += e - max(s, cursor)
            cursor = e
    return {"steps": counted, "step_ms": (end - start) / 1e3 / counted,
            "busy_ms": busy / 1e3 / counted, "idle_ms": (end - start - busy) / 1e3 / counted,
            "busy_ms_by_kind": {k: v / counted for k, v in
                                sorted(kinds.items(), key=lambda kv: -kv[1])}}


def trace_steps(core, steps: int) -> tuple[dict, torch.profiler.profile]:
    """`steps` real decode steps (graphs and overlap as configured) under the profiler, host
    and device. Per steady step (between the first kernels of consecutive graph replays; the
    first two traced steps left out, as the trace starts from a drained device): its length
    on the device, the time the device was busy and idle, and the busy time by kernel kind.
    Without graphs (or under 4 steps), the whole traced window divided by the steps."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    device = [(e.start_ns() / 1e3, e.end_ns() / 1e3, e.name()) for e in events
              if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0]
    launches = [e.start_ns() / 1e3 for e in events
                if e.device_type() == DeviceType.CPU and "GraphLaunch" in e.name()]
    summary = summarize_trace(device, launches, steps)
    return summary, prof


def run_batch(engine: Engine, batch: int, input_len: int, output_len: int,
              seed: int, profile: bool = False, trace: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = torch.randint(0, vocab, (batch, input_len), generator=gen).tolist()
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    requests = engine._make_requests(prompts, params, None, None, False)

    def drive(core) -> dict:
        # Runs on the engine thread (Engine._call), stepping the core by hand for timings.
        timings = {"schedule": [], "postprocess": [], "launch": [], "result": []}
        schedule, postprocess, launch = (core.scheduler.schedule, core._postprocess,
                                         core.runner.launch)

        def timed(name, fn):
            def wrapper(*args):
                t0 = time.perf_counter()
                out = fn(*args)
                timings[name].append(time.perf_counter() - t0)
                return out
            return wrapper

        core.scheduler.schedule = timed("schedule", schedule)
        core._postprocess = timed("postprocess", postprocess)

        def launch_timed(scheduled):
            step = timed("launch", launch)(scheduled)
            step.result = timed("result", step.result)  # waits for the device
            return step

        core.runner.launch = launch_timed
        try:
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for r in requests:
                core.add_request(r)
            prefill_steps = []
            while any(r.num_output_tokens == 0 for r in requests):
                t0 = time.perf_counter()
                core.step()
                prefill_steps.append(1e3 * (time.perf_counter() - t0))
            prefill = time.perf_counter() - start
            first = {k: len(v) for k, v in timings.items()}
            steps, gpu, kernels, traced = [], None, None, None
            while core.has_work:
                t0 = time.perf_counter()
                core.step()
                steps.append(time.perf_counter() - t0)
                if len(steps) == output_len // 2:
                    gpu = time_graph(engine, batch)
                    if profile:
                        kernels = profile_step(core)  # a step of its own, not timed
                    if trace:
                        traced = trace_steps(core, trace)  # steps of their own, not timed
            total = time.perf_counter() - start
        finally:
            del core.scheduler.schedule, core._postprocess, core.runner.launch
        host = {k: 1e3 * statistics.median(v[first[k]:] or [0.0]) for k, v in timings.items()}
        return {"prefill_s": prefill, "prefill_steps_ms": prefill_steps, "steps": steps,
                "gpu_ms": gpu, "total_s": total, "decode_parts_ms": host, "kernels_ms": kernels,
                "trace": traced}

    out = engine._call(drive)
    assert all(r.num_output_tokens == output_len for r in requests), "a request ended early"
    return out


def hf_eager_decode_ms(model_name: str, batch: int, input_len: int, steps: int = 32) -> float:
    """The in-run baseline: Hugging Face `transformers`, eager, bf16, random weights of the
    same shape, greedy decode with its KV cache. Median ms of one decode step, including
    reading the token back (as any generation loop must)."""
    model = hf_dummy_model(model_name)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, input_len), generator=gen).cuda()
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            token.tolist()
            start = time.perf_counter()
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            out.logits[:, -1].argmax(-1).tolist()
            times.append(time.perf_counter() - start)
    del model, out
    torch.cuda.empty_cache()
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                        help="quantized decoder linears (fp8: W8A8); the floor counts their "
                             "stored bytes")
    parser.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant kernels (EngineConfig.deterministic)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    parser.add_argument("--profile", action="store_true",
                        help="break one decode step per batch size down by kernel kind")
    parser.add_argument("--trace-steps", type=int, default=0, metavar="N",
                        help="trace N (6 or more) real decode steps per batch size, host "
                             "and device: busy and idle device time per step, by kernel "
                             "kind; the Chrome trace is written beside the JSON")
    parser.add_argument("--hf-baseline", type=int, nargs="*", default=None, metavar="BATCH",
                        help="also time transformers eager decode at these batch sizes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.trace_steps and args.device != "cuda":
        parser.error("--trace-steps traces CUDA devices")

    max_bs = max(args.batch_sizes)
    ctx = args.input_len + args.output_len
    engine = Engine(args.model, load_format="dummy", device=args.device, dtype="bfloat16",
                    attention_backend=args.attention_backend,
                    disable_cuda_graph=args.disable_cuda_graph, max_running_requests=max_bs,
                    overlap_schedule=args.overlap_schedule, kv_cache_dtype=args.kv_cache_dtype,
                    quantization=args.quantization, max_total_tokens=max_bs * ctx + 4096,
                    max_num_batched_tokens=16384,
                    chunked_prefill_size=args.input_len, disable_radix_cache=True,
                    deterministic=args.deterministic)
    costs = model_costs(engine)
    weight_bytes, kv_per_token = costs["weight_bytes"], costs["kv_bytes_per_token"]
    # Warm-up: enough prompts that prefill chunks share steps with 15..75 decode rows, so the
    # Triton kernel variants of mixed steps compile here and not inside a timed prefill.
    run_batch(engine, min(80, max_bs), args.input_len, 4, seed=99)
    rows, traces = [], []
    for i, batch in enumerate(args.batch_sizes):
        r = run_batch(engine, batch, args.input_len, args.output_len, seed=i,
                      profile=args.profile, trace=args.trace_steps)
        if r["trace"] is not None:
            r["trace"], prof = r["trace"]
            traces.append((batch, prof))
        decode_ms = 1e3 * statistics.median(r["steps"])
        # Mean context over the decode steps: prompt + half the output.
        kv_bytes = batch * (args.input_len + args.output_len / 2) * kv_per_token
        floor_ms = 1e3 * (weight_bytes + kv_bytes) / COPY_BANDWIDTH
        prefill_flops = batch * (args.input_len * costs["layer_flops_per_token"]
                                 + costs["head_flops_per_row"])
        rows.append({
            "batch": batch, "prefill_ms": 1e3 * r["prefill_s"],
            "prefill_tflops": prefill_flops / r["prefill_s"] / 1e12,
            "prefill_floor_ms": 1e3 * prefill_flops / GEMM_RATE,
            "decode_ms_per_token": decode_ms, "decode_gpu_ms": r["gpu_ms"],
            "decode_tokens_per_s": batch / decode_ms * 1e3,
            "output_tokens_per_s": batch * args.output_len / r["total_s"],
            "floor_ms": floor_ms, "ratio_to_floor": decode_ms / floor_ms,
            "gpu_ratio_to_floor": r["gpu_ms"] / floor_ms if r["gpu_ms"] else None,
            "kv_gb_per_step": kv_bytes / 1e9, "decode_host_parts_ms": r["decode_parts_ms"],
            "decode_kernels_ms": r["kernels_ms"], "prefill_steps_ms": r["prefill_steps_ms"],
            "decode_trace": r["trace"],
        })
    attn = type(engine.core.runner.attn).__name__
    overlap = engine.core.overlap
    engine.close()
    del engine
    torch.cuda.empty_cache()
    baseline = {batch: hf_eager_decode_ms(args.model, batch, args.input_len)
                for batch in args.hf_baseline or []}
    for row in rows:
        hf_ms = baseline.get(row["batch"])
        row["hf_eager_decode_ms"] = hf_ms
        row["speedup_vs_hf_eager"] = hf_ms / row["decode_ms_per_token"] if hf_ms else None

    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{args.model}, bf16, weights {args.quantization or 'bf16'}, {attn}, "
          f"input {args.input_len}, output {args.output_len}, "
          f"graphs {'off' if args.disable_cuda_graph else 'on'}, "
          f"overlap {overlap}, deterministic {args.deterministic}, {card}")
    print(f"{'batch':>5} {'prefill ms':>11} {'TFLOP/s':>8} {'decode ms':>10} {'GPU ms':>7} "
          f"{'tok/s':>8} {'floor ms':>9} {'x floor':>8} {'GPU x floor':>12}")
    for row in rows:
        kernels = row["decode_kernels_ms"]
        if kernels:
            print(f"  batch {row['batch']} eager step, GPU ms by kernel kind: " + ", ".join(
                f"{k} {v:.3f}" for k, v in kernels.items() if k != "top_kernels"))
    for row in rows:
        trace = row["decode_trace"]
        if trace:
            print(f"  batch {row['batch']} traced steps: {trace['step_ms']:.2f} ms on the "
                  f"device, busy {trace['busy_ms']:.2f}, idle {trace['idle_ms']:.2f}; " +
                  ", ".join(f"{k} {v:.3f}" for k, v in trace["busy_ms_by_kind"].items()))
    for row in rows:
        gpu = row["decode_gpu_ms"]
        print(f"{row['batch']:>5} {row['prefill_ms']:>11.1f} {row['prefill_tflops']:>8.0f} "
              f"{row['decode_ms_per_token']:>10.2f} {gpu or float('nan'):>7.2f} "
              f"{row['decode_tokens_per_s']:>8.0f} {row['floor_ms']:>9.2f} "
              f"{row['ratio_to_floor']:>8.2f} {row['gpu_ratio_to_floor'] or float('nan'):>12.2f}"
              + (f"  transformers eager {row['hf_eager_decode_ms']:.2f} ms "
                 f"({row['speedup_vs_hf_eager']:.1f}x)" if row["hf_eager_decode_ms"] else ""))
    record = {
        "benchmark": "one_batch", "date": datetime.date.today().isoformat(),
        "machine": {"gpu": card, "torch": torch.__version__},
        "config": {"model": args.model, "dtype": "bfloat16", "attention": attn,
                   "cuda_graphs": not args.disable_cuda_graph, "overlap": overlap,
                   "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
                   "input_len": args.input_len,
                   "output_len": args.output_len, "deterministic": args.deterministic},
        "floor": {**costs, "copy_bandwidth": COPY_BANDWIDTH, "gemm_rate": GEMM_RATE},
        "rows": rows,
    }
    out = Path(args.out or results_dir() /
               f"one_batch_h200_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    for batch, prof in traces:
        path = out.with_name(f"{out.stem}_trace_b{batch}.json")
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        path.unlink()
        print(f"wrote {path}.gz")


if __name__ == "__main__":
    main()
