"""Online serving benchmark: a load generator for any OpenAI-compatible server.

Requests go to /v1/completions with streaming, arriving as a Poisson process at
--request-rate requests/s (inf: all at once) or kept at a fixed --concurrency. Datasets:
random prompts of random lengths, groups of prompts sharing a long prefix, or the first turn
of each conversation in a ShareGPT-format JSON file. Reported: request throughput, output
tokens/s, time to first token (TTFT), inter-token latency (ITL, the gaps between streamed
events; under load one event may carry several tokens) and end-to-end latency at p50/p90/p99,
as a table and as JSON. While the load runs, /health is probed to show how responsive the
server stays (skipped if it has no /health).

    python benchmarks/serving.py --url http://127.0.0.1:30000 --num-prompts 64
    python benchmarks/serving.py --launch --num-prompts 64 --request-rate 2   # our own server

One run can sweep: --dataset and --request-rate take comma-separated lists, and every
(dataset, rate) pair is measured, each on a flushed prefix cache. At a finite rate r only the
first r x --arrival-seconds prompts are sent (all of them at inf), so a low rate does not take
minutes. With --launch the server's flags are --server-args; --offline then also runs the
offline `Engine` with the same flags in this process once the server has stopped, on the same
prompts, all submitted at once, and the JSON holds the server's output tokens/s at saturation
(the inf rate) over the engine's. A dummy model shape without a tokenizer (e.g. `llama-3-8b
--load-format dummy`) gets a made-up byte-level one of its vocabulary size (see
synthetic_tokenizer.py), so the server detokenizes and streams text as it would for a real
model. The GPU run recorded in docs/performance.md:

    python benchmarks/serving.py --launch --offline --token-ids \\
        --server-args "llama-3-8b --load-format dummy --dtype bfloat16 \\
                       --max-running-requests 256 --max-num-batched-tokens 8192 \\
                       --chunked-prefill-size 1024 --kv-cache-memory-fraction 0.85" \\
        --dataset random,shared-prefix --request-rate 8,16,32,inf --num-prompts 512 \\
        --input-len 512 --output-len 512 --prefix-len 1024 --shared-input-len 128 \\
        --shared-output-len 256 --num-groups 16 --out-dir $OUT

Token counts come from the server's `usage` (stream_options.include_usage). Prompt lengths are
given in words (about 1.3 tokens each for English text), so the client needs no tokenizer;
with --token-ids prompts are token ids instead (ids 100..29999, regular tokens in every
vocabulary we know of) and lengths are exact token counts. Output lengths are forced: the
requests ask the server to ignore EOS (--no-ignore-eos for servers that refuse that).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import math
import multiprocessing
import os
import platform
import random
import shlex
import subprocess
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
TOKEN_IDS = (100, 30000)  # --token-ids draws from this range


@dataclass
class Prompt:
    text: str | list[int]  # words, or token ids (--token-ids)
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

def random_text(rng: random.Random, length: int, ids: bool) -> str | list[int]:
    if ids:
        return [rng.randrange(*TOKEN_IDS) for _ in range(max(1, length))]
    return " ".join(rng.choice(WORDS) for _ in range(max(1, length)))


def random_dataset(args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    def length(mean: int) -> int:
        return rng.randint(max(1, int(mean * (1 - args.range_ratio))), mean)
    return [Prompt(random_text(rng, length(args.input_len), args.token_ids),
                   length(args.output_len)) for _ in range(args.num_prompts)]


def shared_prefix_dataset(args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    prefixes = [random_text(rng, args.prefix_len, args.token_ids)
                for _ in range(args.num_groups)]
    suffix_len = args.shared_input_len or args.input_len
    output_len = args.shared_output_len or args.output_len
    prompts = []
    for i in range(args.num_prompts):
        prefix, suffix = prefixes[i % args.num_groups], random_text(rng, suffix_len,
                                                                    args.token_ids)
        text = prefix + suffix if args.token_ids else f"{prefix}\n{suffix}"
        prompts.append(Prompt(text, output_len))
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
            # Whatever arrived in one read, split into events: one await per read rather
            # than per line keeps the client cheap (~10 us per event), so that at tens of
            # thousands of tokens/s it measures the server, not itself.
            buffer = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *events, buffer = (buffer + data).split(b"\n\n")
                for raw in events:
                    if not raw.startswith(b"data: {"):
                        continue
                    event = json.loads(raw[6:])
                    if "error" in event:
                        result.error = str(event["error"])
                        return result
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


def session(args: argparse.Namespace) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=args.timeout))


async def send_all(args: argparse.Namespace, jobs: list[tuple[float, Prompt]], start: float,
                   concurrency: int | None) -> list[Result]:
    """Send each prompt at `start` + its arrival offset (time.perf_counter's clock, which
    every process on the host shares), at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency or max(1, len(jobs)))

    async def one(client: aiohttp.ClientSession, offset: float, prompt: Prompt) -> Result:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            return await one_request(client, args, prompt)

    async with session(args) as client:
        return list(await asyncio.gather(*(one(client, t, p) for t, p in jobs)))


