"""Tensor parallelism: TP=1 against TP=2 on one machine, in one call.

For each configuration (tp size, CUDA graphs on or off), on a Llama-3-8B-shaped model with
random weights:

- decode ms/token at batch 1: (time of N new tokens - time of 1 new token) / (N - 1), so the
  prefill drops out;
- large-batch throughput: B prompts decoding together, generated tokens per second;
- the all-reduce share of a decode step. Eager runs time rank 0's all-reduces where they are
  called (CUDA events around each one, so the stream is never synchronized; wall clock on
  CPU); that time includes waiting for the slower rank, which is what the step pays. Inside
  a CUDA graph nothing can be timed per call, so for graph runs the share is the time of the
  step's all-reduces (2 per layer + 1 for the embedding, at the step's size) replayed alone in
  a CUDA graph on the same GPUs, divided by the measured step.

Each configuration runs in a fresh process (one tensor-parallel engine per process).
NVLink multicast (NVLS) is turned off unless NCCL_NVLS_ENABLE is already set; every NCCL_*
variable in effect is recorded.

    python benchmarks/tp.py                                # 2 GPUs, llama-3-8b, bf16
    python benchmarks/tp.py --device cpu --model smollm2-135m-instruct --load-format auto \\
        --dtype float32 --configs 1:eager 3:eager --output-len 8 --batch 4  # CPU smoke (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixlm.runtime import Engine
from radixlm.runtime.distributed.groups import (
    active_all_reduce,
    all_reduce,
    free_port,
    setup_all_reduce,
)
from radixlm.runtime.models.layers import embedding, linear

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir


@contextmanager
def timed_all_reduces(device: torch.device) -> Iterator[list[float]]:
    """Time every all-reduce rank 0 issues inside the block; the list gets the total ms."""
    spans: list = []
    original = linear.all_reduce

    def timed(x: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            out = original(x)
            end.record()
            spans.append((start, end))
            return out
        t0 = time.perf_counter()
        out = original(x)
        spans.append(1e3 * (time.perf_counter() - t0))
        return out

    linear.all_reduce = embedding.all_reduce = timed
    total: list[float] = []
    try:
        yield total
    finally:
        linear.all_reduce = embedding.all_reduce = original
        if device.type == "cuda":
            torch.cuda.synchronize()
            total.append(sum(s.elapsed_time(e) for s, e in spans))
        else:
            total.append(sum(spans))


def _graph_all_reduce_worker(rank: int, world: int, port: int, mode: str,
                             shapes: list[tuple[int, int]], count: int, reps: int,
                             out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    # The engine's own all-reduce, set up as the engine sets it up.
    setup_all_reduce(mode, max(r for r, _ in shapes) * shapes[0][1], torch.bfloat16, device)
    results = {}
    for rows, hidden in shapes:
        x = torch.ones(rows, hidden, dtype=torch.bfloat16, device="cuda")
        graph = capture(lambda: all_reduce(x), count)
        results[rows] = median_replay_ms(graph, reps, before=dist.barrier)  # `count` of them
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def graph_all_reduce_ms(world: int, mode: str, hidden: int, rows: list[int],
                        count: int) -> dict[int, float]:
    """Median ms of `count` in-place all-reduces of [rows, hidden] bf16 by the engine's
    all-reduce (`mode`), replayed in one CUDA graph over `world` GPUs (fresh processes: the
    engines' groups are closed by then)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_graph_all_reduce_worker,
                         args=(r, world, port, mode, [(n, hidden) for n in rows], count, 20,
                               queue))
             for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=300)
    for proc in procs:
        proc.join(timeout=60)
    return result


def prompts(engine: Engine, batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.model_config.vocab_size, (batch, length),
                         generator=gen).tolist()


