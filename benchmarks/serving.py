"""Online serving benchmark: a load generator for any OpenAI-compatible server.

Requests go to /v1/completions with streaming, arriving as a Poisson process at
--request-rate requests/s (inf: all at once) or kept at a fixed --concurrency. Datasets:
random prompts of random lengths, groups of prompts sharing a long prefix, or the first turn
of each conversation in a ShareGPT-format JSON file. Reported: request throughput, output
tokens/s, time to first token (TTFT), inter-token latency (ITL, the gaps between streamed
chunks) and end-to-end latency at p50/p90/p99, as a table and as JSON. While the load runs,
/health is probed to show how responsive the server stays (skipped if it has no /health).

    python benchmarks/serving.py --url http://127.0.0.1:30000 --num-prompts 64
    python benchmarks/serving.py --launch --num-prompts 64 --request-rate 2   # our own server

Token counts come from the server's `usage` (stream_options.include_usage). Prompt lengths are
given in words (about 1.3 tokens each for English text): the client needs no tokenizer.
The load generator itself uses only aiohttp; --launch starts a radixlm server for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from results_dir import results_dir

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact be have do say get "
         "make go know take see come think look want give use find tell ask seem feel try "
         "leave call good new first last long great little own other old right big high "
         "different small large next early young important few public bad same able river "
         "mountain ocean city garden music story light winter summer market letter window "
         "bridge forest engine signal memory planet history number question answer").split()


@dataclass
class Prompt:
    text: str
    max_tokens: int


@dataclass
class Result:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


# -- datasets ---------------------------------------------------------------------------------

def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, words)))


def random_dataset(args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - args.range_ratio))), mean)
    return [Prompt(random_text(rng, length(args.input_len)), length(args.output_len))
            for _ in range(args.num_prompts)]


def shared_prefix_dataset(args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    prefixes = [random_text(rng, args.prefix_len) for _ in range(args.num_groups)]
    prompts = [Prompt(f"{prefixes[i % args.num_groups]}\n{random_text(rng, args.input_len)}",
                      args.output_len) for i in range(args.num_prompts)]
    rng.shuffle(prompts)
    return prompts


def sharegpt_dataset(args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    data = json.loads(Path(args.dataset_path).read_text())
    prompts = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2 or not turns[0].get("value") or not turns[1].get("value"):
            continue
        reply_tokens = int(len(turns[1]["value"].split()) * 1.3)
        if reply_tokens < 4:
            continue
        prompts.append(Prompt(turns[0]["value"], min(reply_tokens, args.output_len)))
    rng.shuffle(prompts)
    if len(prompts) < args.num_prompts:
        raise SystemExit(f"{args.dataset_path}: only {len(prompts)} usable conversations")
    return prompts[:args.num_prompts]


DATASETS = {"random": random_dataset, "shared-prefix": shared_prefix_dataset,
            "sharegpt": sharegpt_dataset}


# -- load -------------------------------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, args: argparse.Namespace,
                      prompt: Prompt) -> Result:
    body: dict[str, Any] = {"model": args.model, "prompt": prompt.text,
                            "max_tokens": prompt.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # an extra SGLang and vLLM accept; OpenAI does not
    result = Result(ok=False, start=time.perf_counter())
    try:
        async with session.post(args.url + "/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in event.get("choices") or []):
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.chunk_times.append(now)
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
        result.end = time.perf_counter()
        result.output_tokens = result.output_tokens or len(result.chunk_times)
        result.ok = result.ttft is not None or result.output_tokens == 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args: argparse.Namespace, prompts: list[Prompt]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    rng = random.Random(args.seed + 1)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=timeout) as session:
        if not args.model:
            async with session.get(args.url + "/v1/models") as response:
                args.model = (await response.json())["data"][0]["id"]
        # Warm-up, not measured: the first request pays one-time costs.
        await one_request(session, args, Prompt("Hello", 4))
        done = asyncio.Event()
        probe = asyncio.create_task(probe_health(session, args.url, done))
        gate = asyncio.Semaphore(args.concurrency or len(prompts))

        async def limited(prompt: Prompt) -> Result:
            async with gate:
                return await one_request(session, args, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        done.set()
        health = await probe
    return summarize(results, duration, health)


async def probe_health(session: aiohttp.ClientSession, url: str,
                       done: asyncio.Event) -> list[float]:
    latencies: list[float] = []
    while not done.is_set():
        start = time.perf_counter()
        try:
            async with session.get(url + "/health") as response:
                if response.status == 404:
                    return []
                await response.read()
            latencies.append(time.perf_counter() - start)
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    return latencies


# -- report -----------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"mean": sum(values) / len(values), "p50": pick(0.5), "p90": pick(0.9),
            "p99": pick(0.99)}


def summarize(results: list[Result], duration: float, health: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output,
        "request_throughput": len(ok) / duration,
        "output_throughput": output / duration,
        "total_token_throughput": (output + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itls]),
        "e2e_latency_s": percentiles([r.end - r.start for r in ok]),
        "health_latency_s": percentiles(health),
    }


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n{'completed / failed':<28}{summary['completed']} / {summary['failed']}")
    for error in summary["errors"]:
        print(f"  error: {error}")
    print(f"{'duration (s)':<28}{summary['duration_s']:.2f}")
    print(f"{'prompt / output tokens':<28}{summary['prompt_tokens']} / "
          f"{summary['output_tokens']}")
    print(f"{'requests/s':<28}{summary['request_throughput']:.3f}")
    print(f"{'output tokens/s':<28}{summary['output_throughput']:.1f}")
    print(f"{'total tokens/s':<28}{summary['total_token_throughput']:.1f}")
    print(f"\n{'latency (ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_latency_s", "end-to-end"),
                      ("health_latency_s", "/health under load")):
        row = summary[key]
        print(f"{name:<20}" + "".join(f"{row[q] * 1e3:>10.1f}"
                                      for q in ("mean", "p50", "p90", "p99")))


async def server_info(url: str, api_key: str | None) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(url + "/get_server_info") as response:
                if response.status == 200:
                    info = await response.json()
                    return {"engine_config": info.get("engine_config"),
                            "stats": info.get("stats")}
    except aiohttp.ClientError:
        pass
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--launch", action="store_true",
                        help="start a radixlm server for the run (--url is then ignored)")
    parser.add_argument("--server-args", default="--max-total-tokens 65536",
                        help="flags for the launched server")
    parser.add_argument("--model", default=None, help="model id sent (default: /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (max)")
    parser.add_argument("--output-len", type=int, default=64, help="max tokens (max)")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="random lengths are drawn from [len * (1 - ratio), len]")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix words")
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix groups")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (default: all at once)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (for servers that reject it)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default=None, help="machine description for the JSON")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    if args.dataset == "sharegpt" and not args.dataset_path:
        parser.error("--dataset sharegpt needs --dataset-path")
    prompts = DATASETS[args.dataset](args, random.Random(args.seed))

    server = None
    if args.launch:
        from radixlm.runtime.server.process import ServerProcess

        server = ServerProcess(shlex.split(args.server_args)).start()
        args.url = server.url
    try:
        summary = asyncio.run(run_load(args, prompts))
        info = asyncio.run(server_info(args.url, args.api_key))
    finally:
        if server is not None:
            server.stop()
    load = (f"{args.request_rate:g} req/s Poisson" if args.request_rate != float("inf")
            else "all at once") + (f", concurrency {args.concurrency}"
                                   if args.concurrency else "")
    print(f"\n{args.num_prompts} requests, {args.dataset} dataset, {load}, {args.url}")
    print_table(summary)
    record = {
        "benchmark": "serving",
        "date": datetime.date.today().isoformat(),
        "machine": {"description": args.machine,
                    "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "config": {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()
                   if k not in ("api_key", "out", "machine", "timeout")},
        "server": info,
        "results": summary,
    }
    out = Path(args.out or results_dir() /
               f"serving_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