def client_process(args: argparse.Namespace, jobs: list[tuple[float, Prompt]], start: float,
                   concurrency: int | None) -> tuple[list[Result], float]:
    """A load-generating process's share of the requests; its results and the CPU seconds
    sending them took."""
    before = os.times()
    results = asyncio.run(send_all(args, jobs, start, concurrency))
    after = os.times()
    return results, after.user + after.system - before.user - before.system


async def run_load(args: argparse.Namespace, prompts: list[Prompt], rate: float,
                   warmup: list[Prompt], pids: dict[str, int]) -> dict[str, Any]:
    async with session(args) as client:
        if not args.model:
            async with client.get(args.url + "/v1/models") as response:
                args.model = (await response.json())["data"][0]["id"]
        # Warm-up, not measured: the first requests pay one-time costs (kernel compiles).
        await asyncio.gather(*(one_request(client, args, p) for p in warmup))
        await flush_cache(client, args.url)
        rng = random.Random(args.seed + 1)
        offsets = [0.0]
        for _ in prompts[1:]:
            offsets.append(offsets[-1] + (0.0 if rate == float("inf")
                                          else rng.expovariate(rate)))
        jobs = list(zip(offsets, prompts))
        done = asyncio.Event()
        probe = asyncio.create_task(probe_health(client, args.url, done))
        cpu_before = {name: thread_cpu(pid) for name, pid in pids.items()}
        processes = args.client_processes
        if processes == 1:
            start = time.perf_counter()
            results = await send_all(args, jobs, start, args.concurrency)
            client_cpu = []
        else:
            # Round-robin shares, each sent by its own process, so that at tens of thousands
            # of tokens/s the client's event loop is nowhere near busy.
            concurrency = -(-args.concurrency // processes) if args.concurrency else None
            start = time.perf_counter() + 2.0  # the processes start meanwhile
            loop = asyncio.get_running_loop()
            with concurrent.futures.ProcessPoolExecutor(
                    processes, mp_context=multiprocessing.get_context("spawn")) as pool:
                shares = await asyncio.gather(*(loop.run_in_executor(
                    pool, client_process, args, jobs[i::processes], start, concurrency)
                    for i in range(processes)))
            results = [r for share, _ in shares for r in share]
            client_cpu = [cpu for _, cpu in shares]
        duration = max(r.end for r in results if r.ok) - start if any(
            r.ok for r in results) else time.perf_counter() - start
        cpu = {name: cpu_used(cpu_before[name], thread_cpu(pid)) for name, pid in pids.items()}
        done.set()
        health = await probe
    summary = summarize(results, duration, health)
    tokens = max(1, summary["output_tokens"])
    if client_cpu:  # the sending processes' (the parent only probes /health)
        cpu["client"] = sorted(client_cpu, reverse=True)
    summary["cpu_us_per_output_token"] = {
        name: {"process": sum(used) / tokens * 1e6,
               "busiest": [t / tokens * 1e6 for t in used[:3]]}
        for name, used in cpu.items()}
    return summary


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process so far ({} off Linux)."""
    found = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def cpu_used(before: dict[int, float], after: dict[int, float]) -> list[float]:
    """CPU seconds each thread used between two readings, busiest first."""
    return sorted((t - before.get(tid, 0.0) for tid, t in after.items()), reverse=True)


async def flush_cache(session: aiohttp.ClientSession, url: str) -> None:
    """Empty the server's prefix cache (radixlm and SGLang have /flush_cache), so a run does
    not hit prefixes cached by the one before; other servers lack the route: nothing to do."""
    try:
        async with session.post(url + "/flush_cache") as response:
            await response.read()
    except aiohttp.ClientError:
        pass


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


# -- the offline engine on the same prompts ---------------------------------------------------

def run_offline(options: dict[str, Any], workloads: dict[str, list[Prompt]],
                warmup: list[Prompt], temperature: float) -> dict[str, dict[str, Any]]:
    """Each dataset's prompts through `Engine.generate`, all at once, with the sampling
    parameters the server derives from the same requests."""
    from radixlm.runtime import Engine, SamplingParams

    def generate(engine: Engine, prompts: list[Prompt]) -> list[Any]:
        params = [SamplingParams(max_new_tokens=p.max_tokens, temperature=temperature,
                                 ignore_eos=True) for p in prompts]
        if isinstance(prompts[0].text, list):
            return engine.generate(input_ids=[p.text for p in prompts], sampling_params=params)
        return engine.generate([p.text for p in prompts], params)

    results = {}
    with Engine(**options) as engine:
        generate(engine, warmup)
        for name, prompts in workloads.items():
            engine.flush_cache()
            start = time.perf_counter()
            outs = generate(engine, prompts)
            duration = time.perf_counter() - start
            output = sum(o.completion_tokens for o in outs)
            results[name] = {"duration_s": duration, "completed": len(outs),
                             "prompt_tokens": sum(o.prompt_tokens for o in outs),
                             "output_tokens": output, "output_throughput": output / duration,
                             "request_throughput": len(outs) / duration}
            print(f"offline engine, {name}: {len(outs)} requests in {duration:.2f} s, "
                  f"{output / duration:.1f} output tokens/s")
    return results


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
    events = sum(len(r.chunk_times) for r in ok)
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
        "tokens_per_event": output / events if events else float("nan"),
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
    print(f"{'output tokens per event':<28}{summary['tokens_per_event']:.2f}")
    for name, used in summary["cpu_us_per_output_token"].items():
        busiest = ", ".join(f"{t:.1f}" for t in used["busiest"])
        print(f"CPU us/token, {name:<15}{used['process']:>8.1f}  (busiest threads or client "
              f"processes: {busiest})")
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


def machine(description: str | None) -> dict[str, Any]:
    found: dict[str, Any] = {"description": description,
                             "processor": platform.processor() or platform.machine(),
                             "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:  # nvidia-smi, not torch: a CUDA context here would shrink the server's KV pool
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.split("\n")
        if gpus[0].strip():
            found["gpu"] = gpus[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return found


def rate_list(text: str) -> list[float]:
    return [float(r) for r in text.split(",")]


def launch_options(server_args: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The server's flags, plus --tokenizer for a dummy shape that has none, and the Engine
    options those flags mean (for --offline)."""
    from radixlm.runtime.models.presets import ARCHITECTURE_PRESETS
    from radixlm.runtime.server.args import add_serve_args, engine_options

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    options = engine_options(parser.parse_args(server_args))
    preset = ARCHITECTURE_PRESETS.get(options["model"] or "")
    if options["load_format"] == "dummy" and preset and not options["tokenizer"]:
        from synthetic_tokenizer import synthetic_tokenizer

        folder = str(synthetic_tokenizer(preset["vocab_size"]))
        server_args = [*server_args, "--tokenizer", folder]
        options["tokenizer"] = folder
    return server_args, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--launch", action="store_true",
                        help="start a radixlm server for the run (--url is then ignored)")
    parser.add_argument("--server-args", default="--max-total-tokens 65536",
                        help="flags for the launched server")
    parser.add_argument("--offline", action="store_true",
                        help="with --launch: also run the offline Engine (the server's flags) "
                             "on the same prompts, and report server / offline tokens/s")
    parser.add_argument("--model", default=None, help="model id sent (default: /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--dataset", default="random",
                        help=f"comma-separated, of {', '.join(sorted(DATASETS))}")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--token-ids", action="store_true",
                        help="prompts as token ids; lengths in tokens, not words")
    parser.add_argument("--input-len", type=int, default=128, help="prompt words (max)")
    parser.add_argument("--output-len", type=int, default=64, help="max tokens (max)")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="random lengths are drawn from [len * (1 - ratio), len]")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix words")
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix groups")
    parser.add_argument("--shared-input-len", type=int, default=None,
                        help="shared-prefix: words after the prefix (default --input-len)")
    parser.add_argument("--shared-output-len", type=int, default=None,
                        help="shared-prefix: output tokens (default --output-len)")
    parser.add_argument("--request-rate", type=rate_list, default=[float("inf")],
                        help="Poisson arrivals per second, comma-separated for a sweep "
                             "(default: inf, all at once)")
    parser.add_argument("--arrival-seconds", type=float, default=None,
                        help="at a finite rate r send only the first r x this many prompts")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="at most this many requests in flight")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="processes that send the requests (each ~35 us of CPU per "
                             "streamed token: use several above ~10k tokens/s)")
    parser.add_argument("--warmup-prompts", type=int, default=1,
                        help="prompts sent all at once, not measured, before each dataset's "
                             "first server run and before the offline runs (other prompts of "
                             "the first dataset)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (for servers that reject it)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machine", default=None, help="machine description for the JSON")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--out-dir", default=None, help="folder for the JSON (dated name)")
    args = parser.parse_args()
    datasets = args.dataset.split(",")
    for name in datasets:
        if name not in DATASETS:
            parser.error(f"--dataset: unknown {name!r}")
    if "sharegpt" in datasets and not args.dataset_path:
        parser.error("--dataset sharegpt needs --dataset-path")
    if args.offline and not (args.launch and args.ignore_eos):
        parser.error("--offline needs --launch (the engine's flags are the server's) and "
                     "forced output lengths")
    workloads = {name: DATASETS[name](args, random.Random(args.seed + i))
                 for i, name in enumerate(datasets)}
    warmup_args = argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_prompts})
    warmup = DATASETS[datasets[0]](warmup_args, random.Random(args.seed + 1000))

    date = datetime.date.today().isoformat()
    found = machine(args.machine)
    tag = found["gpu"].split()[-1].lower() if "gpu" in found else "cpu"  # e.g. h200
    out = Path(args.out or Path(args.out_dir or results_dir()) / f"serving_{tag}_{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()
              if k not in ("api_key", "out", "out_dir", "machine", "timeout")}
    config["request_rate"] = [str(r) for r in args.request_rate]
    record: dict[str, Any] = {"benchmark": "serving", "date": date,
                              "machine": found, "config": config,
                              "server": None, "results": {}}

    def save() -> None:  # after every run: a run cut short still leaves what it measured
        out.write_text(json.dumps(record, indent=2, default=str) + "\n")

    server = None
    server_args, options = shlex.split(args.server_args), {}
    pids = {"client": os.getpid()}
    if args.launch:
        from radixlm.backends.server_process import ServerProcess

        server_args, options = launch_options(server_args)
        started = time.perf_counter()
        server = ServerProcess(server_args, startup_timeout=900).start()
        record["server_startup_s"] = time.perf_counter() - started
        args.url = server.url
        assert server.proc is not None
        pids["http_process"] = server.proc.pid
        try:
            pids["engine_process"] = server.engine_pid()
        except (LookupError, OSError):  # not Linux
            pass
    try:
        for name, prompts in workloads.items():
            runs = record["results"].setdefault(name, {"rates": []})["rates"]
            for rate in args.request_rate:
                count = len(prompts) if rate == float("inf") or not args.arrival_seconds \
                    else min(len(prompts), math.ceil(rate * args.arrival_seconds))
                summary = asyncio.run(run_load(args, prompts[:count], rate,
                                               warmup if not runs else [], pids))
                load = (f"{rate:g} req/s Poisson" if rate != float("inf") else "all at once")
                load += f", concurrency {args.concurrency}" if args.concurrency else ""
                print(f"\n{count} requests, {name} dataset, {load}, {args.url}")
                print_table(summary)
                runs.append({"request_rate": str(rate), "num_prompts": count, **summary})
                save()
        record["server"] = asyncio.run(server_info(args.url, args.api_key))
        if record["server"] and "synthetic-tokenizer" in str(options.get("tokenizer")):
            record["server"]["engine_config"]["tokenizer"] = "synthetic byte-level BPE"
    finally:
        if server is not None:
            server.stop()
            (out.parent / f"{out.stem}_server.log").write_text(server.log_text())
        save()
    if args.offline:
        offline = run_offline(options, workloads, warmup, args.temperature)
        for name, result in offline.items():
            entry = record["results"][name]
            entry["offline"] = result
            top = max(entry["rates"], key=lambda r: float(r["request_rate"]))
            entry["saturation_ratio"] = top["output_throughput"] / result["output_throughput"]
            print(f"{name}: server at {top['request_rate']} req/s "
                  f"{top['output_throughput']:.1f} output tokens/s = "
                  f"{entry['saturation_ratio']:.1%} of the offline engine's "
                  f"{result['output_throughput']:.1f}")
        save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
