"""The prefix cache's host-memory tier: multi-turn conversations whose distinct context is
several times the device's KV pool, revisited in random order, on an engine with the device
cache only, with the host tier, and (with --disk-dir) with host memory above the disk, in one
run.

Each conversation has a context of its own (`--context-tokens` of distinct token ids) and a
history that grows by a question and an answer per turn; each round visits every conversation
once, in a new random order, as one batch (the engine runs `max_running_requests` at a time).
`--workload qa` is long-document question answering instead: each context is a document, and
each round asks every document a new question after the document alone (the history does not
grow, so the whole prompt but the question is the document's cached KV).
With the device cache only, a conversation's context has been evicted by the time it comes
back and is computed again; with the host tier it is loaded back over PCIe. Reported per
setting: wall time, requests/s and generated tokens/s over the rounds after the first (the
first computes every context in every setting), time to first token (p50, p99), the prompt
tokens served from a cache, and the floor of the loads: the bytes loaded over the bandwidth
of a host-to-device copy from pinned memory measured in the same run (on a CPU: a memory
copy), the least time the copies take, against the rounds' time.

    python benchmarks/kv_tiers.py --engine-options '{"model": "llama-3-8b", "load_format":
        "dummy", "device": "cuda", "tokenizer": "..."}' --pool-tokens 32768 \\
        --conversations 64 --context-tokens 2048 --host-gb 24
    python benchmarks/kv_tiers.py --workload qa --engine-options '{...}' --pool-tokens 32768 \\
        --conversations 16 --context-tokens 7168 --host-gb 24   # 16 documents, 3.5x the pool
    python benchmarks/kv_tiers.py --pool-tokens 2048 --conversations 8 --context-tokens 512 \\
        --turns 2 --new-tokens 8 --host-gb 1       # the default model on the CPU, small
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime import Engine

from results_dir import results_dir


def copy_bandwidth(device: str, gib: float = 1.0) -> float:
    """Bytes/s of a host-to-device copy from pinned memory (a CPU: a memory copy)."""
    cuda = device == "cuda"
    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty_like(src, device=device)
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return src.numel() / best


def conversations(count: int, context_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """A context of distinct token ids per conversation (no two share a page)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(context_tokens)] for _ in range(count)]


