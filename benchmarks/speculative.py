"""Speculative decoding against plain decoding, in one run, at batch 1.

For each workload the same greedy requests run without speculation and with it; reported:
the mean accepted length (tokens gained per target forward of a speculating request),
target forwards per output token, the wall-clock speedup, and whether the outputs are
identical (they must be).

`text` (either device, the default model on real text; the CPU default):
  extract   n-gram drafts on extractive prompts: repeat / quote / fix a passage of the
            Python documentation (prompt lookup's home ground);
  json      n-gram drafts under a JSON schema: copy a record given in the prompt.
`forced` (`--device cuda`, Llama-3-8B-shaped target with random fp32 weights):
  forced    the mechanism's cost against its gain: drafts taken from the target's own
            greedy output (from a plain run), each draft token replaced by a wrong one with
            probability 1 - alpha, for alpha in 0 .. 1, at a fixed k (random weights give
            no real drafts). fp32, because random weights make next-token distributions
            nearly flat: in bf16 a 5-token verify step and a 1-token step round differently
            and pick different argmaxes, so the plain run's tokens stop being the target's
            predictions after a few steps;
  forced-bf16  the same in bf16, with the verification outcome forced too: the first a
            drafts are accepted with a ~ Geometric(alpha) (capped at k), whatever the model
            says, so the output is not the model's; this measures what a step of the
            mechanism costs at the dtype that is served;
  draft     a Llama-3.2-1B-shaped draft model (random weights, so it is rejected): what
            drafting with a model costs per step.
`copy` (either device; the target is `--model`, a preset shape or a folder with config.json,
default llama-3-8b, with random weights):
  copy      n-gram drafts verified for real, on text a random model does repeat: greedy
            decoding of random weights falls into short cycles (a handful of distinct tokens
            over and over), so prompt lookup finds its drafts in the output so far. Prompts:
            a random 32-token segment repeated 8 times, and 256 random tokens; fp32 (the
            outputs with and without speculation must be identical) and bf16 (the served
            dtype; the flat random distributions round differently in a verify step, so the
            two outputs part after a while: the tokens they agree on are reported).

    python benchmarks/speculative.py [--k 4]
    python benchmarks/speculative.py --device cuda                    # forced, draft, copy
    python benchmarks/speculative.py --device cuda --workloads copy   # ~2 min on an H200
    python benchmarks/speculative.py --workloads copy --model DIR     # a small config, CPU
    python benchmarks/speculative.py --device cuda --workloads text   # the real model, GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import time
from pathlib import Path
from typing import Iterator

import torch

from radixlm.runtime import Engine, SamplingParams
from radixlm.runtime.execution import speculative
from radixlm.runtime.models.loader import DEFAULT_MODEL

from results_dir import results_dir

VERIFY_GREEDY = speculative.verify_greedy
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"}, "languages": {"type": "array", "items": {"type": "string"},
                                              "maxItems": 4}},
    "required": ["name", "city", "age", "languages"]}
RECORDS = [{"name": "Alice Martin", "city": "Lyon", "age": 34, "languages": ["French", "C"]},
           {"name": "Bob Okafor", "city": "Lagos", "age": 51, "languages": ["Yoruba"]},
           {"name": "Chen Wei", "city": "Chengdu", "age": 27, "languages": ["Python", "Go"]},
           {"name": "Dana Kowalski", "city": "Krakow", "age": 45, "languages": ["Polish"]}]


def extract_prompts(engine: Engine, count: int) -> list[str]:
    from pydoc_data.topics import topics

    names = sorted(k for k, v in topics.items() if 800 < len(v) < 4000)[:count]
    asks = ["Repeat the following text exactly.", "Quote the first paragraph of this text.",
            "Copy this documentation, fixing nothing."]
    prompts = []
    for i, name in enumerate(names):
        text = topics[name][:1200]
        chat = [{"role": "user", "content": f"{asks[i % len(asks)]}\n\n{text}"}]
        prompts.append(engine.apply_chat_template(chat))
    return prompts


def json_prompts(engine: Engine) -> list[str]:
    return [engine.apply_chat_template([{"role": "user", "content":
            f"Return this record as JSON, unchanged:\n{json.dumps(r)}"}]) for r in RECORDS]


def run(engine: Engine, prompts: list, params: SamplingParams) -> dict:
    """Batch 1: one request at a time, as a latency-bound user would."""
    before = engine.stats()
    start = time.perf_counter()
    outs = [engine.generate(p, params) if isinstance(p, str)
            else engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    seconds = time.perf_counter() - start
    after = engine.stats()
    tokens = sum(o.completion_tokens for o in outs)
    steps = after["steps"] - before["steps"]
    spec = {k: after.get(k, 0) - before.get(k, 0) for k in
            ("spec_drafted_tokens", "spec_accepted_tokens")}
    return {"seconds": seconds, "output_tokens": tokens, "target_forwards": steps,
            "forwards_per_token": steps / tokens, "tokens_per_s": tokens / seconds,
            **spec, "outputs": [o.token_ids for o in outs]}


def agreement(plain: dict, spec: dict) -> float:
    """The share of output tokens before the two runs' outputs first differ."""
    same = 0
    for a, b in zip(plain["outputs"], spec["outputs"]):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(1, sum(len(a) for a in plain["outputs"]))


