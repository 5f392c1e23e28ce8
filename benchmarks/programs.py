"""Programs on the default model (CPU): the compile hints, and segments against one call per
gen, in one run.

Part `hints`: the local engine with the compile hints (fork pins, batch warming) on and off,
and the radix cache off as the baseline. Workloads:
  few-shot  a batch of 32 programs sharing a ~280-token few-shot prompt (run_batch)
  fork      8 programs, each a distinct ~300-token document forked into 4 questions, joined
            and summarised
Each runs with an ample KV pool and a tight one (pressure: cached prefixes get evicted).
Reported: wall time, programs/s, generated tokens/s, prefill tokens computed against the
ideal (every distinct prompt token computed once), and the cache hit rate.

Part `segments`: programs of k steps (k = 2, 4, 8, 16: a short gen each, text between) run
as segments (radixlm/segments.py) and as one call per gen, on the in-process engine and on
`radixlm serve` over HTTP, with SGLang's own frontend against the same server as the peer:
program latency (p50, p99) one program at a time, and programs/s with 64 at once. Every
system's greedy output is checked against ours per call.

Part `async`: many programs of 8 steps at once (64 and 256), with `run_batch` (the program
bodies on a thread each) against `arun_batch` (every program a task of one event loop), on
the in-process engine and over HTTP, with SGLang's frontend (a thread per program) as the
peer: programs/s, the client's peak thread count and its CPU time.

Part `spec`: speculative API execution (`num_api_spec_tokens`) on the OpenAI backend against
`radixlm serve`'s /v1/completions, for the k-step programs: calls per program, latency, and
how many gens equal one call per gen; SGLang's frontend with its OpenAI backend as the peer.

    python benchmarks/programs.py [--part hints|segments|async|spec] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import torch

import radixlm as rl
from radixlm.backends.backend import Backend
from radixlm.runtime import Engine
from radixlm.runtime.engine.tokenization import encode_prompt

from results_dir import results_dir

CAPITALS = [("Germany", "Berlin"), ("Spain", "Madrid"), ("Canada", "Ottawa"),
            ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Chile", "Santiago"),
            ("Egypt", "Cairo"), ("Poland", "Warsaw"), ("Cuba", "Havana")]
COUNTRIES = ["France", "Japan", "Italy", "Greece", "Russia", "China", "India", "Brazil",
             "Mexico", "Sweden", "Turkey", "Iran", "Iraq", "Ireland", "Portugal", "Austria",
             "Hungary", "Finland", "Denmark", "Belgium", "Vietnam", "Thailand", "Nigeria",
             "Ghana", "Morocco", "Argentina", "Colombia", "Venezuela", "Australia",
             "Indonesia", "Pakistan", "Ukraine"]
QUESTIONS = ["What is the main idea?", "Give one example.", "What could go wrong?",
             "Explain it to a beginner."]


@rl.function
def few_shot(s, country):
    s += "Answer with the capital city and one fact about it.\n\n"
    for name, city in CAPITALS:
        s += f"Q: What is the capital of {name}?\nA: {city}. It is a large and old city.\n\n"
    s += f"Q: What is the capital of {country}?\nA:" + rl.gen("answer", stop="\n\n")


@rl.function
def fork_questions(s, document):
    s += rl.system("Answer questions about the document briefly.\n\n" + document)
    forks = s.fork(len(QUESTIONS))
    for question, branch in zip(QUESTIONS, forks):
        branch += rl.user(question) + rl.assistant(rl.gen("answer"))
    answers = s.join(forks)["answer"]
    s += rl.user("Summarise these answers: " + " / ".join(a.strip() for a in answers))
    s += rl.assistant(rl.gen("summary"))


def documents(count: int) -> list[str]:
    from pydoc_data.topics import topics

    names = sorted(k for k, v in topics.items() if len(v) > 2000)[:count]
    return [topics[name][:1200] for name in names]


class Recorder(Backend):
    """Passes everything to the engine backend and keeps each generation's prompt text."""

    def __init__(self, inner: rl.Engine) -> None:
        self.inner = inner
        self.supports_cache_hints = inner.supports_cache_hints
        self.prompts: list[str] = []

    async def agenerate(self, prompt, params, on_delta=None):
        self.prompts.append(prompt.text)
        return await self.inner.agenerate(prompt, params, on_delta)

    async def ascore(self, prefix, choices, unconditional):
        return await self.inner.ascore(prefix, choices, unconditional)

    async def arender_chat(self, messages, add_generation_prompt=False):
        return await self.inner.arender_chat(messages, add_generation_prompt)

    async def apin_prefix(self, text):
        return await self.inner.apin_prefix(text)

    async def arelease_prefix(self, handle):
        await self.inner.arelease_prefix(handle)