def run_setting(options: dict[str, Any], contexts: list[list[int]], args: argparse.Namespace
                ) -> dict[str, Any]:
    params = {"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 0}
    histories = [list(c) for c in contexts]
    rng = random.Random(args.seed)
    rounds = []
    outputs: list[list[int]] = []
    with Engine(**options) as engine:
        engine.generate(input_ids=[[7] * 16], sampling_params={"max_new_tokens": 2})  # warm-up
        engine.flush_cache()
        for turn in range(args.turns):
            order = list(range(len(histories)))
            rng.shuffle(order)
            question = [rng.randrange(100, 1000) for _ in range(16)]
            prompts = [histories[i] + question for i in order]
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            seconds = time.perf_counter() - start
            if args.workload == "multi-turn":
                for i, out in zip(order, outs):
                    histories[i] = histories[i] + question + list(out.token_ids)
            outputs += [list(o.token_ids) for o in outs]
            rounds.append({"seconds": seconds, "requests": len(outs),
                           "prompt_tokens": sum(len(p) for p in prompts),
                           "cached_tokens": sum(o.cached_tokens for o in outs),
                           "ttft_s": sorted(o.time_to_first_token for o in outs)})
        stats = engine.stats()
    later = rounds[1:] or rounds
    ttft = sorted(t for r in later for t in r["ttft_s"])
    seconds = sum(r["seconds"] for r in later)
    requests = sum(r["requests"] for r in later)
    return {"seconds": seconds, "requests_per_s": requests / seconds,
            "generated_tokens_per_s": requests * args.new_tokens / seconds,
            "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "cached_share": (sum(r["cached_tokens"] for r in later)
                             / sum(r["prompt_tokens"] for r in later)),
            "host_hit_tokens": stats.get("host_hit_tokens", 0),
            "host_load_bytes": stats.get("host_load_bytes", 0),
            "host_load_seconds": stats.get("host_load_seconds", 0.0),
            "disk_hit_tokens": stats.get("disk_hit_tokens", 0),
            "first_round_s": rounds[0]["seconds"], "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-options", type=json.loads, default={},
                        help="JSON of further Engine options (model, device, tokenizer)")
    parser.add_argument("--pool-tokens", type=int, default=32768,
                        help="the device KV pool (max_total_tokens)")
    parser.add_argument("--workload", choices=["multi-turn", "qa"], default="multi-turn",
                        help="qa: documents asked a new question each round (no history)")
    parser.add_argument("--conversations", type=int, default=64,
                        help="conversations, or documents with --workload qa")
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--host-gb", type=float, default=24.0, help="host_cache_gb")
    parser.add_argument("--disk-dir", default=None,
                        help="also run host memory above a disk tier in a fresh folder here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = args.engine_options.get("device", "cpu")
    base = {**args.engine_options, "max_total_tokens": args.pool_tokens}
    with Engine(**base) as probe:  # the vocabulary for the contexts
        vocab = min(len(probe.tokenizer), 32000)
    contexts = conversations(args.conversations, args.context_tokens, vocab, args.seed)
    settings: dict[str, dict[str, Any]] = {
        "device cache only": base,
        "host tier": {**base, "host_cache_gb": args.host_gb}}
    folder = None
    if args.disk_dir is not None:
        folder = Path(tempfile.mkdtemp(dir=args.disk_dir, prefix="kv-tiers-"))
        settings["host tier over disk"] = {**settings["host tier"],
                                           "disk_cache_dir": str(folder)}
    floor = copy_bandwidth(device)
    results = {}
    try:
        for name, options in settings.items():
            results[name] = run_setting(options, contexts, args)
            r = results[name]
            print(f"{name:<22} {r['requests_per_s']:7.2f} req/s  TTFT p50 "
                  f"{r['ttft_p50_s'] * 1e3:7.1f} ms  cached {r['cached_share']:.0%}")
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    reference = results["device cache only"]["outputs"]
    distinct = args.conversations * args.context_tokens
    print(f"\n{distinct} distinct context tokens, {distinct / args.pool_tokens:.1f}x the pool; "
          f"host-to-device copy {floor / 1e9:.1f} GB/s")
    print(f"{'setting':<22}{'req/s':>8}{'vs device':>10}{'tok/s':>9}{'TTFT p50':>10}"
          f"{'vs device':>10}{'p99':>9}{'cached':>8}{'loaded GB':>10}{'copy floor':>11}"
          f"{'same':>6}")
    for name, r in results.items():
        dev = results["device cache only"]
        r["copy_floor_s"] = r["host_load_bytes"] / floor  # rounds 2+: round 1 loads nothing
        r["same_tokens_as_device_only"] = r["outputs"] == reference
        print(f"{name:<22}{r['requests_per_s']:>8.2f}"
              f"{r['requests_per_s'] / dev['requests_per_s']:>9.2f}x"
              f"{r['generated_tokens_per_s']:>9.0f}{r['ttft_p50_s'] * 1e3:>8.1f}ms"
              f"{r['ttft_p50_s'] / dev['ttft_p50_s']:>9.2f}x{r['ttft_p99_s'] * 1e3:>7.0f}ms"
              f"{r['cached_share']:>8.0%}{r['host_load_bytes'] / 1e9:>10.1f}"
              f"{r['copy_floor_s']:>6.2f}s{r['copy_floor_s'] / r['seconds']:>5.0%}"
              f"{str(r['same_tokens_as_device_only']):>6}")
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    record = {"benchmark": "kv_tiers", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "gpu": gpu},
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "copy_bandwidth_bytes_per_s": floor,
              "results": {k: {f: v for f, v in r.items() if f != "outputs"}
                          for k, r in results.items()}}
    workload = "" if args.workload == "multi-turn" else f"{args.workload}_"
    out = Path(args.out or results_dir() / f"kv_tiers_{workload}{device}_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