def compare(name: str, plain: dict, spec: dict, k: int) -> dict:
    drafted, accepted = spec["spec_drafted_tokens"], spec["spec_accepted_tokens"]
    row = {"workload": name, "k": k,
           "plain_tokens_per_s": plain["tokens_per_s"], "spec_tokens_per_s": spec["tokens_per_s"],
           "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
           "forwards_per_token": spec["forwards_per_token"],
           # Tokens per target forward while speculating: accepted drafts + the one token.
           "mean_accept_length": spec["output_tokens"] / spec["target_forwards"],
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "identical": plain["outputs"] == spec["outputs"],
           "agreeing_prefix": agreement(plain, spec)}
    print(f"{name:<22}{row['plain_tokens_per_s']:>10.1f}{row['spec_tokens_per_s']:>10.1f}"
          f"{row['speedup']:>9.2f}x{row['mean_accept_length']:>11.2f}"
          f"{row['forwards_per_token']:>11.3f}{row['acceptance_rate']:>9.1%}"
          f"{'':>3}{row['identical']}"
          + ("" if row["identical"] else f" ({row['agreeing_prefix']:.0%} before they part)"))
    return row


def header() -> None:
    print(f"{'workload':<22}{'plain t/s':>10}{'spec t/s':>10}{'speedup':>10}{'accept len':>11}"
          f"{'fwd/token':>11}{'accept':>9}   identical")


def run_text(args) -> list[dict]:
    rows = []
    greedy = SamplingParams(temperature=0, max_new_tokens=args.new_tokens)
    constrained = SamplingParams(temperature=0, max_new_tokens=120, json_schema=SCHEMA)
    with Engine(max_total_tokens=32768, device=args.device) as plain_engine, Engine(
            max_total_tokens=32768, device=args.device, speculative="ngram",
            num_speculative_tokens=args.k) as spec_engine:
        header()
        for name, prompts, params in (
                ("extract (n-gram)", extract_prompts(plain_engine, args.prompts), greedy),
                ("json schema (n-gram)", json_prompts(plain_engine), constrained)):
            for engine in (plain_engine, spec_engine):  # warm-up, and compile the grammar
                engine.generate(prompts[0], SamplingParams(max_new_tokens=4,
                                                           json_schema=params.json_schema))
            rows.append(compare(name, run(plain_engine, prompts, params),
                                run(spec_engine, prompts, params), args.k))
    return rows


def forced_verifier(alpha: float, rng: random.Random):
    """A stand-in for verify_greedy that accepts the first a drafts, a ~ Geometric(alpha)
    capped at the row's drafts, then emits the target's argmax at position a."""
    def verify(drafts, logits, counts):
        accepted = []
        for n in counts:
            a = 0
            while a < n and rng.random() < alpha:
                a += 1
            accepted.append(a)
        out = logits.argmax(dim=-1)
        out[:, : drafts.shape[1]] = torch.where(
            torch.arange(drafts.shape[1], device=drafts.device)[None] < torch.tensor(
                accepted, device=drafts.device)[:, None], drafts, out[:, : drafts.shape[1]])
        a = torch.tensor(accepted, device=drafts.device)
        out = out.masked_fill(torch.arange(out.shape[1], device=out.device)[None] > a[:, None],
                              speculative.PAD_TOKEN)
        return speculative.Verified(a, out)
    return verify


def copy_prompts(count: int, vocab: int) -> dict[str, list[list[int]]]:
    """Half the prompts a random 32-token segment said 8 times, half 256 random tokens."""
    gen = torch.Generator().manual_seed(1)
    segments = torch.randint(0, vocab, (count, 32), generator=gen).tolist()
    return {"repeated": [s * 8 for s in segments],
            "random": torch.randint(0, vocab, (count, 256), generator=gen).tolist()}


