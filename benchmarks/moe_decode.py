"""Mixture-of-experts decode on one GPU: the fused Triton kernel against the grouped torch
path, and batch-1 decode of whole MoE models, against the bytes of the *active* experts.

At batch 1 a token reads its top-k experts, not all E of them, so the floor is
(weights outside the experts + k/E of the expert weights) / the card's copy bandwidth.

1. One MoE layer (random bf16 weights, random routing) at T = 1, 8, 32 tokens: the fused
   kernel replayed from a CUDA graph, and the grouped torch path (eager: it reads the expert
   counts back to the host), each against the bytes of the experts the step touches.
2. Whole dummy models (`mixtral-8x7b`, `qwen3-30b-a3b`) through the engine at batch 1:
   ms/token of decode with CUDA graphs (fused kernel), eager with the fused kernel, and eager
   with the grouped path.

    python benchmarks/moe_decode.py [--models mixtral-8x7b qwen3-30b-a3b] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir

COPY_BANDWIDTH = 4.1e12  # bytes/s, read + write, measured on the H200 (docs: GPU.md)
# (experts, top-k, hidden, expert channels) of one layer of each model.
LAYER_SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def _events_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_rows(name: str, token_counts: list[int], reps: int) -> list[dict]:
    from radixlm.kernels.fused_moe import fused_moe
    from radixlm.runtime.models.layers.moe import grouped_moe, route_top_k

    experts, top_k, hidden, inter = LAYER_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16,
                      generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16,
                     generator=gen) * 0.02
    expert_bytes = 3 * hidden * inter * 2
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, experts, device="cuda", generator=gen)
        weights, ids = route_top_k(logits, top_k, renormalize=True)
        active = int(ids.unique().numel())
        floor_ms = 1e3 * active * expert_bytes / COPY_BANDWIDTH
        graph = capture(lambda: fused_moe(x, w13, w2, weights, ids))
        fused_ms = median_replay_ms(graph, reps)
        grouped_ms = _events_ms(lambda: grouped_moe(x, w13, w2, weights, ids), reps)
        err = (fused_moe(x, w13, w2, weights, ids).float()
               - grouped_moe(x, w13, w2, weights, ids).float()).abs().max().item()
        rows.append({"model": name, "tokens": tokens, "active_experts": active,
                     "floor_ms": floor_ms, "fused_graph_ms": fused_ms,
                     "grouped_eager_ms": grouped_ms, "fused_ratio_to_floor": fused_ms / floor_ms,
                     "max_abs_diff": err})
        print(f"{name:14s} T={tokens:3d} experts {active:3d}  floor {floor_ms:6.3f} ms  "
              f"fused {fused_ms:6.3f} ms ({fused_ms / floor_ms:4.2f}x)  grouped {grouped_ms:7.3f}"
              f" ms  |diff| {err:.1e}", flush=True)
    return rows


def active_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every weight but the embedding table (gathered one
    row), with each expert tensor counted at top_k / num_experts."""
    from radixlm.runtime.models.layers.moe import FusedMoE

    total = 0
    embed = model.model.embed_tokens.weight
    tied = model.lm_head is None
    for module in model.modules():
        for param in module.parameters(recurse=False):
            size = param.numel() * param.element_size()
            if param is embed and not tied:
                continue
            if isinstance(module, FusedMoE):
                size = size * model.moe.top_k // module.num_experts
            total += size
    return total


def decode_ms(engine, prompt: list[int], new_tokens: tuple[int, int]) -> float:
    """ms per decode step at batch 1: the difference of two generations' wall times."""
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in new_tokens]
    engine.generate(input_ids=prompt, sampling_params=params[0])  # warm-up
    times = []
    for p in params:
        start = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params=p)
        times.append(time.perf_counter() - start)
    return 1e3 * (times[1] - times[0]) / (new_tokens[1] - new_tokens[0])


def model_rows(name: str, device: str) -> list[dict]:
    from radixlm.runtime import Engine

    engine = Engine(name, load_format="dummy", device=device, dtype="bfloat16",
                    max_running_requests=1, max_total_tokens=4096, disable_radix_cache=True)
    model = engine.core.runner.model
    floor_ms = 1e3 * active_bytes_per_token(model) / COPY_BANDWIDTH
    prompt = list(range(100, 132))
    rows = []
    runs = [("cuda graphs, fused", None)]
    if engine.core.runner.cuda_graphs is not None:  # then eager, then the grouped path
        runs += [("eager, fused", "eager"), ("eager, grouped torch", "grouped")]
    for label, change in runs:
        if change == "eager":
            engine.core.runner.cuda_graphs = None  # the engine thread is idle between calls
        elif change == "grouped":
            model.use_fused_kernels(False)
        ms = decode_ms(engine, prompt, (16, 80))
        rows.append({"model": name, "run": label, "decode_ms_per_token": ms,
                     "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms})
        print(f"{name:14s} {label:22s} {ms:7.2f} ms/token  floor {floor_ms:6.2f} ms  "
              f"({ms / floor_ms:4.2f}x)", flush=True)
    engine.close()
    del engine, model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(LAYER_SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--skip-models", action="store_true", help="the layer timings only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    layers = [row for name in args.models for row in layer_rows(name, args.tokens, args.reps)]
    models = [] if args.skip_models else [row for name in args.models
                                          for row in model_rows(name, "cuda")]
    today = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else results_dir() / f"moe_decode_h200_{today}.json"
    out.write_text(json.dumps({
        "benchmark": "moe_decode", "date": today,
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
        "copy_bandwidth": COPY_BANDWIDTH, "layers": layers, "models": models}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
