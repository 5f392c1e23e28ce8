"""The laptop case: batch-1 decode speed and time to first token on the CPU, ours in each CPU
format against llama.cpp (llama-cpp-python, when installed) and `transformers` on the same
GGUF (the embedded SmolLM2-135M-Instruct Q4_1), same chat prompt, interleaved repeats,
medians.

The floor beside them: the bytes each system reads per token (its weights) over this
machine's measured memory bandwidth; decode at batch 1 is bound by it.

    python benchmarks/cpu_decode.py [--threads 2] [--tokens 128] [--repeats 3]
        [--formats float32,bfloat16,int8,fp8]

llama-cpp-python is not a dependency (building it takes ~20 min on 2 cores); without it the
llama.cpp rows are left out and the JSON says so.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from radixlm.runtime import Engine
from radixlm.runtime.models.loader import embedded_model_file, resolve_model

from results_dir import results_dir

PROMPT = ("Explain in a few sentences why the sky is blue, and what makes sunsets red, for "
          "a curious ten-year-old who likes science.")


def bandwidth_gb_s(mib: int = 256) -> float:
    """Memory read bandwidth: a large tensor summed, best of five."""
    data = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def ours(fmt: str, threads: int) -> tuple[Callable[[int], tuple[float, float]], int]:
    options: dict[str, Any] = {"max_total_tokens": 4096}
    if fmt in ("float32", "bfloat16"):
        options["dtype"] = fmt
    else:
        options["quantization"] = fmt
    engine = Engine(**options)
    prompt = engine.encode_chat([{"role": "user", "content": PROMPT}])
    model = engine.core.runner.model
    # Bytes a decode step reads: every parameter and buffer (packed quantized weights are
    # buffers), the tied embedding counted once.
    weights = sum(t.numel() * t.element_size() for t in {
        id(t): t for t in [*model.parameters(), *model.buffers()]}.values())

    def run(tokens: int) -> tuple[float, float]:
        start = time.perf_counter()
        engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 1,
                                                             "temperature": 0})
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = engine.generate(input_ids=[prompt], sampling_params={
            "max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 0})[0]
        total = time.perf_counter() - start
        return ttft, (out.completion_tokens - 1) / max(total - ttft, 1e-9)
    return run, weights


def hf(threads: int) -> tuple[Callable[[int], tuple[float, float]], int]:
    import transformers

    folder = resolve_model(None)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                              dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def run(tokens: int) -> tuple[float, float]:
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            total = time.perf_counter() - start
        return ttft, (tokens - 1) / max(total - ttft, 1e-9)
    return run, weights


def llama_cpp(threads: int) -> tuple[Callable[[int], tuple[float, float]], int]:
    import llama_cpp

    path = embedded_model_file()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_ctx=2048, verbose=False)
    messages = [{"role": "user", "content": PROMPT}]
    eos = llm.token_eos()

    def run(tokens: int) -> tuple[float, float]:
        llm.reset()  # no prompt cache between runs: the same work as ours
        start = time.perf_counter()
        llm.create_chat_completion(messages, max_tokens=1, temperature=0)
        ttft = time.perf_counter() - start
        llm.reset()
        start = time.perf_counter()
        out = llm.create_chat_completion(messages, max_tokens=tokens, temperature=0,
                                         logit_bias={eos: -100.0})
        total = time.perf_counter() - start
        generated = out["usage"]["completion_tokens"]
        return ttft, (generated - 1) / max(total - ttft, 1e-9)
    return run, path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default="float32,bfloat16,int8,fp8")
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    systems: dict[str, tuple[Callable[[int], tuple[float, float]], int]] = {}
    for fmt in args.formats.split(","):
        systems[f"radixlm {fmt}"] = ours(fmt, args.threads)
    systems["transformers float32"] = hf(args.threads)
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    if has_llama:
        systems["llama.cpp Q4_1"] = llama_cpp(args.threads)
    for run, _ in systems.values():
        run(8)  # warm-up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits all alike
        for name, (run, _) in systems.items():
            samples[name].append(run(args.tokens))
    gbs = bandwidth_gb_s()
    rows = []
    for name, (_, weights) in systems.items():
        ttft = statistics.median(s[0] for s in samples[name])
        tps = statistics.median(s[1] for s in samples[name])
        rows.append({"system": name, "ttft_ms": ttft * 1e3, "decode_tokens_per_s": tps,
                     "weight_mb": weights / 1e6, "floor_tokens_per_s": gbs * 1e9 / weights})
    peer = next((r for r in rows if r["system"].startswith("llama.cpp")), None)
    print(f"{'system':<24}{'TTFT ms':>9}{'decode tok/s':>14}{'weights MB':>12}"
          f"{'floor tok/s':>13}{'vs llama.cpp':>14}")
    for r in rows:
        ratio = f"{r['decode_tokens_per_s'] / peer['decode_tokens_per_s']:.2f}x" if peer else "-"
        print(f"{r['system']:<24}{r['ttft_ms']:>9.0f}{r['decode_tokens_per_s']:>14.1f}"
              f"{r['weight_mb']:>12.0f}{r['floor_tokens_per_s']:>13.0f}{ratio:>14}")
    print(f"memory bandwidth {gbs:.1f} GB/s; {args.threads} threads; {args.tokens} tokens")
    today = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"cpu_decode_{today}.json")
    out.write_text(json.dumps({
        "date": today, "machine": platform.processor() or platform.machine(),
        "threads": args.threads, "tokens": args.tokens, "repeats": args.repeats,
        "bandwidth_gb_s": gbs, "llama_cpp": has_llama, "torch": torch.__version__,
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
