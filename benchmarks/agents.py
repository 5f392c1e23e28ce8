"""Agent programs under load: program-level scheduling ("plas") against first come, first
served, in one run.

The workload is written in our language and runs on the asyncio frontend: ReAct-style agents
(a loop of 2-30 calls, log-uniform: many short agents, a few long ones; each call a short
thought and action, then a simulated tool that takes 50 ms - 2 s, drawn per call) mixed with
single-shot chat requests, arriving as a Poisson process at 50%, 80% and 95% of the engine's
capacity, measured first: the programs/s the engine completes while it is saturated (a closed
loop keeping twice `max_running_requests` programs in flight, the tools taking no time, since
tool time does not use the engine). Each load runs the same arrivals on an engine per
policy. Reported: program completion time (mean, p50, p99) for agents, latency for single
requests (mean, p99), programs/s, the prefix-cache hit rate, and the agents' share of time
spent in their tools (what no scheduling can shorten). The plot goes beside the JSON.

    python benchmarks/agents.py [--programs 80] [--calls 2-30] [--max-running 8] \
        [--loads 0.5,0.8,0.95]
    python benchmarks/agents.py --engine-options '{"model": "llama-3-8b", "load_format":
        "dummy", "device": "cuda", "tokenizer": "...", "max_total_tokens": 200000}'

On a GPU give both engines the same `max_total_tokens`: sized from free memory, the second
engine would get a smaller pool than the first.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import radixlm as rl
from radixlm.runtime import Engine

from results_dir import results_dir

TOOLS = ["search", "calculator", "weather", "calendar", "lookup"]
ANSWER_TOKENS = 24


@rl.function
async def agent(s, task, calls, latencies, thought_tokens):
    s += rl.system("You are an agent. Think, then call one tool per step.")
    s += rl.user(task)
    for step in range(calls):
        s += rl.assistant("Thought:" + rl.gen(f"thought{step}", max_tokens=thought_tokens,
                                              stop="\n")
                          + "\nAction: " + rl.select(f"tool{step}", TOOLS))
        tool = await s.aget(f"tool{step}")
        await asyncio.sleep(latencies[step])  # the tool runs
        s += rl.user(f"Observation from {tool}: result {step}.")
    s += rl.assistant("Answer:" + rl.gen("answer", max_tokens=thought_tokens))


@rl.function
def chat(s, question):
    s += rl.user(question)
    s += rl.assistant(rl.gen("answer", max_tokens=ANSWER_TOKENS))


def workload(count: int, seed: int, thought_tokens: int = 24,
             calls_range: tuple[int, int] = (2, 30)) -> list[dict[str, Any]]:
    """Half agents (calls drawn log-uniformly in `calls_range`), half single requests, in a
    fixed random order."""
    rng = random.Random(seed)
    low, high = calls_range
    items = []
    for i in range(count):
        if i % 2 == 0:
            calls = min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))
            items.append({"kind": "agent", "task": f"Task {i}: plan a trip to city {i}.",
                          "calls": calls, "thought_tokens": thought_tokens,
                          "latencies": [rng.uniform(0.05, 2.0) for _ in range(calls)]})
        else:
            items.append({"kind": "chat", "question": f"Question {i}: name a color."})
    rng.shuffle(items)
    return items


async def run_one(item: dict[str, Any], backend: Any, start: float) -> dict[str, Any]:
    arrival = time.perf_counter()
    if item["kind"] == "agent":
        state = await agent.arun(task=item["task"], calls=item["calls"],
                                 latencies=item["latencies"],
                                 thought_tokens=item["thought_tokens"], backend=backend,
                                 temperature=0)
    else:
        state = await chat.arun(question=item["question"], backend=backend, temperature=0)
    done = time.perf_counter()
    if state.error() is not None:
        raise RuntimeError(f"{item['kind']} failed: {state.error()}")
    return {"kind": item["kind"], "seconds": done - arrival, "end": done - start,
            "tool_s": sum(item.get("latencies", []))}


async def run_load(engine: Engine, items: list[dict[str, Any]], rate: float | None,
                   seed: int) -> dict[str, Any]:
    """Every item, arriving at `rate` per second (Poisson), or all at once (None)."""
    backend = rl.Engine(engine=engine)
    rng = random.Random(seed)
    before = engine.stats()
    start = time.perf_counter()
    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(run_one(item, backend, start)))
        if rate is not None:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    after = engine.stats()
    agents = sorted(r["seconds"] for r in results if r["kind"] == "agent")
    chats = sorted(r["seconds"] for r in results if r["kind"] == "chat")
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {"programs_per_s": len(results) / wall, "seconds": wall,
            "agent_mean_s": statistics.mean(agents), "agent_p50_s": statistics.median(agents),
            "agent_p99_s": _p99(agents), "chat_mean_s": statistics.mean(chats),
            "chat_p99_s": _p99(chats),
            "agent_tool_share": (sum(r["tool_s"] for r in results if r["kind"] == "agent")
                                 / sum(agents)),
            "cache_hit_rate": cached / max(1, cached + computed)}


def instant(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same programs with tools that take no time."""
    return [{**item, "latencies": [0.0] * len(item.get("latencies", []))} for item in items]


