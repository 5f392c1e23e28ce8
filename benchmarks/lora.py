"""Multi-LoRA serving: decode throughput with adapters mixed in one batch, against the base
model alone, in one run.

Random PEFT adapters (rank R, on every layer's projections: all seven by default, or those
`--targets` names, e.g. q_proj,v_proj, PEFT's default for Llama) are written for the model,
then the same batch of greedy requests runs on an engine serving them: without
adapters (the base model, the baseline: same engine, same KV pool), with 1 adapter for every
row, and with K distinct adapters spread over the rows (K up to the batch,
max_loras_per_batch = K so they all run together); and once on an engine without adapters
(its KV pool is larger: the slots take none of the memory). Reported: output tokens/s, the
prefill and decode parts, and the ratio to the base model, with the arithmetic the adapters add per
token (R (in + out) multiply-adds per projection) beside the base model's, which is what the
ratio could be at best if the updates ran as fast as the base's matmuls; and, for decode that
streams weights (the GPU), the decode bound: the base model's decode step as measured, plus
reading every distinct adapter's weights once at the card's copy bandwidth (all the updates
can cost at least that).

    python benchmarks/lora.py                                  # CPU, the embedded model
    python benchmarks/lora.py --ranks 16,64 --batch 16 --adapters 1,4,16
    python benchmarks/lora.py --engine-options '{"model": "llama-3-8b", "load_format":
        "dummy", "device": "cuda", "tokenizer": "..."}' --batch 256 --adapters 1,8,64

On a GPU the kernels are first timed alone at an 8B model's layer shapes: a step's updates
against its base products and against the floor of reading each adapter once.
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
from typing import Any

import torch
from safetensors.torch import save_file

from radixlm.runtime import Engine

from results_dir import results_dir

BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each targeted projection of a layer."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    d, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}


def write_adapter(folder: Path, cfg: Any, rank: int, seed: int, dtype: torch.dtype,
                  targets: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for name in targets:
            fan_in, fan_out = shapes(cfg)[name]
            key = f"base_model.model.model.layers.{layer}.{BLOCKS[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=gen) / rank ** 0.5 * 0.1).to(dtype)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": targets}))
    return folder


def run(engine: Engine, prompts: list[list[int]], loras: list[str | None] | None,
        new_tokens: int, warm_up: bool = False) -> dict[str, float]:
    """Output tokens/s of the batch (greedy, every request its full length), and the split:
    the batch's prefill (the same batch with one new token) and its decode tokens/s. Every
    adapter of the batch is in a slot before the clock starts (the serving steady state;
    the first use of an adapter uploads it)."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    distinct = list(dict.fromkeys(loras or [None]))
    engine.generate(input_ids=[prompts[0]] * len(distinct),
                    sampling_params={**params, "max_new_tokens": 2},
                    lora=None if loras is None else distinct)  # every slot filled
    if warm_up:  # the process's first batch of this shape compiles kernels on a GPU
        engine.generate(input_ids=prompts, sampling_params=params, lora=loras)

    def timed(new: int) -> tuple[float, int]:
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params={**params,
                                                                   "max_new_tokens": new},
                               lora=loras)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.token_ids) for o in outs)

    prefill_s, _ = timed(1)
    seconds, tokens = timed(new_tokens)
    engine.flush_cache()
    return {"tokens_per_s": tokens / seconds, "prefill_s": prefill_s,
            "decode_tokens_per_s": (tokens - len(prompts)) / max(seconds - prefill_s, 1e-9)}


def median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


# An 8B Llama's decoder layer: (in, parts' outputs) of its four linears, and the PEFT
# modules of the parts.
LAYER_8B = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]),
            "gate_up": (4096, [14336, 14336]), "down": (14336, [4096])}
PARTS = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"],
         "gate_up": ["gate_proj", "up_proj"], "down": ["down_proj"]}


