"""Prefix sharing: the radix cache on vs off, in the same run.

On CPU, the default model and real text:
  shared-prefix  8 groups x 8 requests; each group shares a ~500-token system prompt
                 (Python documentation) and asks its own question.
  multi-turn     4 conversations x 4 turns; each turn resends the whole history.
On CUDA (`--device cuda`), a Llama-3-8B-shaped model with random bf16 weights and the same
shapes of workload in random token ids, scaled up: 16 groups x 16 requests sharing a
2,000-token prefix with 64-token questions, and 16 conversations x 4 turns of 256-token
user messages.
Reported per workload and setting: prefill tokens computed (and the ideal: each shared prefix
once plus the unique suffixes), cache hit rate, throughput, mean time to first token.

    python benchmarks/prefix_sharing.py [--dtype float32] [--new-tokens 32]
    python benchmarks/prefix_sharing.py --device cuda [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch

from radixlm.runtime import Engine

from results_dir import results_dir

QUESTIONS = ["Summarize this in one sentence.", "What is the main idea?",
             "Give one example.", "Which keyword matters most here?",
             "Explain it to a beginner.", "What could go wrong?",
             "List two related topics.", "Is this feature common in other languages?"]
FOLLOW_UPS = ["Tell me more.", "Can you give an example?", "Why is that?", "Thanks! One more?"]


def shared_prefix_prompts(tokenizer, groups: int = 8, per_group: int = 8) -> list[list[int]]:
    from pydoc_data.topics import topics

    names = sorted(k for k, v in topics.items() if len(v) > 2500)[:groups]
    prompts = []
    for name in names:
        system = topics[name][:2000]  # ~500 tokens
        for q in QUESTIONS[:per_group]:
            chat = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def random_shared_prefix_prompts(vocab: int, groups: int = 16, per_group: int = 16,
                                 prefix_len: int = 2000, suffix_len: int = 64) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(groups):
        prefix = torch.randint(0, vocab, (prefix_len,), generator=gen).tolist()
        for _ in range(per_group):
            prompts.append(prefix + torch.randint(0, vocab, (suffix_len,), generator=gen).tolist())
    return prompts


def ideal_prefill(prompts: list[list[int]], per_group: int) -> int:
    """Each group's common prefix once, plus every prompt's own suffix."""
    total = 0
    for g in range(0, len(prompts), per_group):
        group = prompts[g:g + per_group]
        common = len(os.path.commonprefix(group))
        total += common + sum(len(p) - common for p in group)
    return total


def run_shared_prefix(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return _summary(engine, before, time.perf_counter() - start, outs)


def run_multi_turn(engine: Engine, new_tokens: int, conversations: int = 4) -> dict:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    histories = [[{"role": "user", "content": f"Tell me a fact about the number {n + 2}."}]
                 for n in range(conversations)]
    before = engine.stats()
    start = time.perf_counter()
    outs = []
    for turn in range(len(FOLLOW_UPS)):
        texts = [engine.apply_chat_template(h) for h in histories]
        batch = engine.generate(texts, params)
        outs.extend(batch)
        for history, out in zip(histories, batch):
            history += [{"role": "assistant", "content": out.text},
                        {"role": "user", "content": FOLLOW_UPS[turn]}]
    return _summary(engine, before, time.perf_counter() - start, outs)


def run_multi_turn_ids(engine: Engine, new_tokens: int, conversations: int = 16,
                       turns: int = 4, message_len: int = 256) -> dict:
    """The multi-turn workload in token ids: each turn appends the reply and a new message."""
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)
    histories = [torch.randint(0, vocab, (message_len,), generator=gen).tolist()
                 for _ in range(conversations)]
    before = engine.stats()
    start = time.perf_counter()
    outs = []
    for _ in range(turns):
        batch = engine.generate(input_ids=histories, sampling_params=params)
        outs.extend(batch)
        histories = [h + out.token_ids
                     + torch.randint(0, vocab, (message_len,), generator=gen).tolist()
                     for h, out in zip(histories, batch)]
    return _summary(engine, before, time.perf_counter() - start, outs)


def _summary(engine: Engine, before: dict, seconds: float, outs) -> dict:
    after = engine.stats()
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": after["prefill_tokens_computed"]
        - before["prefill_tokens_computed"],
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "generated_tokens": sum(o.completion_tokens for o in outs),
        "tokens_per_s": (prompt_tokens + sum(o.completion_tokens for o in outs)) / seconds,
        "mean_ttft_s": sum(o.time_to_first_token for o in outs) / len(outs),
        "outputs": [o.token_ids for o in outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    cuda = args.device == "cuda"
    model = "llama-3-8b" if cuda else "smollm2-135m-instruct"
    options = (dict(load_format="dummy", device="cuda", dtype="bfloat16",
                    kv_cache_memory_fraction=0.6, max_num_batched_tokens=16384,
                    chunked_prefill_size=8192)
               if cuda else dict(dtype=args.dtype, max_total_tokens=65536))
    per_group = 16 if cuda else 8
    results: dict[str, dict] = {}
    for setting, disable in (("cache off", True), ("cache on", False)):
        with Engine(model if cuda else None, disable_radix_cache=disable, **options) as engine:
            prompts = (random_shared_prefix_prompts(engine.model_config.vocab_size) if cuda
                       else shared_prefix_prompts(engine.tokenizer))
            # Warm-up, including a full-size prefill so kernels are compiled before timing.
            engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})
            engine.flush_cache()  # the warm-up must not help the measured run
            results[f"shared-prefix / {setting}"] = run_shared_prefix(engine, prompts,
                                                                      args.new_tokens)
            results[f"multi-turn / {setting}"] = (
                run_multi_turn_ids(engine, args.new_tokens) if cuda
                else run_multi_turn(engine, args.new_tokens))
    ideal = ideal_prefill(prompts, per_group=per_group)
    machine = torch.cuda.get_device_name() if cuda else platform.machine()
    dtype = "bfloat16" if cuda else args.dtype

    print(f"\n{model}, {dtype}, {torch.get_num_threads()} threads, {args.new_tokens} new "
          f"tokens, {machine}")
    print(f"{'workload / setting':<28}{'prefill computed':>17}{'hit rate':>10}"
          f"{'tokens/s':>10}{'mean TTFT':>11}")
    for name, r in results.items():
        print(f"{name:<28}{r['prefill_tokens_computed']:>17}{r['hit_rate']:>10.1%}"
              f"{r['tokens_per_s']:>10.1f}{r['mean_ttft_s']:>10.2f}s")
    on = results["shared-prefix / cache on"]["prefill_tokens_computed"]
    print(f"shared-prefix ideal prefill: {ideal} tokens; cache on computes {on / ideal:.2f}x "
          f"the ideal (target <= 1.3x)")
    for workload in ("shared-prefix", "multi-turn"):
        a, b = (results[f"{workload} / cache {s}"] for s in ("off", "on"))
        same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))
        print(f"{workload}: cache on vs off: {b['tokens_per_s'] / a['tokens_per_s']:.2f}x "
              f"throughput, {a['mean_ttft_s'] / b['mean_ttft_s']:.2f}x faster first token, "
              f"greedy outputs identical {same}/{len(a['outputs'])}")

    record = {"benchmark": "prefix_sharing", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__},
              "config": {"model": model, "dtype": dtype, "device": args.device,
                         "new_tokens": args.new_tokens},
              "ideal_shared_prefix_prefill": ideal,
              "results": {k: {f: v for f, v in r.items() if f != "outputs"}
                          for k, r in results.items()}}
    out = Path(args.out or results_dir() /
               (f"prefix_sharing_h200_{record['date']}.json" if cuda else
                f"prefix_sharing_cpu_{args.dtype}_{record['date']}.json"))
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
