"""Deterministic inference: what batch invariance costs, and how often one prompt's greedy
completion changes with what runs beside it (Thinking Machines' experiment in "Defeating
Nondeterminism in LLM Inference": one prompt run many times, distinct completions counted).

For each path (`--paths`; on the CPU `default` is the embedded SmolLM2-135M GGUF as `Engine()`
runs it, int4 blocks with bfloat16 activations, and `float32` dequantizes the blocks):

- cost: batch-1 decode tokens/s (one chat prompt, `--tokens` greedy tokens) and batched
  tokens/s (`--batch` chat prompts x `--batch-tokens` tokens), medians of `--repeats`.
- distinct: one fixed chat prompt, greedy, `--new-tokens` tokens, run `--runs` times, each
  time at a random position of a batch of 1 to `--max-batch` requests (the others: snippets of
  real text of random length, greedy or sampled, some ending before it), with a random chunked
  prefill size and a cold or warm prefix cache: the distinct completions (token sequences),
  the distinct logprob sequences (exact floats), and the runs equal to the prompt run alone on
  a cold engine. A batch-invariant engine has 1, 1 and all of them.

    python benchmarks/deterministic.py [--quick] [--runs 1000] [--paths default,float32]
        [--disable-cpu-kernel] [--deterministic] [--device cpu|cuda] [--note TEXT] [--out FILE]

`--quick`: 50 runs and one repeat. `--disable-cpu-kernel` adds a row per path with the C++ CPU
kernel off (the eager path); `--deterministic` one with the engine's `deterministic=True`.
`--device cuda` runs the same measurements on the GPU (the default path there is the engine's
CUDA default: bfloat16 weights and overlap scheduling). Each path runs in a process of its
own: two engines' OpenMP pools in one process slow both (docs/cpu.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from cpu_decode import machine as cpu_machine

from results_dir import results_dir

# The prompt of the Thinking Machines experiment, as a chat turn.
FIXED_PROMPT = "Tell me about Richard Feynman."
TOPICS = ["volcanoes", "the moon", "bees", "rainbows", "trains", "chess", "glaciers", "coral",
          "owls", "bread", "magnets", "comets", "tides", "deserts", "violins", "bridges"]
PATHS: dict[str, dict[str, Any]] = {"default": {}, "float32": {"dtype": "float32"}}


def machine(device: str) -> str:
    """The CPU's model name and core count (cpu_decode.machine), or the GPU's name."""
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name()}, {torch.cuda.device_count()} visible"
    return cpu_machine()


def revision() -> str | None:
    """The git commit of the radixlm source this measures, "+dirty" with uncommitted changes;
    None outside a git checkout (then `--note` should say what code ran)."""
    import radixlm

    root = Path(radixlm.__file__).resolve().parent.parent
    # --no-optional-locks: `status` must not rewrite the index of a checkout someone works in.
    git = ["git", "--no-optional-locks", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        changes = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if changes else "")


def batch_prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (variant {i})."
            for i in range(n)]


def text_snippets() -> list[str]:
    """Real English text for the neighbours' prompts: Python's documentation topics, which
    the standard library ships (shared/data's README points at them; no network needed)."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def set_chunk_size(engine: Any, size: int) -> None:
    """Change an idle engine's chunked prefill size. It is engine configuration and only the
    scheduler reads it (each step): swapping the scheduler's copy saves a model load per run."""
    scheduler = engine.core.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, chunked_prefill_size=size)


def cost(engine: Any, args: argparse.Namespace) -> dict[str, float]:
    """Batch-1 decode tokens/s and batched tokens/s, medians; no prefix reuse between runs."""
    chat = [{"role": "user", "content": FIXED_PROMPT}]
    decode, batched = [], []
    for _ in range(args.repeats):
        engine.flush_cache()
        start = time.perf_counter()
        engine.chat(chat, {"max_new_tokens": 1, "temperature": 0})
        ttft = time.perf_counter() - start
        engine.flush_cache()
        start = time.perf_counter()
        out = engine.chat(chat, {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens,
                                 "temperature": 0})
        total = time.perf_counter() - start
        decode.append((out.completion_tokens - 1) / max(total - ttft, 1e-9))
        if args.batch:
            engine.flush_cache()
            chats = [[{"role": "user", "content": p}] for p in batch_prompts(args.batch)]
            start = time.perf_counter()
            outs = engine.chat(chats, {"max_new_tokens": args.batch_tokens,
                                       "min_new_tokens": args.batch_tokens, "temperature": 0})
            batched.append(sum(o.completion_tokens for o in outs)
                           / (time.perf_counter() - start))
    row = {"decode_tokens_per_s": statistics.median(decode)}
    if batched:
        row["batched_tokens_per_s"] = statistics.median(batched)
    return row


