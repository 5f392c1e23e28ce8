"""Mixture-of-experts decode: the fused Triton kernel against the grouped torch path, and
batch-1 decode of whole MoE models, against the bytes of the *active* experts; bf16 experts
beside quantized ones (fp8, int8: one byte per weight and a float32 scale per channel).

At batch 1 a token reads its top-k experts, not all E of them, so the floor is
(weights outside the experts + k/E of the expert weights) / the card's copy bandwidth.

1. One MoE layer (random weights, random routing) at T = 1, 8, 32 tokens, per expert format:
   the fused kernel replayed from a CUDA graph, and the grouped torch path (eager: it reads
   the expert counts back to the host), each against the bytes of the experts the step touches.
2. Whole dummy models (`mixtral-8x7b`, `qwen3-30b-a3b`) through the engine at batch 1, per
   format (`quantization=`): ms/token of decode with CUDA graphs (fused kernel), and unless
   --graphs-only, eager with the fused kernel and eager with the grouped path.

On the CPU (--device cpu) the same two parts run the grouped path only (the CPU's forms:
int8 experts through torch's int8 kernel, fp8 experts as bfloat16), report GB/s of the active
expert bytes instead of a floor, and --layers cuts the whole models to their first N layers
(memory).

    python benchmarks/moe_decode.py [--models mixtral-8x7b qwen3-30b-a3b]
        [--formats bf16 fp8 int8] [--model-formats bf16 fp8] [--graphs-only]
        [--device cuda|cpu] [--layers N] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir

COPY_BANDWIDTH = 4.1e12  # bytes/s, read + write, measured on the H200 (docs/performance.md)
# (experts, top-k, hidden, expert channels) of one layer of each model.
LAYER_SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
FORMATS = ("bf16", "fp8", "int8")


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


def _wall_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def layer_experts(experts: int, hidden: int, inter: int, fmt: str, device: str,
                  gen: torch.Generator) -> tuple[tuple, int]:
    """(w13, w2, w13_scale, w2_scale) of one layer in `fmt`, in the form the device runs,
    and the bytes of one expert."""
    from radixlm.runtime.models.quantization.experts import dequantize_experts, quantize_experts

    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16,
                      generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16,
                     generator=gen) * 0.02
    if fmt == "bf16":
        return (w13, w2, None, None), 3 * hidden * inter * 2
    q13, s13 = quantize_experts(w13, fmt, torch.bfloat16)
    del w13
    q2, s2 = quantize_experts(w2, fmt, torch.bfloat16)
    del w2
    if device == "cpu" and fmt == "fp8":  # the CPU's form (no fast fp8 product there)
        return ((dequantize_experts(q13, s13, torch.bfloat16),
                 dequantize_experts(q2, s2, torch.bfloat16), None, None),
                3 * hidden * inter * 2)
    return (q13, q2, s13, s2), 3 * hidden * inter + 4 * (2 * inter + hidden)


def layer_rows(name: str, token_counts: list[int], reps: int, fmt: str,
               device: str) -> list[dict]:
    from radixlm.runtime.models.layers.moe import grouped_moe, route_top_k

    experts, top_k, hidden, inter = LAYER_SHAPES[name]
    gen = torch.Generator(device=device).manual_seed(0)
    (w13, w2, s13, s2), expert_bytes = layer_experts(experts, hidden, inter, fmt, device, gen)
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(tokens, experts, device=device, generator=gen)
        weights, ids = route_top_k(logits, top_k, renormalize=True)
        active = int(ids.unique().numel())
        active_bytes = active * expert_bytes
        row = {"model": name, "format": fmt, "tokens": tokens, "active_experts": active,
               "active_bytes": active_bytes}
        if device == "cpu":
            ms = _wall_ms(lambda: grouped_moe(x, w13, w2, weights, ids, s13, s2), reps)
            row |= {"grouped_ms": ms, "gb_per_s": active_bytes / ms / 1e6}
            print(f"{name:14s} {fmt:4s} T={tokens:3d} experts {active:3d}  "
                  f"{active_bytes / 1e6:7.1f} MB  grouped {ms:7.3f} ms "
                  f"({active_bytes / ms / 1e6:5.1f} GB/s)", flush=True)
            rows.append(row)
            continue
        from radixlm.kernels.fused_moe import fused_moe

        floor_ms = 1e3 * active_bytes / COPY_BANDWIDTH
        graph = capture(lambda: fused_moe(x, w13, w2, weights, ids, s13, s2))
        fused_ms = median_replay_ms(graph, reps)
        grouped_ms = _events_ms(lambda: grouped_moe(x, w13, w2, weights, ids, s13, s2), reps)
        err = (fused_moe(x, w13, w2, weights, ids, s13, s2).float()
               - grouped_moe(x, w13, w2, weights, ids, s13, s2).float()).abs().max().item()
        row |= {"floor_ms": floor_ms, "fused_graph_ms": fused_ms,
                "grouped_eager_ms": grouped_ms, "fused_ratio_to_floor": fused_ms / floor_ms,
                "max_abs_diff": err}
        rows.append(row)
        print(f"{name:14s} {fmt:4s} T={tokens:3d} experts {active:3d}  floor {floor_ms:6.3f} ms"
              f"  fused {fused_ms:6.3f} ms ({fused_ms / floor_ms:4.2f}x)  grouped "
              f"{grouped_ms:7.3f} ms  |diff| {err:.1e}", flush=True)
    return rows


def active_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every weight but the embedding table (gathered one
    row), with each expert tensor counted at top_k / num_experts. On the CPU, quantized
    linears hold their weights as buffers (cpu_weights; a batched-step copy is not read)."""
    from radixlm.runtime.models.layers.moe import FusedMoE
    from radixlm.runtime.models.quantization.cpu_weights import CpuWeights

    total = 0
    embed = model.model.embed_tokens.weight
    tied = model.lm_head is None
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, CpuWeights):
            tensors += list(module.buffers(recurse=False))
        for param in tensors:
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