async def measure_capacity(engine: Engine, items: list[dict[str, Any]],
                           in_flight: int) -> float:
    """Programs/s while the engine is saturated: a closed loop keeps `in_flight` programs
    running (tools instant, so each always has a call in the engine) until none is left to
    start. Counted in engine requests finished meanwhile (the programs finished by then are
    the shorter ones), turned into programs/s by the mean requests per program."""
    backend = rl.Engine(engine=engine)
    queue = list(items)
    start = time.perf_counter()
    calls_before = engine.stats()["requests_finished"]
    saturated: list[tuple[float, int]] = []

    async def client() -> None:
        while queue:
            item = queue.pop(0)
            if not queue:  # the last program starts: from now on fewer run at once
                saturated.append((time.perf_counter() - start,
                                  engine.stats()["requests_finished"] - calls_before))
            await run_one(item, backend, start)

    await asyncio.gather(*(client() for _ in range(in_flight)))
    seconds, calls = saturated[0]
    calls_per_program = (engine.stats()["requests_finished"] - calls_before) / len(items)
    return calls / seconds / calls_per_program


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=80)
    parser.add_argument("--calls", default="2-30",
                        help="the range of an agent's calls, LOW-HIGH (log-uniform)")
    parser.add_argument("--max-running", type=int, default=8,
                        help="max_running_requests of both engines: requests beyond it queue")
    parser.add_argument("--loads", default="0.5,0.8,0.95")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--thought-tokens", type=int, default=24,
                        help="max_tokens of each thought (longer calls: more compute per call)")
    parser.add_argument("--capacity", type=float, default=None,
                        help="programs/s measured before on this machine: skips measuring it")
    parser.add_argument("--engine-options", type=json.loads, default={},
                        help="JSON of further Engine options for both engines (model, device)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    calls_range = tuple(int(x) for x in args.calls.split("-"))
    items = workload(args.programs, args.seed, args.thought_tokens, calls_range)
    engines = {policy: Engine(program_policy=policy, max_running_requests=args.max_running,
                              **args.engine_options)
               for policy in ("fcfs", "plas")}
    device = args.engine_options.get("device", "cpu")
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    try:
        for engine in engines.values():  # warm-up
            asyncio.run(run_load(engine, instant(workload(4, 99, calls_range=(2, 3))), None,
                                 0))
        capacity = args.capacity or asyncio.run(measure_capacity(
            engines["fcfs"], instant(items), 2 * args.max_running))
        print(f"capacity (saturated, tools instant, fcfs): {capacity:.2f} programs/s")
        results: dict[str, Any] = {}
        for load in loads:
            for policy, engine in engines.items():
                engine.flush_cache()
                r = asyncio.run(run_load(engine, items, load * capacity, args.seed))
                results[f"{load:.0%} / {policy}"] = r
                print(f"{load:>4.0%} {policy:<5} agents mean {r['agent_mean_s']:6.2f} s  p99 "
                      f"{r['agent_p99_s']:6.2f} s  chat mean {r['chat_mean_s']:5.2f} s  p99 "
                      f"{r['chat_p99_s']:5.2f} s  {r['programs_per_s']:5.2f} programs/s")
    finally:
        for engine in engines.values():
            engine.close()
    print(f"\n{'load / policy':<16}{'agent mean':>11}{'p50':>7}{'p99':>7}{'chat mean':>10}"
          f"{'chat p99':>9}{'prog/s':>8}{'hit':>6}{'in tools':>9}{'mean vs fcfs':>14}"
          f"{'p99 vs fcfs':>12}")
    for name, r in results.items():
        base = results[name.split(" / ")[0] + " / fcfs"]
        print(f"{name:<16}{r['agent_mean_s']:>11.2f}{r['agent_p50_s']:>7.2f}"
              f"{r['agent_p99_s']:>7.2f}{r['chat_mean_s']:>10.2f}{r['chat_p99_s']:>9.2f}"
              f"{r['programs_per_s']:>8.2f}{r['cache_hit_rate']:>6.0%}"
              f"{r['agent_tool_share']:>9.0%}"
              f"{base['agent_mean_s'] / r['agent_mean_s']:>13.2f}x"
              f"{base['agent_p99_s'] / r['agent_p99_s']:>11.2f}x")
    record = {"benchmark": "agents", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "gpu": gpu},
              "config": {"programs": args.programs, "max_running_requests": args.max_running,
                         "loads": loads, "seed": args.seed,
                         "thought_tokens": args.thought_tokens, "calls": args.calls,
                         "answer_tokens": ANSWER_TOKENS,
                         "engine_options": args.engine_options},
              "capacity_programs_per_s": capacity, "results": results}
    out = Path(args.out or results_dir() / f"agents_{device}_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    plot(record, out.with_suffix(".png"))


def plot(record: dict[str, Any], path: Path) -> None:
    """Agent completion (mean, p99) and single-request p99 latency against load, per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    panels = [("agent_mean_s", "agent completion, mean (s)"),
              ("agent_p99_s", "agent completion, p99 (s)"),
              ("chat_p99_s", "single request latency, p99 (s)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8))
    loads = record["config"]["loads"]
    for ax, (key, title) in zip(axes, panels):
        for policy, style in (("fcfs", "o--"), ("plas", "s-")):
            values = [record["results"][f"{load:.0%} / {policy}"][key] for load in loads]
            ax.plot([100 * load for load in loads], values, style, label=policy)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("load (% of capacity)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend()
    machine = record["machine"]["gpu"] or f"CPU, {record['machine']['threads']} threads"
    fig.suptitle(f"Agent programs under load, fcfs vs plas ({machine}, {record['date']})",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
