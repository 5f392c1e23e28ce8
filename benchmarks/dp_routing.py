"""Data parallelism on Ray: routing policies against one engine, and a replica killed under load.

Each setting is a fresh `radixlm serve` (fresh caches) on this machine:
  single        --dp 1: one engine (all the machine's threads)
  round_robin   --dp 2 --router round_robin
  least_load    --dp 2 --router least_load
  cache_aware   --dp 2 --router cache_aware
The workload (the default model, real text): 8 groups x 8 requests, each group sharing a
~500-token system prompt (as benchmarks/prefix_sharing.py), sent in a seeded random order by
8, then 16, concurrent streaming clients (each count a run of every setting). Reported:
prefill tokens computed over all replicas (against the single engine's: a router that scatters
a group computes its prefix on both replicas), output tokens/s, time to first token.

Failure run (--dp 2 cache_aware, 4 running requests per replica): 48 requests of 96 tokens
from 12 clients (every third one streamed); 4 s in, one replica's process is killed. Counted:
requests completed, failed with an error (those that had started may), hung (no answer in
120 s: must be none), rerun on the other replica, and the time until Ray's replacement had
loaded its engine and was serving.

    python benchmarks/dp_routing.py [--settings single cache_aware ...] [--no-failure]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import signal
import statistics
import time
from pathlib import Path
from typing import Callable

import aiohttp

from radixlm.backends.server_process import ServerProcess

from prefix_sharing import ideal_prefill, shared_prefix_prompts
from results_dir import results_dir

SETTINGS = ("single", "round_robin", "least_load", "cache_aware")
CLIENT_TIMEOUT = 120.0  # seconds; a request without an answer by then counts as hung


async def _request(session: aiohttp.ClientSession, url: str, ids: list[int], new_tokens: int,
                   stream: bool) -> dict:
    """One /generate call: its outcome, time to first token, tokens and cached tokens."""
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                "ignore_eos": True}}
    start = time.perf_counter()
    result = {"outcome": "ok", "ttft": None, "tokens": 0, "cached": 0, "streamed": stream}
    try:
        async with session.post(url + "/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT)) as resp:
            if not stream:
                data = await resp.json()
                if resp.status != 200:
                    return {**result, "outcome": "error", "status": resp.status,
                            "message": data.get("error", {}).get("message", "")}
                result["ttft"] = time.perf_counter() - start  # no stream: the whole reply
                result["tokens"] = len(data["output_ids"])
                result["cached"] = data["meta_info"].get("cached_tokens", 0)
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return {**result, "outcome": "error", "status": resp.status,
                            "message": event["error"].get("message", "")}
                if event.get("output_ids") and result["ttft"] is None:
                    result["ttft"] = time.perf_counter() - start
                result["tokens"] = len(event.get("output_ids", []))
                result["cached"] = event.get("meta_info", {}).get("cached_tokens", 0)
    except asyncio.TimeoutError:
        return {**result, "outcome": "hung"}
    except aiohttp.ClientError as exc:
        return {**result, "outcome": "error", "message": str(exc)}
    return result


async def _drive(url: str, prompts: list[list[int]], new_tokens: int, clients: int,
                 stream: Callable[[int], bool], started: asyncio.Event | None = None) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for i, ids in enumerate(prompts):
        queue.put_nowait((i, ids))
    results: list[dict | None] = [None] * len(prompts)

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i, ids = queue.get_nowait()
            results[i] = await _request(session, url, ids, new_tokens, stream(i))

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:
        if started is not None:
            started.set()
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return [r for r in results if r is not None]


def _stats(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as response:
        return json.loads(response.read())["stats"]


def _server_args(setting: str, args: argparse.Namespace) -> list[str]:
    common = ["--dtype", args.dtype, "--max-total-tokens", str(args.max_total_tokens)]
    if setting == "single":
        return common
    return [*common, "--dp", "2", "--router", setting]


def run_setting(setting: str, prompts: list[list[int]], clients: int,
                args: argparse.Namespace) -> dict:
    with ServerProcess(_server_args(setting, args), startup_timeout=600) as server:
        warm = [[1, 2, 3, 4 + i] for i in range(4)]  # first forwards on every replica
        asyncio.run(_drive(server.url, warm, 2, 4, lambda i: False))
        before = _stats(server.url)
        start = time.perf_counter()
        results = asyncio.run(_drive(server.url, prompts, args.new_tokens, clients,
                                     lambda i: True))
        seconds = time.perf_counter() - start
        after = _stats(server.url)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    tokens = sum(r["tokens"] for r in results)
    per_replica = [r["prefill_tokens_computed"] for r in after.get("replicas", [after])]
    return {"seconds": seconds,
            "prefill_tokens_computed": after["prefill_tokens_computed"]
            - before["prefill_tokens_computed"],
            "prefill_per_replica_total": per_replica,
            "cached_tokens": sum(r["cached"] for r in results),
            "prompt_tokens": sum(len(p) for p in prompts),
            "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "requests_per_s": len(results) / seconds,
            "mean_ttft_s": statistics.fmean(ttfts), "p50_ttft_s": ttfts[len(ttfts) // 2],
            "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "errors": sum(r["outcome"] != "ok" for r in results)}


def run_failure(args: argparse.Namespace) -> dict:
    """Kill replica 0 under load; count what became of each request."""
    prompts = [[1, 700 + i, 800 + i, 900 + i] for i in range(48)]
    # Four requests run at once per replica, the rest wait: a lost replica has both.
    server_args = [*_server_args("cache_aware", args), "--max-running-requests", "4"]
    with ServerProcess(server_args, startup_timeout=600) as server:
        pids = {int(i): int(p) for i, p in
                re.findall(r"engine replica (\d) ready: pid (\d+)", server.log_text())}

        async def scenario() -> list[dict]:
            started = asyncio.Event()
            load = asyncio.ensure_future(_drive(server.url, prompts, 96, 12,
                                                lambda i: i % 3 == 0, started))
            await started.wait()
            await asyncio.sleep(4.0)
            os.kill(pids[0], signal.SIGKILL)
            return await load

        results = asyncio.run(scenario())
        deadline = time.monotonic() + 300
        while "engine replica 0 replaced" not in server.log_text() and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        replaced = re.search(r"engine replica 0 replaced in ([\d.]+) s", server.log_text())
        resubmitted = server.log_text().count("resubmitted after replica 0 was lost")
        after = asyncio.run(_drive(server.url, [[1, 5, 6, 7 + i] for i in range(8)], 8, 4,
                                   lambda i: False))
    outcomes = [r["outcome"] for r in results]
    return {"requests": len(results), "completed": outcomes.count("ok"),
            "failed_streamed": sum(r["outcome"] == "error" and r["streamed"] for r in results),
            "failed_not_streamed": sum(r["outcome"] == "error" and not r["streamed"]
                                       for r in results),
            "hung": outcomes.count("hung"), "rerun_on_the_other_replica": resubmitted,
            "replacement_s": float(replaced.group(1)) if replaced else None,
            "served_after_replacement": sum(r["outcome"] == "ok" for r in after),
            "error_messages": sorted({r.get("message", "") for r in results
                                      if r["outcome"] == "error"})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS,
                        help="none: the failure run only")
    parser.add_argument("--no-failure", action="store_true", help="skip the failure run")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 16],
                        help="concurrent clients; each count is a run of every setting")
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from radixlm.runtime.models.loader import resolve_model

    folder = resolve_model(None)
    groups = shared_prefix_prompts(AutoTokenizer.from_pretrained(str(folder)))  # 8 x 8
    ideal = ideal_prefill(groups, per_group=8)
    # Arrivals in a seeded random order: the groups' requests interleave, as from independent
    # users (a fixed interleave would let round-robin keep each group on one replica).
    prompts = list(groups)
    random.Random(0).shuffle(prompts)
    results = {f"{setting} / {clients}": run_setting(setting, prompts, clients, args)
               for clients in args.clients for setting in args.settings}
    failure = None if args.no_failure else run_failure(args)

    print(f"\nSmolLM2-135M-Instruct, {args.dtype}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}; 64 requests (8 groups x 8 sharing ~500 tokens), "
          f"{args.new_tokens} new tokens; ideal prefill {ideal}")
    print(f"{'setting / clients':<20}{'prefill computed':>17}{'x single':>10}{'tokens/s':>10}"
          f"{'req/s':>8}{'mean TTFT':>11}{'p99 TTFT':>10}")
    for name, r in results.items():
        base = results.get(f"single / {name.split(' / ')[1]}", {}).get("prefill_tokens_computed")
        ratio = f"{r['prefill_tokens_computed'] / base:.2f}" if base else "-"
        print(f"{name:<20}{r['prefill_tokens_computed']:>17}{ratio:>10}"
              f"{r['output_tokens_per_s']:>10.1f}{r['requests_per_s']:>8.2f}"
              f"{r['mean_ttft_s']:>10.2f}s{r['p99_ttft_s']:>9.2f}s")
    if failure is not None:
        print(f"failure: {failure['requests']} requests, {failure['completed']} completed, "
              f"{failure['failed_streamed']} streamed and {failure['failed_not_streamed']} "
              f"unstreamed failed, {failure['hung']} hung, "
              f"{failure['rerun_on_the_other_replica']} rerun on the other replica; replaced "
              f"in {failure['replacement_s']} s; {failure['served_after_replacement']}/8 "
              f"served after")

    record = {"benchmark": "dp_routing", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "cpus": os.cpu_count()},
              "config": {"model": "smollm2-135m-instruct", "dtype": args.dtype,
                         "new_tokens": args.new_tokens, "clients": args.clients,
                         "requests": len(prompts), "replicas": 2},
              "ideal_prefill": ideal, "results": results, "failure": failure}
    out = Path(args.out or results_dir() / f"dp_routing_cpu_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