def model_rows(name: str, device: str, fmt: str, graphs_only: bool,
               layers: int | None) -> list[dict]:
    from radixlm.runtime import Engine
    from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS

    model, folder = name, None
    if layers is not None:  # a config folder of the preset cut to its first layers
        folder = tempfile.TemporaryDirectory()
        config = dict(ARCHITECTURE_PRESETS[name], num_hidden_layers=layers)
        (Path(folder.name) / "config.json").write_text(json.dumps(config))
        model = folder.name
    engine = Engine(model, load_format="dummy", device=device, dtype="bfloat16",
                    quantization=None if fmt == "bf16" else fmt, max_running_requests=1,
                    max_total_tokens=4096, disable_radix_cache=True)
    net = engine.core.runner.model
    active = active_bytes_per_token(net)
    floor_ms = 1e3 * active / COPY_BANDWIDTH
    prompt = list(range(100, 132))
    rows = []
    graphs = device == "cuda" and engine.core.runner.cuda_graphs is not None
    runs = [("cuda graphs, fused" if graphs else "eager", None)]
    if graphs and not graphs_only:  # then eager, then the grouped path
        runs += [("eager, fused", "eager"), ("eager, grouped torch", "grouped")]
    for label, change in runs:
        if change == "eager":
            engine.core.runner.cuda_graphs = None  # the engine thread is idle between calls
        elif change == "grouped":
            net.use_fused_kernels(False)
        ms = decode_ms(engine, prompt, (8, 40) if device == "cpu" else (16, 80))
        row = {"model": name, "format": fmt, "layers": layers, "run": label,
               "decode_ms_per_token": ms, "active_bytes": active}
        if device == "cuda":
            row |= {"floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms}
            note = f"floor {floor_ms:6.2f} ms ({ms / floor_ms:4.2f}x)"
        else:
            row |= {"gb_per_s": active / ms / 1e6}
            note = f"{active / 1e9:5.2f} GB active ({active / ms / 1e6:5.1f} GB/s)"
        rows.append(row)
        print(f"{name:14s} {fmt:4s} {label:22s} {ms:7.2f} ms/token  {note}", flush=True)
    engine.close()
    del engine, net
    if folder is not None:
        folder.cleanup()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(LAYER_SHAPES))
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS,
                        help="expert formats of the layer timings (none: skip)")
    parser.add_argument("--model-formats", nargs="*", default=["bf16", "fp8"],
                        choices=FORMATS, help="formats of the whole-model runs (none: skip)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--graphs-only", action="store_true",
                        help="whole models: the CUDA-graph run only (no eager runs)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=None,
                        help="whole models cut to their first N layers")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    today = datetime.date.today().isoformat()
    machine = ({"gpu": torch.cuda.get_device_name()} if args.device == "cuda" else
               {"cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads()})
    kind = "h200" if args.device == "cuda" else "cpu"
    out = Path(args.out) if args.out else results_dir() / f"moe_decode_{kind}_{today}.json"
    result = {"benchmark": "moe_decode", "date": today, "device": args.device,
              "machine": machine | {"torch": torch.__version__},
              "copy_bandwidth": COPY_BANDWIDTH, "layers": [], "models": []}

    def save() -> None:  # after every part: an interrupted run keeps what it measured
        out.write_text(json.dumps(result, indent=2))

    for fmt in args.formats:
        for name in args.models:
            result["layers"] += layer_rows(name, args.tokens, args.reps, fmt, args.device)
            save()
    for fmt in args.model_formats:
        for name in args.models:
            result["models"] += model_rows(name, args.device, fmt, args.graphs_only,
                                           args.layers)
            save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
