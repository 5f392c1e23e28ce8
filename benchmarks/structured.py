"""Structured output: both grammar engines and llguidance's own strict mode as the peer, in
one run on the same schemas (the embedded model on the CPU by default).

Sections:
  coverage    JSONSchemaBench schemas (a seeded sample of every split present): how many each
              engine accepts, compile latency p50/p90/p99/max (one compile at a time), and
              the refusals grouped by cause. The peer is llguidance used directly
              (`LLMatcher` on the raw schema, strict), so the figure to beat is its own;
  soundness   for every accepted schema, random walks under the engine's masks (each allowed
              token equally likely, EOS where the grammar may end): every finished walk must
              validate with jsonschema, formats included. Unsound outputs are counted, and
              walks the matcher gave up on (a parser limit hit mid-way);
  mask        per-token mask cost over those walks: p50/p99 microseconds;
  validity    greedy chat generation on a fixed sample of schemas every engine accepts:
              finished outputs validated, outputs cut by max_new_tokens counted apart;
  throughput  the same requests with a JSON schema and unconstrained (each held to the
              constrained twin's length), at batch 1 and 64, with the cost of every mask the
              engine fills while decoding.

    python benchmarks/structured.py [--coverage-sample 300] [--outlines-sample 60]
    python benchmarks/structured.py --sections throughput --model FOLDER --load-format dummy
        (a GPU run: random weights in FOLDER's config, with its tokenizer)

The schemas are in ../shared/data/jsonschemabench/<split>/*.json; without them the
benchmark says where to get them (github.com/guidance-ai/jsonschemabench, data/<split>).
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
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np
import torch

from radixlm.runtime import Engine, EngineConfig, SamplingParams
from radixlm.runtime.grammar import create_grammar_engine
from radixlm.runtime.grammar.spec import GrammarSpec

from results_dir import results_dir

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"
ENGINES = ("llguidance", "outlines")
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"},
                                            "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
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


def splits() -> list[str]:
    found = sorted(p.name for p in DATA.glob("*") if p.is_dir() and any(p.glob("*.json")))
    if not found:
        sys.exit(f"no JSONSchemaBench schemas under {DATA}: put each split's schemas there as "
                 "<split>/*.json (from github.com/guidance-ai/jsonschemabench, data/<split>)")
    return found


def load_schemas(split: str, sample: int) -> list[tuple[str, str]]:
    files = sorted(p.name for p in (DATA / split).glob("*.json"))
    picked = random.Random(0).sample(files, min(sample, len(files)))
    return [(f"{split}/{f}", (DATA / split / f).read_text()) for f in picked]


def cause(message: str) -> str:
    """Group refusals: drop JSON pointers, quoted names and numbers."""
    message = re.sub(r" at /\S*", "", message.split(" (at ")[0])
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "…", message)
    return re.sub(r"\d+(\.\d+)?", "N", message)[:100]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def latency_ms(seconds: list[float]) -> dict[str, float]:
    return {q: 1e3 * percentile(seconds, p)
            for q, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}


def valid(schema: dict, text: str) -> bool:
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


# -- coverage, soundness and mask cost, per engine ----------------------------------------------


class PeerCompiler:
    """llguidance used directly on the raw schema (strict: unknown keywords are errors)."""

    def __init__(self, tokenizer) -> None:
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def compile(self, text: str) -> None:
        LLMatcher = self.llg.LLMatcher
        matcher = LLMatcher(self.tokenizer, LLMatcher.grammar_from_json_schema(text),
                            log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])


def random_walk(matcher, rng: random.Random, eos: int, limit: int,
                mask_seconds: list[float]) -> list[int] | None:
    out: list[int] = []
    row = np.zeros(matcher.mask_words, dtype=np.uint32)
    for _ in range(limit):
        if matcher.is_terminated:
            return out
        start = time.perf_counter()
        matcher.fill_mask(row)
        mask_seconds.append(time.perf_counter() - start)
        choices = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        token = rng.choice([int(c) for c in choices] + ([eos] if matcher.is_final else []))
        if token == eos:
            return out
        matcher.accept(token)
        out.append(token)
    return None


def engine_coverage(name: str, tokenizer, schemas: list[tuple[str, str]], timeout: float,
                    walks: int) -> tuple[dict, set[str]]:
    config = EngineConfig(grammar_backend=name, grammar_compile_timeout=timeout,
                          grammar_cache_size=8)
    grammars = create_grammar_engine(name, tokenizer, len(tokenizer), config)
    accepted, seconds, causes = set(), [], collections.Counter()
    unsound, finished, masks, unsound_examples, walk_errors = 0, 0, [], [], []
    for key, text in schemas:
        start = time.perf_counter()
        try:
            spec = GrammarSpec.of(SamplingParams(json_schema=text))
            compiled = grammars.submit(spec).result()
        except Exception as exc:
            causes[cause(str(exc))] += 1
            continue
        seconds.append(time.perf_counter() - start)
        accepted.add(key)
        schema = json.loads(text)
        for seed in range(walks):
            try:
                tokens = random_walk(compiled.matcher(), random.Random(seed),
                                     tokenizer.eos_token_id, 300, masks)
            except Exception as exc:  # the matcher gave up mid-walk (a parser limit)
                walk_errors.append({"schema": key, "error": str(exc).splitlines()[0][:200]})
                continue
            if tokens is None:
                continue
            finished += 1
            output = tokenizer.decode(tokens)
            if not valid(schema, output):
                unsound += 1
                unsound_examples.append({"schema": key, "output": output[:300]})
        del compiled
    grammars.close()
    return {"schemas": len(schemas), "accepted": len(accepted),
            "coverage": len(accepted) / len(schemas),
            "compile_ms": latency_ms(seconds),
            "walks_finished": finished, "unsound": unsound, "walk_errors": walk_errors,
            "unsound_examples": unsound_examples[:5],
            "mask_us": {"p50": 1e6 * percentile(masks, 50), "p99": 1e6 * percentile(masks, 99),
                        "masks": len(masks)},
            "refusals_by_cause": dict(causes.most_common(12))}, accepted


def peer_coverage(tokenizer, schemas: list[tuple[str, str]]) -> tuple[dict, set[str]]:
    peer = PeerCompiler(tokenizer)
    accepted, seconds, causes = set(), [], collections.Counter()
    for key, text in schemas:
        start = time.perf_counter()
        try:
            peer.compile(text)
        except Exception as exc:
            causes[cause(str(exc))] += 1
            continue
        seconds.append(time.perf_counter() - start)
        accepted.add(key)
    return {"schemas": len(schemas), "accepted": len(accepted),
            "coverage": len(accepted) / len(schemas),
            "compile_ms": latency_ms(seconds),
            "refusals_by_cause": dict(causes.most_common(12))}, accepted


# -- generation on the model -------------------------------------------------------------------


def chat_prompt(name: str, schema: dict) -> list[dict]:
    function = name.rsplit("/", 1)[-1].rsplit("_", 1)[0].removesuffix(".json")
    return [{"role": "user", "content": (
        f"Call the function `{function}` with realistic arguments. Its parameters follow this "
        f"JSON Schema:\n{json.dumps(schema, separators=(',', ':'))}\n"
        "Reply with the JSON arguments only.")}]


def validity(engine: Engine, cases: list[tuple[str, dict]], new_tokens: int) -> dict:
    params = [SamplingParams(json_schema=s, temperature=0, repetition_penalty=1.2,
                             max_new_tokens=new_tokens) for _, s in cases]
    start = time.perf_counter()
    outs = engine.chat([chat_prompt(n, s) for n, s in cases], params)
    wall = time.perf_counter() - start
    counts = collections.Counter(o.finish_reason for o in outs)
    invalid = [{"schema": n, "output": o.text[:300]} for (n, s), o in zip(cases, outs)
               if o.finish_reason == "stop" and not valid(s, o.text)]
    return {"requests": len(cases), "finished": counts["stop"],
            "valid": counts["stop"] - len(invalid), "cut_by_length": counts["length"],
            "aborted": counts["abort"], "invalid": invalid, "wall_s": wall}


class MaskTimer:
    """Times every batch of masks the engine fills while it decodes (one call per step, every
    constrained request's row in it): per step, and per token (the step's time over its rows)."""

    def __init__(self) -> None:
        from radixlm.runtime.execution.sampling.grammar_masks import BatchBitmask

        self.cls = BatchBitmask
        self.steps: list[tuple[float, int]] = []  # (seconds, rows)

    def per_token(self) -> list[float]:
        return [seconds / rows for seconds, rows in self.steps]

    def __enter__(self) -> "MaskTimer":
        original = self.original = self.cls.fill
        steps = self.steps

        def timed(bitmask, requests):
            start = time.perf_counter()
            try:
                return original(bitmask, requests)
            finally:
                steps.append((time.perf_counter() - start, len(requests)))

        self.cls.fill = timed
        return self

    def __exit__(self, *exc) -> None:
        self.cls.fill = self.original


def run_batch(engine: Engine, prompts, params, batch: int) -> tuple[list, float]:
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(input_ids=prompts[i:i + batch],
                                sampling_params=params[i:i + batch])
    return outs, time.perf_counter() - start


def throughput(engine: Engine, batch: int, requests: int, rounds: int) -> dict:
    """Constrained and unconstrained runs alternate `rounds` times (the machine's load
    drifts); the ratio is the median over the rounds."""
    prompts = [engine.encode_chat([{"role": "user", "content":
                                    f"Describe {PEOPLE[i % len(PEOPLE)]} (person {i}) as "
                                    "JSON with name, age, city and hobbies."}])
               for i in range(requests)]
    constrained = [SamplingParams(json_schema=PERSON, temperature=0.7, seed=i,
                                  max_new_tokens=96) for i in range(requests)]
    run_batch(engine, prompts, constrained, batch)  # warm: compiled grammar, caches
    ratios, tokens_per_s = [], collections.defaultdict(list)
    masks, mask_wall = MaskTimer(), 0.0
    for _ in range(rounds):
        before = engine.stats()
        with masks:
            outs, constrained_s = run_batch(engine, prompts, constrained, batch)
        mask_wall += constrained_s
        steps = engine.stats()["steps"] - before["steps"]
        tokens = sum(o.completion_tokens for o in outs)
        plain = [SamplingParams(temperature=0.7, seed=i, max_new_tokens=o.completion_tokens,
                                min_new_tokens=o.completion_tokens, ignore_eos=True)
                 for i, o in enumerate(outs)]
        before = engine.stats()
        _, plain_s = run_batch(engine, prompts, plain, batch)
        plain_steps = engine.stats()["steps"] - before["steps"]
        ratios.append(plain_s / constrained_s)
        tokens_per_s["constrained"].append(tokens / constrained_s)
        tokens_per_s["unconstrained"].append(tokens / plain_s)
    return {"batch": batch, "requests": requests, "rounds": rounds, "tokens": tokens,
            "constrained_tokens_per_s": statistics.median(tokens_per_s["constrained"]),
            "unconstrained_tokens_per_s": statistics.median(tokens_per_s["unconstrained"]),
            "constrained_vs_unconstrained": statistics.median(ratios),
            "constrained_steps": steps, "unconstrained_steps": plain_steps,
            "mask_us": {"p50": 1e6 * percentile(masks.per_token(), 50),
                        "p99": 1e6 * percentile(masks.per_token(), 99),
                        "step_p50": 1e6 * percentile([t for t, _ in masks.steps], 50),
                        "step_p99": 1e6 * percentile([t for t, _ in masks.steps], 99),
                        "share_of_wall": sum(t for t, _ in masks.steps) / mask_wall},
            "finished": sum(o.finish_reason == "stop" for o in outs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coverage-sample", type=int, default=300, help="schemas per split")
    parser.add_argument("--outlines-sample", type=int, default=60,
                        help="schemas per split for outlines-core (its compiles take seconds)")
    parser.add_argument("--walks", type=int, default=3, help="random walks per schema")
    parser.add_argument("--generate-sample", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--sections", default="coverage,validity,throughput",
                        help="which to run (validity needs coverage)")
    parser.add_argument("--model", default=None,
                        help="model for validity and throughput (default: the embedded one)")
    parser.add_argument("--load-format", default="auto",
                        help="'dummy': random weights in the model folder's shape (GPU runs)")
    parser.add_argument("--engine-options", default="{}",
                        help='extra Engine options as JSON, e.g. \'{"overlap_schedule": "off"}\'')
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if "validity" in sections and "coverage" not in sections:
        parser.error("--sections: validity needs coverage")
    logging.disable(logging.WARNING)  # refusals are counted instead
    coverage: dict[str, dict] = collections.defaultdict(dict)
    by_key: dict[str, dict] = {}
    both: set[str] = set()  # the generation sample: schemas every engine accepts
    if "coverage" in sections:
        from transformers import AutoTokenizer

        from radixlm.runtime.models.loader import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    for split in (splits() if "coverage" in sections else []):
        schemas = load_schemas(split, args.coverage_sample)
        by_key.update((key, json.loads(text)) for key, text in schemas)
        coverage["llguidance strict (peer)"][split], _ = peer_coverage(tokenizer, schemas)
        accepted = {}
        for name in ENGINES:
            sample = schemas[: args.outlines_sample] if name == "outlines" else schemas
            start = time.perf_counter()
            coverage[name][split], accepted[name] = engine_coverage(
                name, tokenizer, sample, args.timeout, args.walks)
            print(f"coverage {name} {split}: {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        both |= set.intersection(*accepted.values())
    cases = [(k, by_key[k]) for k in random.Random(1).sample(
        sorted(both), min(args.generate_sample, len(both)))]

    generation, speed = {}, {}
    device, dtype = "cpu", "float32"
    for name in ENGINES if sections & {"validity", "throughput"} else ():
        options = {"max_total_tokens": 32768, "load_format": args.load_format,
                   "grammar_compile_timeout": args.timeout, **json.loads(args.engine_options)}
        with Engine(args.model, grammar_backend=name, **options) as engine:
            if "validity" in sections:
                generation[name] = validity(engine, cases, args.new_tokens)
            if "throughput" in sections:
                for batch, requests, rounds in ((1, 4, 2), (64, 64, 2)):
                    speed[f"{name}, batch {batch}"] = throughput(engine, batch, requests,
                                                                 rounds)
            device = engine.device.type
            dtype = str(engine.dtype).removeprefix("torch.")

    print(f"\n{cpu_name()}, {torch.get_num_threads()} threads, {datetime.date.today()}")
    if coverage:
        print(f"{'engine':26} {'split':12} {'accepted':>10} {'p50 ms':>8} {'p90 ms':>8} "
              f"{'p99 ms':>8} {'max ms':>8} {'unsound':>9} {'err':>3} {'mask p50/p99 us':>16}")
    for name, per_split in coverage.items():
        for split, r in per_split.items():
            mask = r.get("mask_us")
            print(f"{name:26} {split:12} {r['accepted']:4d}/{r['schemas']:<4d} "
                  f"{r['compile_ms']['p50']:8.2f} {r['compile_ms']['p90']:8.2f} "
                  f"{r['compile_ms']['p99']:8.2f} {r['compile_ms']['max']:8.1f} "
                  + (f"{r['unsound']:4d}/{r['walks_finished']:<4d} "
                     f"{len(r['walk_errors']):3d} "
                     f"{mask['p50']:7.1f}/{mask['p99']:<7.1f}" if mask else ""))
    for name, r in generation.items():
        print(f"validity, {name}: {r['valid']}/{r['finished']} finished outputs valid, "
              f"{r['cut_by_length']} cut at {args.new_tokens} tokens, {r['aborted']} aborted "
              f"({r['requests']} requests, {r['wall_s']:.1f}s)")
    for label, r in speed.items():
        m = r["mask_us"]
        print(f"{label}: constrained {r['constrained_tokens_per_s']:.1f} tok/s, unconstrained "
              f"{r['unconstrained_tokens_per_s']:.1f} tok/s "
              f"(x{r['constrained_vs_unconstrained']:.2f}), {r['constrained_steps']} steps vs "
              f"{r['unconstrained_steps']}; masks per token p50 {m['p50']:.0f} us, p99 "
              f"{m['p99']:.0f} us (per step {m['step_p50']:.0f} / {m['step_p99']:.0f} us), "
              f"{m['share_of_wall']:.1%} of wall")

    model = args.model or "smollm2-135m-instruct"
    record = {"benchmark": "structured", "date": datetime.date.today().isoformat(),
              "machine": {"processor": cpu_name(), "cores": os.cpu_count(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
              "config": {"model": model, "load_format": args.load_format,
                         "engine_options": json.loads(args.engine_options),
                         "sections": sorted(sections), "device": device, "dtype": dtype,
                         "coverage_sample_per_split": args.coverage_sample,
                         "outlines_sample_per_split": args.outlines_sample,
                         "walks_per_schema": args.walks, "generate_sample": len(cases),
                         "new_tokens": args.new_tokens, "compile_timeout_s": args.timeout},
              "coverage": coverage, "validity": generation, "throughput": speed}
    label = "h200" if device == "cuda" else f"cpu_{dtype}"
    out = Path(args.out or results_dir() /
               f"structured_{label}_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
