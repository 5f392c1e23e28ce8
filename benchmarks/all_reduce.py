"""All-reduce latency inside CUDA graphs, the way tensor-parallel decode issues it.

A tensor-parallel decode step of a Llama model all-reduces its [batch, hidden] activations
twice per layer (after the attention output and the MLP down projection), inside the step's
CUDA graph. At small batch each one moves a few KB, so it is latency-bound: this script replays
`--count` back-to-back all-reduces in one graph, per row count, with:

- `nccl`: torch.distributed's NCCL all_reduce, in place (what the engine uses);
- `symm-one-shot`: PyTorch symmetric memory, one-shot (every rank reads all peers' buffers
  over NVLink and sums): a copy into the symmetric buffer, then one kernel;
- `symm-two-shot`: symmetric memory, two-shot (reduce-scatter then all-gather), in place.

Each variant is checked for the right sum before it is timed. The bandwidth column is the
algorithm bandwidth (bytes of one rank's tensor / time), next to NVLink's ~450 GB/s per
direction per H200. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set): no multimem
variants.

    python benchmarks/all_reduce.py [--world 2] [--hidden 4096] [--rows 1 8 32 128 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixlm.runtime.distributed.groups import free_port

from gpu_timing import capture, median_replay_ms
from results_dir import results_dir

NVLINK_GBPS = 450.0  # per direction, per GPU (H200: 900 GB/s bidirectional)


def _variants(rows: int, hidden: int, group: str) -> dict[str, Callable[[], torch.Tensor]]:
    """Each variant: a closure over its fixed buffers that all-reduces x and returns the sum."""
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    variants: dict[str, Any] = {"nccl": (x, lambda: dist.all_reduce(x) or x)}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(rows * hidden, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, group)
        view = buf.view(rows, hidden)
        out = torch.empty_like(x)

        def one_shot() -> torch.Tensor:
            view.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group, out)
            return out

        def two_shot() -> torch.Tensor:
            view.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group)
            return view

        variants["symm-one-shot"] = (x, one_shot)
        variants["symm-two-shot"] = (x, two_shot)
    except Exception as exc:  # noqa: BLE001 - reported, the NCCL row still runs
        variants["symm-one-shot"] = variants["symm-two-shot"] = (None, repr(exc))
    return variants


def _time_graph(fn: Callable[[], torch.Tensor], count: int, reps: int) -> float:
    """µs per call of fn, from a graph of `count` calls replayed by every rank together."""
    def together() -> None:
        dist.barrier()
        torch.cuda.synchronize()
    return median_replay_ms(capture(fn, count), reps, before=together) * 1e3 / count


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    rows_out = []
    for rows in args.rows:
        for name, (x, fn) in _variants(rows, args.hidden, group).items():
            row = {"variant": name, "rows": rows, "bytes": rows * args.hidden * 2}
            if x is None:
                row["error"] = fn
                rows_out.append(row)
                continue
            try:
                x.fill_(rank + 1)
                got = fn()
                torch.cuda.synchronize()
                expected = world * (world + 1) / 2
                if not torch.all(got == expected):
                    raise AssertionError(f"wrong sum: {got.flatten()[:4].tolist()}")
                row["us"] = round(_time_graph(fn, args.count, args.reps), 2)
                row["algbw_GBps"] = round(row["bytes"] / row["us"] / 1e3, 1)
            except Exception as exc:  # noqa: BLE001 - one variant failing is a result
                row["error"] = repr(exc)[:300]
            rows_out.append(row)
    if rank == 0:
        queue.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--count", type=int, default=65, help="all-reduces per graph "
                        "(a Llama-3-8B step: 2 per layer + 1)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue))
             for r in range(args.world)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    print(f"{'variant':>14} {'rows':>5} {'bytes':>8} {'µs':>8} {'GB/s':>7} {'/NVLink':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:>14} {r['rows']:>5} {r['bytes']:>8}  error: {r['error'][:80]}")
            continue
        print(f"{r['variant']:>14} {r['rows']:>5} {r['bytes']:>8} {r['us']:>8.2f} "
              f"{r['algbw_GBps']:>7.1f} {r['algbw_GBps'] / NVLINK_GBPS:>8.1%}")
    gpu = torch.cuda.get_device_name(0)
    record = {"benchmark": "all_reduce", "date": str(datetime.date.today()),
              "machine": {"gpu": gpu, "gpus": args.world, "torch": torch.__version__,
                          "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
              "env": {k: v for k, v in os.environ.items()
                      if k.startswith(("NCCL_", "TORCH_SYMM_MEM"))},
              "config": {"hidden": args.hidden, "count": args.count, "dtype": "bfloat16"},
              "results": rows}
    device = "h200" if "H200" in gpu else "gpu"
    out = Path(args.out or results_dir() /
               f"all_reduce_{device}x{args.world}_{datetime.date.today()}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
