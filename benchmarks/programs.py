"""Programs on the local engine: the compile hints (fork pins, batch warming) on and off, and
the radix cache off as the baseline, in one run, on the default model (CPU).

Workloads:
  few-shot  a batch of 32 programs sharing a ~280-token few-shot prompt (run_batch)
  fork      8 programs, each a distinct ~300-token document forked into 4 questions, joined
            and summarised
Each runs with an ample KV pool and a tight one (pressure: cached prefixes get evicted).
Reported: wall time, programs/s, generated tokens/s, prefill tokens computed against the
ideal (every distinct prompt token computed once), and the cache hit rate.

    python benchmarks/programs.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
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

    def generate(self, prompt, params, on_delta=None):
        self.prompts.append(prompt.text)
        return self.inner.generate(prompt, params, on_delta)

    def score(self, prefix, choices, unconditional):
        return self.inner.score(prefix, choices, unconditional)

    def render_chat(self, messages, add_generation_prompt=False):
        return self.inner.render_chat(messages, add_generation_prompt)

    def pin_prefix(self, text):
        return self.inner.pin_prefix(text)

    def release_prefix(self, handle):
        self.inner.release_prefix(handle)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

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

    record = {"benchmark": "programs", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__},
              "config": {"model": "smollm2-135m-instruct", "dtype": args.dtype,
                         "max_tokens": args.max_tokens},
              "results": {k: {f: v for f, v in r.items() if f != "texts"}
                          for k, r in results.items()}}
    out = Path(args.out or results_dir() /
               f"programs_cpu_{args.dtype}_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