def distinct_tokens(tokenizer: Any, texts: Sequence[str]) -> int:
    """Prompt tokens an ideal cache computes: the nodes of a token trie over all prompts."""
    root: dict = {}
    count = 0
    for text in texts:
        node = root
        for token in encode_prompt(tokenizer, text):
            if token not in node:
                node[token] = {}
                count += 1
            node = node[token]
    return count


def run(engine: Engine, workload: str, cache_hints: bool, max_tokens: int) -> dict[str, Any]:
    backend = Recorder(rl.Engine(engine=engine, cache_hints=cache_hints))
    before = engine.stats()
    start = time.perf_counter()
    if workload == "few-shot":
        states = few_shot.run_batch([{"country": c} for c in COUNTRIES], backend=backend,
                                    temperature=0, max_tokens=max_tokens, progress_bar=False)
    else:
        states = fork_questions.run_batch([{"document": d} for d in documents(8)],
                                          backend=backend, temperature=0,
                                          max_tokens=max_tokens, progress_bar=False)
    seconds = time.perf_counter() - start
    after = engine.stats()
    errors = [str(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{workload}: {errors[0]}")
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    ideal = distinct_tokens(engine.tokenizer, backend.prompts)
    return {"seconds": seconds, "programs_per_s": len(states) / seconds,
            "generated_tokens_per_s": generated / seconds, "generated_tokens": generated,
            "prefill_tokens_computed": computed, "ideal_prefill_tokens": ideal,
            "prefill_vs_ideal": computed / ideal, "hit_rate": cached / max(cached + computed, 1),
            "texts": [s.text() for s in states]}


STEP_TOKENS = 6
STEP_COUNTS = (2, 4, 8, 16)
LATENCY_RUNS = 8
BATCH = 64
TOPICS = ["rivers", "bread", "bicycles", "volcanoes", "libraries", "owls", "glass", "tea",
          "bridges", "comets", "chess", "salt", "maps", "bees", "clocks", "sails"]


@rl.function
def notes(s, topic, k):
    s += f"Short notes about {topic}, one line each.\n"
    for i in range(k):
        s += f"Note {i + 1}:" + rl.gen(f"note{i}", max_tokens=STEP_TOKENS, stop="\n") + "\n"


def sglang_notes() -> Any:
    """The same program in SGLang's own frontend (None when it is not installed)."""
    try:
        import sglang as sgl
    except ImportError:
        return None

    @sgl.function
    def program(s, topic, k):
        s += f"Short notes about {topic}, one line each.\n"
        for i in range(k):
            s += f"Note {i + 1}:" + sgl.gen(f"note{i}", max_tokens=STEP_TOKENS, stop="\n") + "\n"

    return sgl, program


# Engine options for every engine and server of the run (--engine-options), e.g. a dummy
# 8B model on the GPU: {"model": "llama-3-8b", "load_format": "dummy", "device": "cuda",
# "tokenizer": "<a tokenizer folder>"}.
ENGINE_OPTIONS: dict[str, Any] = {}


def engine_options(dtype: str | None) -> dict[str, Any]:
    return {**ENGINE_OPTIONS, **({"dtype": dtype} if dtype else {})}


def start_server(dtype: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "radixlm.runtime.server", "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning"]
    for name, value in engine_options(dtype).items():
        flag = "--" + name.replace("_", "-")
        command += [flag] if value is True else [flag, str(value)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1500):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")


def run_segments_part(dtype: str | None) -> dict[str, Any]:
    """{system: {k: figures}} for the k-step programs."""
    proc, url = start_server(dtype)
    peer = sglang_notes()
    results: dict[str, Any] = {}
    try:
        with Engine(**engine_options(dtype)) as engine:
            systems: dict[str, Any] = {
                "in-process, per call": rl.Engine(engine=engine),
                "in-process, segments": rl.Engine(engine=engine),
                "HTTP, per call": rl.RuntimeEndpoint(url, segments=False),
                "HTTP, segments": rl.RuntimeEndpoint(url),
            }
            systems["in-process, per call"].supports_segments = False
            if peer is not None:
                systems["HTTP, SGLang's frontend"] = peer[0].RuntimeEndpoint(url)
            # A batch of each system first, unmeasured: on a GPU the first batch of a run
            # compiles kernels for its shapes, which fell on the first system measured.
            for name, backend in systems.items():
                batch_run(name, backend, STEP_COUNTS[0], peer)
            texts: dict[tuple[str, int], list[str]] = {}
            for k in STEP_COUNTS:
                # Latency one program at a time, the systems interleaved (this machine's speed
                # drifts over minutes); then each system's batch.
                runs = latency_runs(systems, k, peer)
                for name, backend in systems.items():
                    latencies, texts[name, k] = runs[name]
                    figures, batch_texts = batch_run(name, backend, k, peer)
                    texts[name, k] += batch_texts
                    latencies.sort()
                    results.setdefault(name, {})[k] = {
                        "p50_s": statistics.median(latencies),
                        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                        **figures}
                    print(f"{name:<26} k={k:<3} p50 {results[name][k]['p50_s'] * 1e3:7.0f} ms"
                          f"  {results[name][k]['programs_per_s']:6.2f} programs/s")
            for name in systems:
                for k in STEP_COUNTS:
                    base = texts["HTTP, per call" if name.startswith("HTTP")
                                 else "in-process, per call", k]
                    results[name][k]["same_as_per_call"] = sum(
                        a == b for a, b in zip(texts[name, k], base))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return results


def program_of(name: str, peer: Any) -> Any:
    return peer[1] if name.endswith("SGLang's frontend") else notes


def latency_runs(systems: dict[str, Any], k: int,
                 peer: Any) -> dict[str, tuple[list[float], list[str]]]:
    runs: dict[str, tuple[list[float], list[str]]] = {name: ([], []) for name in systems}
    for name, backend in systems.items():
        program_of(name, peer).run(topic="warm-up", k=k, backend=backend, temperature=0).text()
    for topic in TOPICS[:LATENCY_RUNS]:
        for name, backend in systems.items():
            start = time.perf_counter()
            state = program_of(name, peer).run(topic=topic, k=k, backend=backend,
                                               temperature=0)
            text = state.text()
            runs[name][0].append(time.perf_counter() - start)
            runs[name][1].append(text)
    return runs


def batch_run(name: str, backend: Any, k: int, peer: Any) -> tuple[dict[str, Any], list[str]]:
    program = program_of(name, peer)
    batch = [{"topic": f"{TOPICS[i % len(TOPICS)]} ({i})", "k": k} for i in range(BATCH)]
    start = time.perf_counter()
    if name.endswith("SGLang's frontend"):
        states = program.run_batch(batch, backend=backend, num_threads=BATCH, temperature=0)
    else:
        states = program.run_batch(batch, backend=backend, concurrency=BATCH,
                                   progress_bar=False, temperature=0)
    texts = [s.text() for s in states]
    seconds = time.perf_counter() - start
    return {"programs_per_s": BATCH / seconds, "batch_seconds": seconds}, texts


ASYNC_STEPS = 8
ASYNC_SIZES = (64, 256)
ASYNC_ROUNDS = 2  # the systems interleaved; each system's faster round counts


class ThreadPeak:
    """The most threads this process had while the block ran (sampled every 5 ms)."""

    def __enter__(self) -> "ThreadPeak":
        self.peak = threading.active_count()
        self.done = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, threading.active_count() - 1)  # not the sampler

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.sampler.join()


def run_async_part(dtype: str | None) -> dict[str, Any]:
    """{system: {n: figures}}: n programs of ASYNC_STEPS steps at once."""
    proc, url = start_server(dtype)
    peer = sglang_notes()
    results: dict[str, Any] = {}
    try:
        with Engine(**engine_options(dtype)) as engine:
            backends = {"in-process": rl.Engine(engine=engine), "HTTP": rl.RuntimeEndpoint(url)}
            systems = [(f"{where}, {api}", backend, api)
                       for where, backend in backends.items()
                       for api in ("run_batch", "arun_batch")]
            if peer is not None:
                systems.append(("HTTP, SGLang's frontend", peer[0].RuntimeEndpoint(url),
                                "sglang"))
            for name, backend, api in systems:  # warm-up
                async_batch(backend, api, 4, peer)
            for n in ASYNC_SIZES:
                texts = {}
                for _ in range(ASYNC_ROUNDS):
                    for name, backend, api in systems:
                        figures, texts[name] = async_batch(backend, api, n, peer)
                        best = results.setdefault(name, {}).get(n)
                        if best is None or figures["programs_per_s"] > best["programs_per_s"]:
                            results[name][n] = figures
                        print(f"{name:<28} n={n:<4} {figures['programs_per_s']:7.2f} "
                              f"programs/s  peak threads {figures['peak_threads']:4}"
                              f"  client CPU {figures['client_cpu_s']:6.2f} s")
                base = texts["in-process, run_batch"]
                for name in texts:
                    results[name][n]["same_as_run_batch"] = sum(
                        a == b for a, b in zip(texts[name], base))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return results


def async_batch(backend: Any, api: str, n: int, peer: Any) -> tuple[dict[str, Any], list[str]]:
    batch = [{"topic": f"{TOPICS[i % len(TOPICS)]} ({i})", "k": ASYNC_STEPS} for i in range(n)]
    before = threading.active_count()
    cpu, start = time.process_time(), time.perf_counter()
    with ThreadPeak() as threads:
        if api == "sglang":
            states = peer[1].run_batch(batch, backend=backend, num_threads=n, temperature=0)
        elif api == "run_batch":
            states = notes.run_batch(batch, backend=backend, concurrency=n, progress_bar=False,
                                     temperature=0)
        else:
            states = asyncio.run(notes.arun_batch(batch, backend=backend, concurrency=n,
                                                  progress_bar=False, temperature=0))
        texts = [s.text() for s in states]
    seconds = time.perf_counter() - start
    return {"programs_per_s": n / seconds, "seconds": seconds,
            "peak_threads": threads.peak, "threads_before": before,
            "client_cpu_s": time.process_time() - cpu}, texts


SPEC_TOKENS = (32, 128)
SPEC_STEPS = 8


def run_spec_part(dtype: str | None) -> dict[str, Any]:
    """{system: figures} for the SPEC_STEPS-step program over the OpenAI routes."""
    proc, url = start_server(dtype)
    results: dict[str, Any] = {}
    try:
        remote = rl.RuntimeEndpoint(url)
        model = remote.get_model_name()
        ours = rl.OpenAI(model, base_url=url + "/v1", api_key="none")
        systems: dict[str, tuple[Any, Any]] = {"per call": (notes, ours)}
        for n in SPEC_TOKENS:
            systems[f"num_api_spec_tokens={n}"] = (
                rl.function(num_api_spec_tokens=n)(notes.fn), ours)
        # SGLang's OpenAI backend, the natural peer, needs tiktoken's encodings, which it
        # downloads from OpenAI's storage: not measured here.
        counters = ("requests_finished", "prefill_tokens_computed", "cached_tokens",
                    "generated_tokens")
        runs: dict[str, dict[str, list[Any]]] = {name: {"s": [], "counts": [], "vars": []}
                                                 for name in systems}
        for topic in TOPICS[:LATENCY_RUNS]:  # the systems interleaved, one program at a time
            for name, (program, backend) in systems.items():
                before, start = remote.stats(), time.perf_counter()
                state = program.run(topic=topic, k=SPEC_STEPS, backend=backend, temperature=0)
                state.text()
                runs[name]["s"].append(time.perf_counter() - start)
                after = remote.stats()
                runs[name]["counts"].append({c: after[c] - before[c] for c in counters})
                runs[name]["vars"].append([state[f"note{i}"] for i in range(SPEC_STEPS)])
        base = runs["per call"]["vars"]
        for name, r in runs.items():
            gens = [a == b for got, want in zip(r["vars"], base) for a, b in zip(got, want)]

            def mean(*names: str) -> float:
                return statistics.mean(sum(c[n] for n in names) for c in r["counts"])  # noqa: B023

            results[name] = {"p50_s": statistics.median(r["s"]),
                             "calls_per_program": mean("requests_finished"),
                             "prompt_tokens_per_program": mean("prefill_tokens_computed",
                                                               "cached_tokens"),
                             "generated_tokens_per_program": mean("generated_tokens"),
                             "gens_same_as_per_call": sum(gens), "gens": len(gens),
                             "first_gen_same": sum(got[0] == want[0] for got, want
                                                   in zip(r["vars"], base))}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return results


def print_spec(results: dict[str, Any]) -> None:
    base = results["per call"]
    print(f"\n{'system':<26}{'calls':>7}{'prompt tok':>12}{'generated':>11}{'p50 ms':>9}"
          f"{'vs per call':>13}{'gens = per call':>17}{'first gen':>11}")
    for name, r in results.items():
        print(f"{name:<26}{r['calls_per_program']:>7.2f}{r['prompt_tokens_per_program']:>12.0f}"
              f"{r['generated_tokens_per_program']:>11.0f}{r['p50_s'] * 1e3:>9.0f}"
              f"{base['p50_s'] / r['p50_s']:>12.2f}x"
              f"{r['gens_same_as_per_call']:>11}/{r['gens']:<5}"
              f"{r['first_gen_same']:>5}/{LATENCY_RUNS}")


def print_async(results: dict[str, Any]) -> None:
    print(f"\n{'system':<28}{'n':>5}{'programs/s':>12}{'vs run_batch':>14}{'peak threads':>14}"
          f"{'client CPU s':>14}{'same':>10}")
    for name, by_n in results.items():
        for n, r in by_n.items():
            base = results[name.split(",")[0] + ", run_batch"][n]
            print(f"{name:<28}{n:>5}{r['programs_per_s']:>12.2f}"
                  f"{r['programs_per_s'] / base['programs_per_s']:>13.2f}x{r['peak_threads']:>14}"
                  f"{r['client_cpu_s']:>14.2f}{r['same_as_run_batch']:>6}/{n}")


def print_segments(results: dict[str, Any]) -> None:
    print(f"\n{'system':<26}{'k':>4}{'p50 ms':>9}{'p99 ms':>9}{'vs per call':>13}"
          f"{'programs/s':>12}{'vs per call':>13}{'same':>8}")
    for name, by_k in results.items():
        for k, r in by_k.items():
            base = results["HTTP, per call" if name.startswith("HTTP")
                           else "in-process, per call"][k]
            print(f"{name:<26}{k:>4}{r['p50_s'] * 1e3:>9.0f}{r['p99_s'] * 1e3:>9.0f}"
                  f"{base['p50_s'] / r['p50_s']:>12.2f}x{r['programs_per_s']:>12.2f}"
                  f"{r['programs_per_s'] / base['programs_per_s']:>12.2f}x"
                  f"{r['same_as_per_call']:>5}/{LATENCY_RUNS + BATCH}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: float32 for the hints part (its baseline run), the "
                             "engine's default (GGUF blocks) for the segments part")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--part", choices=["hints", "segments", "async", "spec", "all"],
                        default="all")
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine-options", type=json.loads, default={},
                        help="JSON: engine options for every engine and server of the run "
                             "(segments, async and spec parts), e.g. a dummy model on the GPU")
    parser.add_argument("--plot", metavar="JSON", default=None,
                        help="only plot the segments part of a results file (PNG beside it)")
    args = parser.parse_args()
    if args.plot:
        plot_segments(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    ENGINE_OPTIONS.update(args.engine_options)
    if args.part in ("async", "spec"):
        extra = run_async_part(args.dtype) if args.part == "async" else run_spec_part(args.dtype)
        (print_async if args.part == "async" else print_spec)(extra)
        write(args, {}, None, extra, args.part)
        return
    segments = run_segments_part(args.dtype) if args.part != "hints" else None
    if segments is not None:
        print_segments(segments)
    if args.part == "segments":
        out = write(args, {}, segments)
        plot_segments(json.loads(out.read_text()), out.with_suffix(".png"))
        return

    args.dtype = args.dtype or "float32"
    results: dict[str, dict[str, Any]] = {}
    for pool_name, pool in (("ample pool", 65536), ("tight pool", 2048)):
        for setting in ("radix cache off", "hints off", "hints on"):
            with Engine(dtype=args.dtype, max_total_tokens=pool,
                        disable_radix_cache=setting == "radix cache off") as engine:
                engine.generate("warm up", {"max_new_tokens": 2})
                engine.flush_cache()
                for workload in ("few-shot", "fork"):
                    results[f"{workload} / {pool_name} / {setting}"] = run(
                        engine, workload, setting == "hints on", args.max_tokens)
                    engine.flush_cache()

    print(f"\n{args.dtype}, {torch.get_num_threads()} threads, max_tokens {args.max_tokens}, "
          f"{platform.machine()}")
    print(f"{'workload / pool / setting':<38}{'s':>7}{'prog/s':>8}{'gen tok/s':>10}"
          f"{'prefill':>9}{'ideal':>7}{'x ideal':>8}{'hit':>7}{'same':>6}")
    for name, r in results.items():
        base = results[name.rsplit(" / ", 1)[0] + " / radix cache off"]
        same = sum(a == b for a, b in zip(r["texts"], base["texts"]))
        print(f"{name:<38}{r['seconds']:>7.1f}{r['programs_per_s']:>8.2f}"
              f"{r['generated_tokens_per_s']:>10.1f}{r['prefill_tokens_computed']:>9}"
              f"{r['ideal_prefill_tokens']:>7}{r['prefill_vs_ideal']:>8.2f}"
              f"{r['hit_rate']:>7.0%}{same:>4}/{len(r['texts'])}")

    write(args, results, segments)


def write(args: argparse.Namespace, results: dict[str, dict[str, Any]],
          segments: dict[str, Any] | None, extra: dict[str, Any] | None = None,
          part: str = "") -> Path:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    record = {"benchmark": "programs", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "gpu": gpu},
              "config": {"model": ENGINE_OPTIONS.get("model", "smollm2-135m-instruct"),
                         "engine_options": ENGINE_OPTIONS, "dtype": args.dtype,
                         "max_tokens": args.max_tokens, "step_tokens": STEP_TOKENS,
                         "latency_runs": LATENCY_RUNS, "batch": BATCH},
              "results": {k: {f: v for f, v in r.items() if f != "texts"}
                          for k, r in results.items()},
              "segments": segments, **({part: extra} if part else {})}
    out = Path(args.out or results_dir() / f"programs_{part + '_' if part else ''}cpu_"
               f"{args.dtype or 'default'}_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def plot_segments(record: dict[str, Any], path: Path) -> None:
    """Segments against one call per gen: p50 latency of one program, and programs/s with
    BATCH at once, against the program's step count, per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    systems = record["segments"]
    panels = [("p50_s", "one program at a time: p50 latency (ms)", 1e3),
              ("programs_per_s", f"{record['config']['batch']} programs at once: programs/s", 1)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (key, title, scale) in zip(axes, panels):
        for name, by_k in systems.items():
            ks = sorted(by_k, key=int)
            style = ("s-" if "segments" in name else "o--" if "per call" in name else "^:")
            ax.plot([int(k) for k in ks], [by_k[k][key] * scale for k in ks], style,
                    label=name, alpha=0.5 if name.startswith("in-process") else 1.0)
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(k) for k in ks], [str(k) for k in ks])
        ax.set_xlabel("steps (gens) per program")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    machine = record["machine"].get("gpu") or f"CPU, {record['machine']['threads']} threads"
    fig.suptitle(f"Segments vs one call per gen, {record['config']['model']} ({machine}, "
                 f"{record['date']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
