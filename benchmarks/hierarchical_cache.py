"""The prefix cache's disk tier on the CPU: a long document prefix (Python's documentation, from
`pydoc_data`), its time to first token in a freshly started engine that finds the prefix on
disk, against computing it again (no tier: what a restart costs today). The floor is the
prefix's KV bytes over the disk's read bandwidth, measured in the same run on the tier's own
files.

Each round starts new engines: one writes the prefix to the tier, then (a restart) one with the
tier and one without answer the same questions; rounds alternate the order. The OS page cache
is dropped before each timed load when the process may (root on Linux): the load then reads
the disk, not memory; the JSON says whether it could.

The tier writes every page the cache takes (write-through): its cost is measured too, as the
throughput of a batch of distinct prompts and long outputs (every page new) with the tier and
without, alternating.

    python benchmarks/hierarchical_cache.py --doc-tokens 4096
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

from radixlm.runtime import Engine

from results_dir import results_dir


def document(engine: Engine, tokens: int) -> str:
    """About `tokens` tokens of documentation text."""
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return engine.tokenizer.decode(ids)


def drop_page_cache() -> bool:
    """Drop the OS page cache (so reads come from the disk); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_read_bandwidth(folder: Path) -> float:
    """Bytes per second reading every file under `folder` once, after dropping the cache."""
    paths = [p for p in folder.rglob("*.kv")]
    drop_page_cache()
    start = time.perf_counter()
    size = sum(len(p.read_bytes()) for p in paths)
    return size / (time.perf_counter() - start)


def ttft(engine: Engine, prompt: str) -> tuple[float, int, list[int]]:
    start = time.perf_counter()
    out = engine.generate(prompt, {"max_new_tokens": 1, "temperature": 0})
    return time.perf_counter() - start, out.cached_tokens, out.token_ids


def write_through_cost(doc: str, options: dict, folder: Path, rounds: int) -> dict:
    """Tokens/s of 8 distinct prompts x 256 new tokens, with the tier (an empty folder each
    time: every page is written) and without; medians of alternating rounds."""
    prompts = [f"Note {i}: " + doc[i * 997:i * 997 + 2000] for i in range(8)]
    params = {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True}
    rates: dict[str, list[float]] = {"tier": [], "none": []}
    for round_ in range(rounds):
        for kind in (("tier", "none") if round_ % 2 == 0 else ("none", "tier")):
            shutil.rmtree(folder, ignore_errors=True)
            extra = {"disk_cache_dir": str(folder)} if kind == "tier" else {}
            with Engine(**options, **extra) as engine:
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                elapsed = time.perf_counter() - start
                rates[kind].append(sum(len(o.token_ids) for o in outs) / elapsed)
    tier, none = statistics.median(rates["tier"]), statistics.median(rates["none"])
    return {"tokens_per_s_tier": tier, "tokens_per_s_none": none, "ratio": tier / none}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="radixlm-disk-tier-"))
    options = {"max_total_tokens": args.doc_tokens * 2 + 1024}
    with Engine(**options) as probe:
        doc = document(probe, args.doc_tokens)
    rows = []
    dropped = True
    try:
        for round_ in range(args.rounds):
            shutil.rmtree(folder, ignore_errors=True)
            with Engine(**options, disk_cache_dir=str(folder)) as writer:
                writer.generate(doc + "\n\nSummarize.", {"max_new_tokens": 1})
            question = f"\n\nQuestion {round_}: what is this about?"
            order = ["disk", "recompute"] if round_ % 2 == 0 else ["recompute", "disk"]
            row = {"round": round_}
            for kind in order:
                extra = {"disk_cache_dir": str(folder)} if kind == "disk" else {}
                with Engine(**options, **extra) as engine:
                    dropped = drop_page_cache() and dropped
                    seconds, cached, tokens = ttft(engine, doc + question)
                    row[kind] = {"ttft_s": seconds, "cached_tokens": cached, "tokens": tokens}
                    if kind == "disk":
                        stats = engine.stats()
                        row["load_bytes"] = stats["disk_load_bytes"]
                        row["load_seconds"] = stats["disk_load_seconds"]
            assert row["disk"]["tokens"] == row["recompute"]["tokens"], "outputs differ"
            rows.append(row)
        bandwidth = disk_read_bandwidth(folder)
        cost = write_through_cost(doc, options, folder, args.rounds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    disk = statistics.median(r["disk"]["ttft_s"] for r in rows)
    recompute = statistics.median(r["recompute"]["ttft_s"] for r in rows)
    load_bytes = rows[-1]["load_bytes"]
    load_bw = statistics.median(r["load_bytes"] / r["load_seconds"] for r in rows)
    floor = load_bytes / bandwidth
    summary = {"doc_tokens": args.doc_tokens, "disk_hit_tokens": rows[-1]["disk"]["cached_tokens"],
               "ttft_disk_s": disk, "ttft_recompute_s": recompute, "ratio": disk / recompute,
               "kv_bytes": load_bytes, "load_bandwidth_bps": load_bw,
               "disk_read_bandwidth_bps": bandwidth, "floor_s": floor,
               "page_cache_dropped": dropped, "write_through": cost}
    print(f"{'prefix':<34}{args.doc_tokens} tokens, {load_bytes / 1e6:.1f} MB of KV "
          f"({summary['disk_hit_tokens']} tokens loaded)")
    print(f"{'TTFT after a restart, disk tier':<34}{disk * 1e3:>9.1f} ms")
    print(f"{'TTFT after a restart, recompute':<34}{recompute * 1e3:>9.1f} ms   "
          f"ratio {disk / recompute:.3f}x (goal <= 0.2x)")
    print(f"{'load bandwidth':<34}{load_bw / 1e9:>9.2f} GB/s   disk read "
          f"{bandwidth / 1e9:.2f} GB/s (page cache {'dropped' if dropped else 'NOT dropped'})")
    print(f"{'floor: KV bytes / disk bandwidth':<34}{floor * 1e3:>9.1f} ms")
    print(f"{'write-through: batch tokens/s':<34}{cost['tokens_per_s_tier']:>9.1f}   without "
          f"the tier {cost['tokens_per_s_none']:.1f} ({cost['ratio']:.3f}x)")
    today = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"hierarchical_cache_cpu_{today}.json")
    out.write_text(json.dumps({"date": today, "machine": platform.processor()
                               or platform.machine(), "cpus": os.cpu_count(),
                               "summary": summary, "rounds": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