def run_copy(args) -> Iterator[dict]:
    """n-gram speculation on a random model's own repetitive greedy output, verified for real:
    each dtype's plain and speculative engines decode the same prompts at batch 1."""
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    header()
    for dtype in args.copy_dtypes.split(","):
        options = dict(load_format="dummy", device=args.device, dtype=dtype,
                       max_total_tokens=32768, max_running_requests=8)
        runs: dict[str, dict[str, dict]] = {}
        for mode, extra in (("plain", {}), ("ngram", dict(speculative="ngram",
                                                          num_speculative_tokens=args.k))):
            with Engine(args.model, **options, **extra) as engine:
                prompts = copy_prompts(args.copy_prompts, engine.model_config.vocab_size)
                run(engine, prompts["random"][:1], SamplingParams(
                    temperature=0, max_new_tokens=64, ignore_eos=True))  # warm-up
                runs[mode] = {kind: run(engine, ids, params) for kind, ids in prompts.items()}
        for kind in runs["plain"]:
            plain, spec = runs["plain"][kind], runs["ngram"][kind]
            row = compare(f"copy {dtype} {kind}", plain, spec, args.k)
            row.update(dtype=dtype, prompts=kind, distinct_output_tokens=[
                len(set(o)) for o in plain["outputs"]])
            yield row


def run_cuda(args) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 128256, (args.prompts, 512), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)
    header()
    for dtype in ("float32", "bfloat16"):
        options = dict(load_format="dummy", device="cuda", dtype=dtype,
                       max_total_tokens=65536, max_running_requests=8)
        with Engine("llama-3-8b", **options) as engine:
            run(engine, prompts[:1], params)  # warm-up
            plain = run(engine, prompts, params)
        truth = {tuple(p): o for p, o in zip(prompts, plain["outputs"])}
        with Engine("llama-3-8b", speculative="ngram", num_speculative_tokens=args.k,
                    speculative_adaptive=False, **options) as engine:
            speculator = engine.core.speculator
            for alpha in (0.0, 0.5, 0.7, 0.9, 1.0):
                rng = random.Random(0)

                def oracle(request, k, alpha=alpha, rng=rng):
                    # The target's own next tokens, each wrong with probability 1 - alpha.
                    done = len(request.token_ids) - request.prompt_len
                    known = truth[tuple(request.prompt_ids)][done:done + k]
                    return [t if rng.random() < alpha else (t + 1) % 128256 for t in known]

                speculator._ngram = oracle
                if dtype == "bfloat16":
                    speculative.verify_greedy = forced_verifier(alpha, random.Random(1))
                run(engine, prompts[:1], params)  # warm-up at this k
                name = f"{'forced' if dtype == 'float32' else 'forced-bf16'} alpha={alpha}"
                rows.append(compare(name, plain, run(engine, prompts, params), args.k))
            speculative.verify_greedy = VERIFY_GREEDY
        with Engine("llama-3-8b", speculative="draft", draft_model="llama-3.2-1b",
                    num_speculative_tokens=args.k, **options) as engine:
            run(engine, prompts[:1], params)
            rows.append(compare(f"draft model {dtype}", plain, run(engine, prompts, params),
                                args.k))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workloads", default=None,
                        help="comma-separated: text (the CPU default: extract and json), "
                             "forced (CUDA: the forced sweeps and the draft model), copy "
                             "(default on CUDA: forced,copy)")
    parser.add_argument("--model", default="llama-3-8b",
                        help="the copy workload's target (preset shape or config folder)")
    parser.add_argument("--copy-prompts", type=int, default=4,
                        help="copy workload: prompts of each kind")
    parser.add_argument("--copy-dtypes", default="float32,bfloat16")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per request (default: 96; 256 for the copy workload)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    workloads = (args.workloads or ("forced,copy" if args.device == "cuda" else "text")
                 ).split(",")
    unknown = set(workloads) - {"text", "forced", "copy"}
    if unknown or (args.device == "cpu" and "forced" in workloads):
        parser.error(f"--workloads: unknown or CUDA-only: {', '.join(workloads)}")
    given, rows = args.new_tokens, []
    try:
        for name, run_workload, new_tokens in (("text", run_text, 96), ("forced", run_cuda, 96),
                                               ("copy", run_copy, 256)):
            if name in workloads:
                args.new_tokens = given or new_tokens
                for row in run_workload(args):  # the copy workload yields row by row
                    rows.append(row)
    finally:  # an interrupted run still records what it measured
        args.new_tokens = given
        machine = (torch.cuda.get_device_name() if args.device == "cuda"
                   else platform.processor() or platform.machine())
        record = {"benchmark": "speculative", "date": datetime.date.today().isoformat(),
                  "machine": {"device": machine, "threads": torch.get_num_threads(),
                              "torch": torch.__version__,
                              "python": platform.python_version()},  # its pydoc text
                  # the text workload runs the default model; --model is the copy workload's
                  "config": {**vars(args),
                             "text_model": DEFAULT_MODEL if "text" in workloads else None},
                  "rows": rows}
        tag = "h200" if args.device == "cuda" else "cpu"
        out = Path(args.out or results_dir() /
                   f"speculative_{tag}_{record['date']}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")

if __name__ == "__main__":
    main()