def timed_generate(engine: Engine, ids: list[list[int]], new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(o.error is None and len(o.token_ids) == new_tokens for o in outs)
    return elapsed


def measure(args: argparse.Namespace, tp: int, graphs: bool, all_reduce: str) -> dict:
    engine = Engine(args.model, load_format=args.load_format, device=args.device,
                    dtype=args.dtype, tp_size=tp, disable_cuda_graph=not graphs,
                    tp_all_reduce=all_reduce,
                    disable_radix_cache=True, max_total_tokens=args.max_total_tokens,
                    max_running_requests=max(args.batch, 1))
    try:
        n, seed = args.output_len, 0
        timed_generate(engine, prompts(engine, 1, args.input_len, seed), 4)  # warm-up
        one = timed_generate(engine, prompts(engine, 1, args.input_len, seed + 1), 1)
        steps0 = engine.stats()["steps"]
        with timed_all_reduces(engine.device) as reduce_ms:
            many = timed_generate(engine, prompts(engine, 1, args.input_len, seed + 2), n)
        decode_ms = 1e3 * (many - one) / (n - 1)
        steps = engine.stats()["steps"] - steps0
        # Warm-up at the large batch too: its first steps compile kernels for new shapes.
        timed_generate(engine, prompts(engine, args.batch, args.input_len, seed + 4), 4)
        batch_s = timed_generate(engine, prompts(engine, args.batch, args.input_len, seed + 3),
                                 n)
        graphed = graphs and engine.device.type == "cuda"
        layers = engine.model_config.num_layers
        return {"tp": tp, "cuda_graphs": graphed, "all_reduce": active_all_reduce(),
                "decode_ms_per_token_b1": round(decode_ms, 3),
                # Graph runs: filled in from the replayed all-reduces (see main).
                "all_reduce_ms_per_step_b1": None if graphed else round(reduce_ms[0] / steps, 3),
                "all_reduce_share_b1": (None if graphed
                                        else round(reduce_ms[0] / steps / decode_ms, 3)),
                "all_reduces_per_step": 2 * layers + 1 if tp > 1 else 0,
                "hidden_size": engine.model_config.hidden_size,
                "batch": args.batch,
                "throughput_tokens_per_s": round(args.batch * n / batch_s, 1)}
    finally:
        engine.close()


def measure_in_fresh_process(args: argparse.Namespace, tp: int, graphs: bool,
                             all_reduce: str) -> dict:
    """`measure` in a process of its own. Tensor parallelism takes one engine per process:
    symmetric memory is set up once per process, and NCCL all-reduces in CUDA graphs after
    another CUDA engine are refused (docs/distributed.md), so each configuration gets what a
    served engine gets."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(measure, args, tp, graphs, all_reduce).result()


def nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()  # a tuple, or an int in older builds
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--configs", nargs="+",
                        default=["1:graphs", "2:graphs", "2:eager", "2:graphs:nccl"],
                        help="TP:graphs|eager[:auto|symmetric|nccl] (the all-reduce), run in "
                             "this order")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128, help="large-batch size")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--out", default=None,
                        help="JSON file (default: a dated file in $RADIXLM_RESULTS_DIR or "
                             "~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    rows = []
    for spec in args.configs:
        tp, mode, *all_reduce = spec.split(":")
        rows.append(measure_in_fresh_process(args, int(tp), mode == "graphs",
                                             (all_reduce or ["auto"])[0]))
        print(json.dumps(rows[-1]), flush=True)
    replayed = [r for r in rows if r["cuda_graphs"] and r["tp"] > 1]
    replay_ms: dict[str, dict] = {}
    for world, mode in sorted({(r["tp"], r["all_reduce"]) for r in replayed}):
        example = next(r for r in replayed if (r["tp"], r["all_reduce"]) == (world, mode))
        count = example["all_reduces_per_step"]
        ms = graph_all_reduce_ms(world, mode, example["hidden_size"], [1, args.batch], count)
        replay_ms[f"{world}:{mode}"] = {"all_reduces": count, "rows_1_ms": round(ms[1], 4),
                                        f"rows_{args.batch}_ms": round(ms[args.batch], 4)}
        for r in rows:
            if r in replayed and (r["tp"], r["all_reduce"]) == (world, mode):
                r["all_reduce_ms_per_step_b1"] = round(ms[1], 3)
                r["all_reduce_share_b1"] = round(ms[1] / r["decode_ms_per_token_b1"], 3)
    # The ratio is against TP=1 in the same mode as the row (graphs with graphs).
    print(f"\n{'tp':>3} {'graphs':>6} {'all-reduce':>10} {'b1 ms/tok':>10} {'x tp1':>6} "
          f"{'AR share':>9} {'tok/s @B':>10}")
    for r in rows:
        base = next((b for b in rows if b["tp"] == 1 and b["cuda_graphs"] == r["cuda_graphs"]),
                    rows[0])
        r["vs_tp1"] = round(r["decode_ms_per_token_b1"] / base["decode_ms_per_token_b1"], 3)
        share = r["all_reduce_share_b1"]
        print(f"{r['tp']:>3} {str(r['cuda_graphs']):>6} {r['all_reduce']:>10} "
              f"{r['decode_ms_per_token_b1']:>10.2f} "
              f"{r['vs_tp1']:>6.2f} {'' if share is None else f'{share:.1%}':>9} "
              f"{r['throughput_tokens_per_s']:>10.0f}")
    device = ("h200" if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name()
              else args.device)
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    record = {"benchmark": "tp", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "cpus": os.cpu_count(),
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else None},
              # RADIXLM_CPU_KERNEL=0: every rank runs the eager path (no C++ kernels)
              "cpu_kernel": os.environ.get("RADIXLM_CPU_KERNEL", "1") != "0",
              "model": args.model, "device": device, "dtype": args.dtype,
              "input_len": args.input_len, "output_len": args.output_len,
              "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
              "nccl_version": nccl_version(),
              "nccl_env": nccl, "results": rows, "graph_all_reduce_replay": replay_ms}
    out = Path(args.out or results_dir() /
               f"tp_{device}_{datetime.date.today()}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
