"""Tensor parallelism: TP=1 against TP=2 on one machine, in one call.

For each configuration (tp size, CUDA graphs on or off), on a Llama-3-8B-shaped model with
random weights:

- decode ms/token at batch 1: (time of N new tokens - time of 1 new token) / (N - 1), so the
  prefill drops out;
- large-batch throughput: B prompts decoding together, generated tokens per second;
- the all-reduce share of a decode step: rank 0's all-reduces are timed where they are called
  (CUDA events around each one on GPU, so the stream is never synchronized; wall clock on
  CPU), during the batch-1 run, and divided by that run's time per step. The time includes
  waiting for the slower rank, which is what the step pays.

TP > 1 runs eagerly (CUDA graphs are not captured with tensor parallelism yet), so the TP=1
baseline is given both with graphs and eagerly. NVLink multicast (NVLS) is turned off unless
NCCL_NVLS_ENABLE is already set; every NCCL_* variable in effect is recorded.

    python benchmarks/tp.py                                # 2 GPUs, llama-3-8b, bf16
    python benchmarks/tp.py --device cpu --model PATH --load-format auto \\
        --configs 1:eager 2:eager --output-len 8 --batch 4  # a CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from radixlm.runtime import Engine
from radixlm.runtime.layers import embedding, linear


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


def measure(args: argparse.Namespace, tp: int, graphs: bool) -> dict:
    engine = Engine(args.model, load_format=args.load_format, device=args.device,
                    dtype=args.dtype, tp_size=tp, disable_cuda_graph=not graphs,
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
        batch_s = timed_generate(engine, prompts(engine, args.batch, args.input_len, seed + 3),
                                 n)
        return {"tp": tp, "cuda_graphs": graphs and engine.device.type == "cuda",
                "decode_ms_per_token_b1": round(decode_ms, 3),
                "all_reduce_ms_per_step_b1": round(reduce_ms[0] / steps, 3),
                "all_reduce_share_b1": round(reduce_ms[0] / steps / decode_ms, 3),
                "batch": args.batch,
                "throughput_tokens_per_s": round(args.batch * n / batch_s, 1)}
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
    parser.add_argument("--configs", nargs="+", default=["1:graphs", "1:eager", "2:eager"],
                        help="TP:graphs|eager, run in this order")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128, help="large-batch size")
    parser.add_argument("--max-total-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file (default: benchmarks/results)")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    rows = []
    for spec in args.configs:
        tp, mode = spec.split(":")
        rows.append(measure(args, int(tp), mode == "graphs"))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["tp"] == 1 and not r["cuda_graphs"]), rows[0])
    print(f"\n{'tp':>3} {'graphs':>6} {'b1 ms/tok':>10} {'x tp1-eager':>11} "
          f"{'all-reduce':>10} {'tok/s @B':>10}")
    for r in rows:
        print(f"{r['tp']:>3} {str(r['cuda_graphs']):>6} {r['decode_ms_per_token_b1']:>10.2f} "
              f"{r['decode_ms_per_token_b1'] / base['decode_ms_per_token_b1']:>11.2f} "
              f"{r['all_reduce_share_b1']:>10.1%} {r['throughput_tokens_per_s']:>10.0f}")
    device = ("h200" if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name()
              else args.device)
    nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    record = {"model": args.model, "device": device, "dtype": args.dtype,
              "input_len": args.input_len, "output_len": args.output_len,
              "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
              "nccl_version": nccl_version(),
              "nccl_env": nccl, "results": rows}
    out = Path(args.out or Path(__file__).parent / "results" /
               f"tp_{device}_{datetime.date.today()}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