def kernel_table(ranks: list[int], counts: list[int], batch: int, targets: list[str],
                 layers: int = 32) -> dict[str, Any]:
    """The GPU kernels alone (kernels/lora.py), an 8B model's layer shapes in bfloat16: one
    step's updates (the linears `targets` train, of `layers` layers, replayed as a CUDA
    graph) against
    the same step's base products, and against the floor of reading every distinct
    adapter's weights once at the card's copy bandwidth (measured here)."""
    from radixlm.kernels.lora import lora_add
    from radixlm.kernels.lora_rows import TILE_FIELDS, group_rows

    from gpu_timing import capture, median_replay_ms

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    src, dst = (torch.empty(1 << 30, dtype=torch.uint8, device=dev) for _ in range(2))
    copy_ms = median_replay_ms(capture(lambda: dst.copy_(src), 4), 5) / 4
    bandwidth = 2 * src.numel() / (copy_ms / 1e3)
    x_in = {n: torch.randn(batch, i, dtype=bf16, device=dev) for n, (i, _) in LAYER_8B.items()}
    weights = {n: torch.randn(sum(o), i, dtype=bf16, device=dev) / i ** 0.5
               for n, (i, o) in LAYER_8B.items()}
    base_ms = median_replay_ms(capture(lambda: [torch.nn.functional.linear(x_in[n], weights[n])
                                                for n in LAYER_8B], layers), 5)
    table: dict[str, Any] = {"copy_bandwidth_bytes_s": bandwidth,
                             "base_linears_ms": base_ms, "runs": {}}
    for rank in ranks:
        for count in counts:
            slots = {}
            adapter_bytes = 0
            for n, (i, parts) in LAYER_8B.items():
                trained = [rank if module in targets else 0 for module in PARTS[n]]
                if not any(trained):
                    continue  # the engine holds no slots for this linear
                width = len(parts) * rank
                cols, first = [], 0
                for size in parts:
                    cols.append([first, first + size])
                    first += size
                slots[n] = (torch.randn(count, width, i, dtype=bf16, device=dev) / i ** 0.5,
                            torch.randn(count, width, first, dtype=bf16, device=dev) / 64,
                            torch.tensor(cols, dtype=torch.int32, device=dev),
                            torch.tensor([trained] * count, dtype=torch.int32, device=dev))
                adapter_bytes += sum(r * (i + o) for r, o in zip(trained, parts)) * 2 * count
            rows, tiles = group_rows([r % count for r in range(batch)])
            rows_t = torch.tensor(rows, dtype=torch.int32, device=dev)
            tiles_t = torch.tensor(tiles, dtype=torch.int32, device=dev).view(-1, TILE_FIELDS)
            outs = {n: torch.zeros(batch, sum(o), dtype=bf16, device=dev)
                    for n, (_, o) in LAYER_8B.items()}

            def step() -> None:
                for n, (a, b, cols, part_ranks) in slots.items():
                    lora_add(x_in[n], outs[n], a, b, rows_t, tiles_t, len(tiles), part_ranks,
                             cols, rank)

            ms = median_replay_ms(capture(step, layers), 5)
            floor = layers * adapter_bytes / bandwidth * 1e3
            table["runs"][f"rank {rank}, {count} adapters"] = {
                "ms": ms, "floor_ms": floor, "vs_base_linears": ms / base_ms}
            print(f"kernels rank {rank:>3}, {count:>3} adapters: {ms:7.3f} ms per step "
                  f"(floor {floor:6.3f} ms, {floor / ms:4.0%} of it; base products "
                  f"{base_ms:6.3f} ms)")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--adapters", default="1,4,16",
                        help="distinct adapters in the batch (each also a run)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--engine-options", type=json.loads, default={},
                        help="JSON of Engine options (model, device, ...); default: the "
                             "embedded model on the CPU")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the runs in each engine (medians; for a noisy CPU)")
    parser.add_argument("--targets", default=",".join(BLOCKS),
                        help="the projections the adapters train (default: all seven)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in BLOCKS]
    if unknown:
        parser.error(f"--targets: {unknown} are not among {', '.join(BLOCKS)}")
    ranks = [int(r) for r in args.ranks.split(",")]
    counts = [int(k) for k in args.adapters.split(",")]
    options = {"device": "cpu", **args.engine_options}
    device = options["device"]
    gen = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {}
    kernels = None
    if device == "cuda":
        try:
            kernels = kernel_table(ranks, counts, args.batch, targets)
        except Exception as exc:  # noqa: BLE001 - recorded; the engine runs still tell
            print(f"kernel timing failed: {exc!r}")
            kernels = {"error": repr(exc)}
    bandwidth = (kernels or {}).get("copy_bandwidth_bytes_s")
    with tempfile.TemporaryDirectory() as tmp:
        with Engine(**options) as probe:
            cfg = probe.model_config
            prompts = [torch.randint(100, cfg.vocab_size - 100, (args.prompt_tokens,),
                                     generator=gen).tolist() for _ in range(args.batch)]
            results["base"] = run(probe, prompts, None, args.new_tokens, warm_up=True)
            dtype = probe.dtype
        print(f"base model              {results['base']['tokens_per_s']:9.1f} tokens/s")
        base_macs = sum(i * o for i, o in shapes(cfg).values())
        for rank in ranks:
            # At most 8 distinct files; more adapters reuse them under other names (each
            # name is its own adapter and slot to the engine).
            files = [write_adapter(Path(tmp) / f"r{rank}-{i}", cfg, rank, i, dtype, targets)
                     for i in range(min(8, max(counts)))]
            names = [f"r{rank}-{k}" for k in range(max(counts))]
            modules = [f"{name}={files[k % len(files)]}" for k, name in enumerate(names)]
            with Engine(**options, lora_modules=modules, max_loras_per_batch=max(counts),
                        max_lora_rank=rank) as engine:
                # Rounds alternate the base and each adapter count, so that a machine's
                # drift moves them alike; each figure is the median of its rounds.
                rounds: dict[int, list[dict[str, float]]] = {0: [], **{c: [] for c in counts}}
                for _ in range(args.repeats):
                    rounds[0].append(run(engine, prompts, None, args.new_tokens))
                    for count in counts:
                        rounds[count].append(run(engine, prompts,
                                                 [names[i % count] for i in range(args.batch)],
                                                 args.new_tokens))
                base = results[f"rank {rank} engine, no adapter"] = median(rounds[0])
                for count in counts:
                    timing = median(rounds[count])
                    tps = timing["tokens_per_s"]
                    key = f"rank {rank}, {count} adapter{'s' if count > 1 else ''}"
                    # Per token per layer: u = A x over every part, B u over every output.
                    extra = sum(rank * (i + o) for name, (i, o) in shapes(cfg).items()
                                if name in targets)
                    adapter_bytes = extra * cfg.num_layers * dtype.itemsize
                    results[key] = {"rank": rank, "adapters": count, **timing,
                                    "vs_base": tps / base["tokens_per_s"],
                                    "decode_vs_base": timing["decode_tokens_per_s"]
                                    / base["decode_tokens_per_s"],
                                    "prefill_vs_base": base["prefill_s"] / timing["prefill_s"],
                                    "extra_macs_share": extra / base_macs}
                    if bandwidth:  # a CPU step is bound by compute, not these bytes
                        step_s = args.batch / base["decode_tokens_per_s"]
                        results[key]["decode_bound"] = step_s / (
                            step_s + count * adapter_bytes / bandwidth)
                    print(f"{key:<24}{tps:9.1f} tokens/s  {results[key]['vs_base']:5.2f}x base"
                          f" (decode {results[key]['decode_vs_base']:4.2f}x, prefill "
                          f"{results[key]['prefill_vs_base']:4.2f}x; "
                          f"+{extra / base_macs:.1%} multiply-adds)")
            if device == "cuda":  # a closed engine gives its memory back to the next one
                print(f"after closing it: {torch.cuda.memory_allocated() / 2**30:.2f} GiB "
                      "still allocated")
    bound = bool(bandwidth)
    print(f"\n{'run':<24}{'tokens/s':>10}{'vs base':>9}{'decode':>8}{'prefill':>9}{'+MACs':>8}"
          + (f"{'decode bound':>14}" if bound else ""))
    for key, r in results.items():
        print(f"{key:<24}{r['tokens_per_s']:>10.1f}{r.get('vs_base', 1.0):>8.2f}x"
              f"{r.get('decode_vs_base', 1.0):>7.2f}x{r.get('prefill_vs_base', 1.0):>8.2f}x"
              f"{r.get('extra_macs_share', 0.0):>8.1%}"
              + (f"{r.get('decode_bound', 1.0):>13.2f}x" if bound else ""))
    record = {"benchmark": "lora", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(),
                          "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
              "config": {"batch": args.batch, "prompt_tokens": args.prompt_tokens,
                         "new_tokens": args.new_tokens, "targets": targets,
                         "repeats": args.repeats,
                         "engine_options": options},
              "results": results, "kernels": kernels}
    out = Path(args.out or results_dir() / f"lora_{device}_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
