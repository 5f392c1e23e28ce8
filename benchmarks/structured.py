"""Structured output on the default model (CPU): coverage, validity, overhead, jump-forward.

Sections, all in one run on the same schemas and model:
  coverage    JSONSchemaBench schemas (a seeded sample per split): how many are accepted and
              compile, compile time p50/p90, and the errors grouped by cause;
  validity    chat generation on a fixed sample of them (greedy), jump-forward off and on:
              finished outputs validated with jsonschema, outputs cut by max_new_tokens
              counted apart, forward steps with and without jump-forward;
  overhead    time spent in grammar work per constrained token (mask fill, mask apply,
              advancing, jump-forward), at batch 1 and 32;
  throughput  the same requests with a JSON schema and unconstrained, each request held to
              the same number of new tokens, at batch 1 and 32.

    python benchmarks/structured.py [--coverage-sample 300] [--generate-sample 48]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import logging
import os
import platform
import random
import re
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from radixlm.runtime import Engine, SamplingParams
from radixlm.runtime.execution import sampler
from radixlm.runtime.execution.model_runner import ModelRunner
from radixlm.runtime.grammar.backend import GrammarBackend
from radixlm.runtime.grammar.matcher import GrammarMatcher
from radixlm.runtime.grammar.spec import GrammarSpec

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"
SPLITS = ("Glaiveai2K", "Github_easy")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"},
                                            "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"]}
PEOPLE = ["a retired sailor", "a young chef", "a chess champion", "a beekeeper", "a pilot",
          "a librarian", "a marathon runner", "a jazz pianist"]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_schemas(split: str, sample: int, seed: int) -> list[tuple[str, str]]:
    files = sorted(p.name for p in (DATA / split).glob("*.json"))
    picked = random.Random(seed).sample(files, min(sample, len(files)))
    return [(f, (DATA / split / f).read_text()) for f in picked]


def cause(message: str) -> str:
    """Group error messages: drop the location, quoted names and numbers."""
    message = message.split(" (at ")[0]
    message = re.sub(r"(property name|property|\$ref|pattern at) \S+", r"\1 …", message)
    return re.sub(r"\d+(\.\d+)?", "N", message)[:110]


# -- coverage --------------------------------------------------------------------------------


def coverage(engine: Engine, sample: int) -> tuple[dict, dict]:
    backend = engine.core.grammar_backend()
    summary: dict[str, dict] = {}
    compiled: dict[str, dict] = {}  # "split/file" -> schema dict, for those that compile
    for split in SPLITS:
        jobs, causes, seconds = [], collections.Counter(), []
        for name, text in load_schemas(split, sample, seed=0):
            try:
                params = SamplingParams(json_schema=json.loads(text))
            except ValueError as exc:
                causes["refused: " + cause(str(exc))] += 1
                continue
            jobs.append((name, text, backend.submit(GrammarSpec.of(params))))
        for i, (name, text, future) in enumerate(jobs):
            jobs[i] = None  # indexes can be large: keep only what the cache keeps
            try:
                seconds.append(future.result().compile_seconds)
                compiled[f"{split}/{name}"] = json.loads(text)
            except Exception as exc:
                kind = "timeout" if "timed out" in str(exc) else "compile failed"
                causes[f"{kind}: " + cause(str(exc))] += 1
            del future
        total = len(seconds) + sum(causes.values())
        seconds.sort()
        summary[split] = {
            "schemas": total, "compiled": len(seconds), "coverage": len(seconds) / total,
            "compile_p50_s": statistics.median(seconds),
            "compile_p90_s": seconds[int(0.9 * (len(seconds) - 1))],
            "compile_max_s": seconds[-1], "errors_by_cause": dict(causes.most_common())}
    return summary, compiled


# -- validity and jump-forward ------------------------------------------------------------------


def chat_prompt(name: str, schema: dict) -> list[dict]:
    function = name.rsplit("/", 1)[-1].rsplit("_", 1)[0].removesuffix(".json")
    return [{"role": "user", "content": (
        f"Call the function `{function}` with realistic arguments. Its parameters follow this "
        f"JSON Schema:\n{json.dumps(schema, separators=(',', ':'))}\n"
        "Reply with the JSON arguments only.")}]


def validity(engine: Engine, cases: list[tuple[str, dict]], new_tokens: int) -> dict:
    params = [SamplingParams(json_schema=s, temperature=0, repetition_penalty=1.2,
                             max_new_tokens=new_tokens) for _, s in cases]
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.chat([chat_prompt(n, s) for n, s in cases], params)
    wall = time.perf_counter() - start
    after = engine.stats()
    counts = collections.Counter()
    invalid = []
    for (name, schema), out in zip(cases, outs):
        counts[out.finish_reason] += 1
        if out.finish_reason != "stop":
            continue
        try:
            cls = jsonschema.validators.validator_for(schema)
            cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(out.text))
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append({"schema": name, "output": out.text, "error": str(exc)[:300]})
    delta = {k: after[k] - before[k] for k in ("steps", "generated_tokens",
                                              "jump_forward_tokens")}
    return {"requests": len(cases), "finished": counts["stop"], "valid": counts["valid"],
            "cut_by_length": counts["length"], "aborted": counts["abort"],
            "invalid": invalid, "wall_s": wall, **delta}


# -- overhead and throughput ---------------------------------------------------------------------


class GrammarTimer:
    """Wraps the grammar work done per step and sums its time."""

    TARGETS = [(ModelRunner, "_grammar_masks"), (sampler, "apply_token_bitmask"),
               (GrammarMatcher, "accept"), (GrammarBackend, "forced_tokens")]

    def __init__(self) -> None:
        self.seconds = collections.Counter()
        self._saved = []

    def __enter__(self) -> "GrammarTimer":
        self._saved = []
        for owner, name in self.TARGETS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._timed(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)

    def _timed(self, label, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
        return timed


def person_prompts(engine: Engine, count: int) -> list[list[int]]:
    return [engine.encode_chat([{"role": "user", "content":
                                 f"Describe {PEOPLE[i % len(PEOPLE)]} (person {i}) as JSON "
                                 "with name, age, city and hobbies."}]) for i in range(count)]


def run_batch(engine: Engine, prompts, params, batch: int):
    """Generate in groups of `batch` requests; returns (outputs, wall seconds, CPU seconds).
    CPU seconds (of this process, all threads) are less sensitive than wall time to other
    work on a shared machine."""
    outs, start, cpu = [], time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(input_ids=prompts[i:i + batch], sampling_params=params[i:i + batch])
    return outs, time.perf_counter() - start, time.process_time() - cpu


def overhead_and_throughput(engine: Engine, batch: int, requests: int, rounds: int) -> dict:
    """Constrained and unconstrained runs alternate `rounds` times (the machine's load
    drifts); ratios are medians over the rounds."""
    prompts = person_prompts(engine, requests)
    constrained = [SamplingParams(json_schema=PERSON, temperature=0.7, seed=i,
                                  max_new_tokens=96) for i in range(requests)]
    run_batch(engine, prompts, constrained, batch)  # compiled grammar and per-state caches
    timer, ratios, cpu_ratios = GrammarTimer(), [], []
    times = {"constrained": 0.0, "unconstrained": 0.0}
    for _ in range(rounds):
        before = engine.stats()
        with timer:
            outs, constrained_s, constrained_cpu = run_batch(engine, prompts, constrained, batch)
        after = engine.stats()
        tokens = sum(o.completion_tokens for o in outs)
        # The same requests unconstrained, each held to its constrained twin's length.
        plain = [SamplingParams(temperature=0.7, seed=i, max_new_tokens=o.completion_tokens,
                                min_new_tokens=o.completion_tokens, ignore_eos=True)
                 for i, o in enumerate(outs)]
        plain_before = engine.stats()
        _, plain_s, plain_cpu = run_batch(engine, prompts, plain, batch)
        plain_steps = engine.stats()["steps"] - plain_before["steps"]
        ratios.append(plain_s / constrained_s)
        cpu_ratios.append(plain_cpu / constrained_cpu)
        times["constrained"] += constrained_s
        times["unconstrained"] += plain_s
    grammar_s = sum(timer.seconds.values()) / rounds
    return {
        "batch": batch, "requests": requests, "rounds": rounds, "tokens": tokens,
        "constrained_tokens_per_s": rounds * tokens / times["constrained"],
        "unconstrained_tokens_per_s": rounds * tokens / times["unconstrained"],
        "constrained_vs_unconstrained": statistics.median(ratios),
        "constrained_vs_unconstrained_cpu_time": statistics.median(cpu_ratios),
        "constrained_steps": after["steps"] - before["steps"], "unconstrained_steps": plain_steps,
        "jump_forward_tokens": after["jump_forward_tokens"] - before["jump_forward_tokens"],
        "grammar_us_per_token": 1e6 * grammar_s / tokens,
        "grammar_share_of_wall": grammar_s * rounds / times["constrained"],
        "grammar_us_per_token_by_part": {k: 1e6 * v / rounds / tokens
                                         for k, v in timer.seconds.items()},
        "finished": sum(o.finish_reason == "stop" for o in outs),
    }


def validity_sample(compiled: dict, size: int) -> list[tuple[str, dict]]:
    """A fixed sample of the schemas that compiled: two thirds Glaive, a third GitHub."""
    rng = random.Random(1)
    names = {s: sorted(k for k in compiled if k.startswith(s)) for s in SPLITS}
    glaive = rng.sample(names[SPLITS[0]], min(len(names[SPLITS[0]]), 2 * size // 3))
    github = rng.sample(names[SPLITS[1]], min(len(names[SPLITS[1]]), size - len(glaive)))
    return [(k, compiled[k]) for k in glaive + github]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coverage-sample", type=int, default=300, help="schemas per split")
    parser.add_argument("--generate-sample", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # clamped bounds and refused schemas are counted instead
    options = dict(max_total_tokens=32768, grammar_compile_timeout=args.timeout,
                   grammar_cache_size=4096, grammar_cache_memory_gb=3.0)

    settings = {"default": {},
                "jump-forward off": {"enable_jump_forward": False},
                "compact JSON": {"json_max_whitespace": 0},
                "compact JSON, jump-forward off": {"json_max_whitespace": 0,
                                                   "enable_jump_forward": False}}
    valid, perf, cov, cases = {}, {}, None, []
    for label, extra in settings.items():
        with Engine(**options, **extra) as engine:
            if cov is None:
                cov, compiled = coverage(engine, args.coverage_sample)
                cases = validity_sample(compiled, args.generate_sample)
            valid[label] = validity(engine, cases, args.new_tokens)
            for batch, requests, rounds in ((1, 4, 2), (32, 32, 3)):
                perf[f"{label}, batch {batch}"] = overhead_and_throughput(
                    engine, batch, requests, rounds)

    print(f"\n{platform.machine()}, {torch.get_num_threads()} threads, float32")
    for split, r in cov.items():
        print(f"{split}: {r['compiled']}/{r['schemas']} compile ({r['coverage']:.1%}), "
              f"p50 {r['compile_p50_s']:.2f}s p90 {r['compile_p90_s']:.2f}s "
              f"max {r['compile_max_s']:.1f}s")
        for why, n in r["errors_by_cause"].items():
            print(f"    {n:4d}  {why}")
    for label, r in valid.items():
        print(f"validity, {label}: {r['valid']}/{r['finished']} finished outputs valid, "
              f"{r['cut_by_length']} cut at {args.new_tokens} tokens, {r['aborted']} aborted; "
              f"{r['generated_tokens']} tokens ({r['jump_forward_tokens']} jumped) in "
              f"{r['steps']} steps, {r['wall_s']:.1f}s")
    for label, r in perf.items():
        print(f"{label}: grammar {r['grammar_us_per_token']:.0f} us/token "
              f"({r['grammar_share_of_wall']:.1%} of wall), constrained "
              f"{r['constrained_tokens_per_s']:.1f} tok/s vs unconstrained "
              f"{r['unconstrained_tokens_per_s']:.1f} tok/s "
              f"(x{r['constrained_vs_unconstrained']:.2f} wall, "
              f"x{r['constrained_vs_unconstrained_cpu_time']:.2f} CPU time), "
              f"{r['constrained_steps']} steps vs "
              f"{r['unconstrained_steps']}, {r['jump_forward_tokens']} tokens jumped")

    record = {"benchmark": "structured", "date": datetime.date.today().isoformat(),
              "machine": {"processor": cpu_name(), "cores": os.cpu_count(),
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else None,
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "note": "shared machine: other jobs ran alongside; compare ratios "
                                  "measured in the same setting, not absolute tokens/s"},
              "config": {"model": "smollm2-135m-instruct", "dtype": "float32",
                         "coverage_sample_per_split": args.coverage_sample,
                         "generate_sample": len(cases), "new_tokens": args.new_tokens,
                         "compile_timeout_s": args.timeout},
              "coverage": cov, "validity": valid, "overhead_and_throughput": perf}
    out = Path(args.out or Path(__file__).parent / "results" /
               f"structured_cpu_float32_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
