"""Decode ms per token against batch size, beside the bandwidth floor, from one_batch.py's
JSON files (one line per file, labelled by its KV cache dtype, or --labels).

    python benchmarks/plot_decode.py benchmarks/results/one_batch_h200_2026-12-03*.json \
        --out benchmarks/results/decode_vs_floor_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="*", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, path in enumerate(args.files):
        record = json.loads(path.read_text())
        rows = sorted(record["rows"], key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        label = (args.labels[i] if args.labels else
                 f"KV {record['config'].get('kv_cache_dtype', 'auto')} ({record['date']})")
        line, = ax.plot(batches, [r["decode_ms_per_token"] for r in rows], "o-",
                        label=f"decode step, {label}")
        ax.plot(batches, [r["floor_ms"] for r in rows], "--", color=line.get_color(),
                label=f"floor (weights + KV at the copy bandwidth), {label}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{record['config']['model']} decode on {record['machine']['gpu']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