def neighbour(engine: Any, rng: random.Random, texts: list[str],
              args: argparse.Namespace) -> tuple[list[int], dict[str, Any]]:
    """A random-length snippet of real text, greedy or sampled."""
    text = rng.choice(texts)
    start = rng.randrange(max(1, len(text) - 2000))
    ids = engine.tokenizer.encode(text[start:start + 2000], add_special_tokens=False)
    ids = ids[: rng.randint(4, max(4, min(len(ids), args.max_prompt_tokens)))]
    # At most as long as the fixed prompt's completion: steps after it ends change nothing.
    params = {"max_new_tokens": rng.randint(1, args.new_tokens), "ignore_eos": True,
              "temperature": rng.choice([0.0, 1.0])}
    return ids, params


def distinct(engine: Any, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """The fixed prompt `--runs` times in random batches; what its completions were."""
    rng = random.Random(args.seed)
    texts = text_snippets()
    prompt = engine.encode_chat([{"role": "user", "content": FIXED_PROMPT}])
    want = {"max_new_tokens": args.new_tokens, "temperature": 0, "logprobs": True,
            "ignore_eos": True}
    default_chunk = engine.core.scheduler.config.chunked_prefill_size
    engine.flush_cache()
    alone = engine.generate(input_ids=prompt, sampling_params=want)
    completions: Counter[tuple[int, ...]] = Counter()
    logprobs: Counter[tuple[float, ...]] = Counter()
    runs = []
    for run in range(args.runs):
        cache = rng.choice(["cold", "warm"])  # warm: earlier runs left the prompt cached
        if cache == "cold":
            engine.flush_cache()
        chunk = rng.randint(8, 512)
        set_chunk_size(engine, chunk)
        batch = [neighbour(engine, rng, texts, args) for _ in range(rng.randint(0,
                                                                          args.max_batch - 1))]
        position = rng.randint(0, len(batch))
        batch.insert(position, (prompt, want))
        out = engine.generate(input_ids=[p for p, _ in batch],
                              sampling_params=[s for _, s in batch])[position]
        completions[tuple(out.token_ids)] += 1
        logprobs[tuple(e.logprob for e in out.logprobs)] += 1
        diverged = next((i for i, (a, b) in enumerate(zip(out.token_ids, alone.token_ids))
                         if a != b), None)
        runs.append({"batch": len(batch), "position": position, "chunk": chunk,
                     "cache": cache, "equal_to_alone": out.logprobs == alone.logprobs,
                     "first_diverging_token": diverged})
        if (run + 1) % 10 == 0:
            print(f"  {label}: {run + 1}/{args.runs} runs, {len(completions)} distinct",
                  file=sys.stderr, flush=True)
    set_chunk_size(engine, default_chunk)
    common, count = completions.most_common(1)[0]
    return {"runs": args.runs, "distinct_completions": len(completions),
            "distinct_logprob_sequences": len(logprobs),
            "runs_equal_to_alone": sum(r["equal_to_alone"] for r in runs),
            "most_common_count": count, "alone_is_most_common": common == tuple(
                alone.token_ids),
            "alone_completion": engine.tokenizer.decode(alone.token_ids),
            "per_run": runs}


def worker(label: str, options: dict[str, Any], args: argparse.Namespace, conn: Any) -> None:
    """One engine configuration in this process: its cost row and its distinct counts."""
    import torch

    from radixlm.runtime import Engine

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    with Engine(args.model, device=args.device, **options) as engine:
        row: dict[str, Any] = {"path": label, "options": options,
                               "dtype": str(engine.dtype).removeprefix("torch."),
                               "cpu_kernel": getattr(engine.core.runner, "cpu_decode",
                                                     None) is not None}
        engine.chat([{"role": "user", "content": FIXED_PROMPT}],
                    {"max_new_tokens": 8, "temperature": 0})  # warm-up
        row |= cost(engine, args)
        row |= distinct(engine, args, label)
    conn.send(row)


def configurations(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    configs = []
    for path in args.paths.split(","):
        if path not in PATHS:
            raise SystemExit(f"unknown path {path!r}; known: {', '.join(PATHS)}")
        options = {"max_total_tokens": 32768, **PATHS[path]}
        configs.append((path, options))
        if args.disable_cpu_kernel and args.device == "cpu":
            configs.append((f"{path}, eager", {**options, "disable_cpu_kernel": True}))
        if args.deterministic:
            configs.append((f"{path}, deterministic", {**options, "deterministic": True}))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="default,float32")
    parser.add_argument("--runs", type=int, default=None, help="default 1000, --quick 50")
    parser.add_argument("--quick", action="store_true", help="50 runs, one repeat")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--disable-cpu-kernel", action="store_true",
                        help="add a row per path with the C++ CPU kernel off")
    parser.add_argument("--deterministic", action="store_true",
                        help="add a row per path with the engine's deterministic=True (the "
                        "CUDA batch-invariant mode)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16,
                        help="the fixed prompt's batch holds 1 to this many requests")
    parser.add_argument("--max-prompt-tokens", type=int, default=128,
                        help="the longest neighbour prompt")
    parser.add_argument("--tokens", type=int, default=128, help="batch-1 decode tokens")
    parser.add_argument("--batch", type=int, default=64, help="0: skip the batched runs")
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="default 3, --quick 1")
    parser.add_argument("--seed", type=int, default=0, help="of the random batches")
    parser.add_argument("--note", default=None, help="free text kept in the JSON (e.g. which "
                        "code ran, where it is not a git checkout)")
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    args.runs = args.runs or (50 if args.quick else 1000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    ctx = mp.get_context("spawn")
    # Other work on the machine slows the cost columns (not the distinct counts): kept
    # beside them, so that a busy run shows.
    load = {"start": os.getloadavg()}
    rows = []
    for label, options in configurations(args):  # one at a time: none slows another
        print(f"{label}: {options}", file=sys.stderr, flush=True)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(label, options, args, child), daemon=True)
        proc.start()
        child.close()
        try:
            rows.append(parent.recv())
        except EOFError:  # it died before it answered
            proc.join()
            raise SystemExit(f"the {label} worker died (exit code {proc.exitcode})") from None
        proc.join()
    load["end"] = os.getloadavg()
    print("\n| path | dtype | decode tok/s | batched tok/s | runs | distinct completions | "
          "distinct logprobs | equal to alone |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        batched = r.get("batched_tokens_per_s")
        print(f"| {r['path']} | {r['dtype']} | {r['decode_tokens_per_s']:.1f} | "
              f"{f'{batched:.0f}' if batched else '-'} | {r['runs']} | "
              f"{r['distinct_completions']} | {r['distinct_logprob_sequences']} | "
              f"{r['runs_equal_to_alone']} |")
    print(f"\n{args.device}, {args.threads} threads; the fixed prompt {FIXED_PROMPT!r}, "
          f"{args.new_tokens} greedy tokens, batches of 1-{args.max_batch}, random chunk "
          f"sizes 8-512, cold or warm cache; batch 1: {args.tokens} tokens; batched: "
          f"{args.batch} prompts x {args.batch_tokens} tokens; load average "
          f"{load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end")
    import torch

    today = datetime.date.today().isoformat()
    where = "cpu" if args.device == "cpu" else "gpu"
    out = Path(args.out or results_dir() / f"deterministic_{where}_{today}.json")
    out.write_text(json.dumps({
        "date": today, "machine": machine(args.device), "device": args.device,
        "revision": revision(), "note": args.note,
        "torch": torch.__version__, "threads": args.threads, "quick": args.quick,
        "fixed_prompt": FIXED_PROMPT, "new_tokens": args.new_tokens,
        "max_batch": args.max_batch, "max_prompt_tokens": args.max_prompt_tokens,
        "seed": args.seed, "tokens": args.tokens, "batch": args.batch,
        "batch_tokens": args.batch_tokens, "repeats": args.repeats, "load_average": load,
        "rows": rows},
        indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
