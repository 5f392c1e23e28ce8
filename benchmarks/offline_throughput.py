"""Offline throughput: our engine vs transformers `generate` on the same model and prompts.

64 chat prompts, 64 new tokens each (forced: min_new_tokens = max_new_tokens, so every system
does the same work), greedy. In the same run:
  * radixlm Engine (continuous batching, paged KV)
  * transformers generate, batched (left-padded, one call)
  * transformers generate, one prompt at a time
and the compute floor of this machine: the measured GEMM rate for the model's linear layers
at this batch size, divided by the FLOPs each generated token needs.

    python benchmarks/offline_throughput.py [--dtype float32|bfloat16] [--num-prompts 64]

On CUDA (`--device cuda`) it measures the engine alone at serving scale instead: random
prompts of --input-len tokens, each generating --output-len tokens (EOS ignored), all
submitted at once, on a dummy (random-weight) model, Llama-3-8B-shaped by default, in bf16:

    python benchmarks/offline_throughput.py --device cuda [--num-prompts 512]
        [--input-len 1024 --output-len 1024] [--attention-backend auto|triton|flashinfer]
        [--hf-baseline 64] [--deterministic] [--fp8-attention]

`--hf-baseline N` adds the peer to that run: after the full workload, the engine generates
for the first N prompts alone, then `transformers` (eager, bf16, random weights of the same
shape) generates for the same N prompts in one batched `generate` call, and both tokens/s
are reported side by side (with random weights the two outputs are not compared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from radixlm.runtime import Engine
from radixlm.runtime.models.loader import resolve_model

from hf_dummy import hf_dummy_model
from results_dir import results_dir

TOPICS = ["the ocean", "a lost key", "mathematics", "a small village", "the moon", "coffee",
          "an old library", "trains", "winter", "a robot", "music", "gardening", "volcanoes",
          "friendship", "the internet", "bicycles"]
TASKS = ["Write a short story about {}.", "Explain {} to a child.",
         "Give three facts about {}.", "Write a poem about {}."]


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = TASKS[i % len(TASKS)].format(TOPICS[(i // len(TASKS) + i) % len(TOPICS)])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def run_ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    engine.generate(input_ids=prompts[:4], sampling_params=params)  # warm-up
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "generated": sum(o.completion_tokens for o in outs),
            "outputs": [o.token_ids for o in outs]}


def run_hf(model, tokenizer, prompts: list[list[int]], new_tokens: int,
           batched: bool) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    groups = [prompts] if batched else [[p] for p in prompts]
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=pad)
    with torch.no_grad():
        warm = torch.tensor([prompts[0]])
        model.generate(warm, attention_mask=torch.ones_like(warm), **kwargs)
        start = time.perf_counter()
        outputs = []
        for group in groups:
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            gen = model.generate(ids, attention_mask=mask, **kwargs)
            outputs.extend(gen[:, width:].tolist())
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "generated": sum(len(o) for o in outputs), "outputs": outputs}


def gemm_floor(engine: Engine, batch: int, dtype: torch.dtype) -> dict:
    """Tokens/s if every generated token cost only its linear-layer FLOPs at the GEMM rate
    this machine reaches for these shapes (the compute floor of batched decode on CPU)."""
    cfg = engine.model_config
    shapes = [(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
              cfg.num_heads * cfg.head_dim, 2 * cfg.intermediate_size]
    weights = [torch.randn(n, cfg.hidden_size, dtype=dtype) for n in shapes]
    weights.append(torch.randn(cfg.hidden_size, cfg.intermediate_size, dtype=dtype))
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    flops_per_token = 2 * (cfg.num_layers * sum(w.numel() for w in weights) + head.numel())
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w in weights}
    def one_step() -> None:
        for _ in range(cfg.num_layers):
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
        torch.nn.functional.linear(xs[cfg.hidden_size], head)
    one_step()
    start = time.perf_counter()
    reps = 5
    for _ in range(reps):
        one_step()
    per_step = (time.perf_counter() - start) / reps
    return {"flops_per_token": flops_per_token, "gemm_seconds_per_step": per_step,
            "gemm_tflops": flops_per_token * batch / per_step / 1e12,
            "tokens_per_s": batch / per_step}


def hf_generate_cuda(model_name: str, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' batched greedy `generate` on equal-length prompts (no padding), every
    request forced to output_len new tokens: seconds and output tokens/s."""
    model = hf_dummy_model(model_name)
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2, :64], attention_mask=torch.ones_like(ids[:2, :64]),
                       max_new_tokens=8, **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    generated = out[:, ids.shape[1]:].numel()
    del model, out
    torch.cuda.empty_cache()
    return {"seconds": elapsed, "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed}


def run_cuda(args: argparse.Namespace) -> None:
    model = args.model or "llama-3-8b"
    num, input_len, output_len = args.num_prompts, args.input_len, args.output_len
    engine = Engine(model, load_format="dummy", device="cuda", dtype="bfloat16",
                    attention_backend=args.attention_backend,
                    kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                    max_running_requests=args.max_running_requests,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    chunked_prefill_size=input_len, overlap_schedule=args.overlap_schedule,
                    kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                    deterministic=args.deterministic, fp8_attention=args.fp8_attention)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (num, input_len), generator=gen).tolist()
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine.generate(input_ids=[p[:64] for p in prompts[:8]],
                    sampling_params={**params, "max_new_tokens": 8})  # warm-up
    engine.flush_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    attn = type(engine.core.runner.attn).__name__
    overlap = engine.core.overlap
    peer = None
    if args.hf_baseline:
        subset = prompts[:args.hf_baseline]
        engine.flush_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(input_ids=subset, sampling_params=params, use_tqdm=False)
        ours_s = time.perf_counter() - start
        peer = {"num_prompts": len(subset), "radixlm_seconds": ours_s,
                "radixlm_output_tokens_per_s": len(subset) * output_len / ours_s}
    engine.close()
    del engine
    torch.cuda.empty_cache()
    if peer is not None:
        hf = hf_generate_cuda(model, subset, output_len)
        peer.update({"transformers_seconds": hf["seconds"],
                     "transformers_output_tokens_per_s": hf["output_tokens_per_s"],
                     "speedup_vs_transformers": hf["seconds"] / peer["radixlm_seconds"]})
    generated = sum(o.completion_tokens for o in outs)
    assert generated == num * output_len, generated
    output_tps = generated / elapsed
    total_tps = (generated + num * input_len) / elapsed
    print(f"\n{model} (dummy, bf16, weights {args.quantization or 'bf16'}, KV "
          f"{args.kv_cache_dtype}), {attn}, {num} prompts x {input_len} in / {output_len} "
          f"out, overlap {overlap}, deterministic {args.deterministic}, "
          f"fp8 attention {args.fp8_attention}, "
          f"{torch.cuda.get_device_name()}")
    print(f"{elapsed:.1f} s, output {output_tps:,.0f} tokens/s, total {total_tps:,.0f} "
          f"tokens/s, {stats['steps']} steps ({stats['overlapped_steps']} overlapped), "
          f"{stats['retractions']} retractions")
    if peer is not None:
        print(f"the first {peer['num_prompts']} prompts alone: radixlm "
              f"{peer['radixlm_output_tokens_per_s']:,.0f} output tokens/s, transformers "
              f"generate (eager, bf16) {peer['transformers_output_tokens_per_s']:,.0f}: "
              f"{peer['speedup_vs_transformers']:.1f}x")
    record = {
        "benchmark": "offline_throughput",
        "date": datetime.date.today().isoformat(),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
        "config": {"model": model, "load_format": "dummy", "dtype": "bfloat16",
                   "attention": attn, "overlap": overlap, "num_prompts": num,
                   "input_len": input_len,
                   "output_len": output_len, "max_running_requests": args.max_running_requests,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
                   "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
                   "deterministic": args.deterministic, "fp8_attention": args.fp8_attention},
        "results": {"seconds": elapsed, "output_tokens": generated,
                    "output_tokens_per_s": output_tps, "total_tokens_per_s": total_tps,
                    "steps": stats["steps"], "overlapped_steps": stats["overlapped_steps"],
                    "retractions": stats["retractions"],
                    "kv_pages_total": stats["kv_pages_total"]},
        "transformers_peer": peer,
    }
    out = Path(args.out or results_dir() /
               f"offline_throughput_h200_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="default: the embedded SmolLM2-135M (CPU), llama-3-8b (CUDA)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--input-len", type=int, default=1024, help="CUDA mode")
    parser.add_argument("--output-len", type=int, default=1024, help="CUDA mode")
    parser.add_argument("--attention-backend", default="auto", help="CUDA mode")
    parser.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"],
                        help="CUDA mode")
    parser.add_argument("--max-running-requests", type=int, default=256, help="CUDA mode")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="CUDA mode")
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=0.85,
                        help="CUDA mode")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", "fp8_e4m3", "fp8_e5m2"], help="CUDA mode")
    parser.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                        help="CUDA mode: quantized decoder linears (fp8: W8A8)")
    parser.add_argument("--deterministic", action="store_true",
                        help="CUDA mode: batch-invariant kernels (EngineConfig.deterministic)")
    parser.add_argument("--fp8-attention", action="store_true",
                        help="CUDA mode, with --kv-cache-dtype fp8_e4m3: float8 q.k in decode "
                             "attention (EngineConfig.fp8_attention)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="default: 64 on CPU, 512 on CUDA")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-baseline", type=int, default=0, metavar="N",
                        help="CUDA mode: also time transformers generate on the first N "
                             "prompts, beside the engine on the same N")
    parser.add_argument("--skip-sequential", action="store_true",
                        help="skip transformers one-prompt-at-a-time (the slowest part)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: a dated file in $RADIXLM_RESULTS_DIR or "
                             "~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    if args.num_prompts is None:
        args.num_prompts = 512 if args.device == "cuda" else 64
    if args.device == "cuda":
        run_cuda(args)
        return
    import transformers

    dtype = getattr(torch, args.dtype)
    engine = Engine(args.model, dtype=args.dtype, max_total_tokens=32768,
                    max_running_requests=args.num_prompts)
    prompts = make_prompts(engine.tokenizer, args.num_prompts)
    folder = resolve_model(args.model)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    rows = {"radixlm": run_ours(engine, prompts, args.new_tokens),
            "transformers batched": run_hf(hf_model, engine.tokenizer, prompts,
                                           args.new_tokens, batched=True)}
    if not args.skip_sequential:
        rows["transformers sequential"] = run_hf(hf_model, engine.tokenizer, prompts,
                                                 args.new_tokens, batched=False)
    floor = gemm_floor(engine, args.num_prompts, dtype)
    engine.close()

    base = rows["transformers batched"]
    print(f"\n{args.num_prompts} prompts x {args.new_tokens} new tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'system':<26}{'seconds':>9}{'tokens/s':>10}{'vs HF batched':>15}{'of floor':>10}")
    results = {}
    for name, r in rows.items():
        tps = r["generated"] / r["seconds"]
        ratio = tps / (base["generated"] / base["seconds"])
        share = tps / floor["tokens_per_s"]
        print(f"{name:<26}{r['seconds']:>9.2f}{tps:>10.1f}{ratio:>14.2f}x{share:>9.0%}")
        results[name] = {"seconds": r["seconds"], "generated_tokens": r["generated"],
                         "tokens_per_s": tps, "ratio_vs_hf_batched": ratio,
                         "fraction_of_floor": share}
    print(f"{'GEMM floor':<26}{'':>9}{floor['tokens_per_s']:>10.1f}"
          f"   ({floor['gemm_tflops'] * 1e3:.0f} GFLOP/s on the linear layers alone)")
    same = sum(a == b for a, b in zip(rows["radixlm"]["outputs"], base["outputs"]))
    print(f"greedy outputs identical to transformers batched: {same}/{len(prompts)}")

    record = {
        "benchmark": "offline_throughput",
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "config": {"model": args.model or "smollm2-135m-instruct", "dtype": args.dtype,
                   "num_prompts": args.num_prompts, "new_tokens": args.new_tokens,
                   "prompt_tokens": sum(len(p) for p in prompts)},
        "results": results, "gemm_floor": floor,
        "identical_greedy_outputs_vs_hf_batched": same,
    }
    out = Path(args.out or results_dir() /
               f"offline_throughput_cpu_{args.dtype}_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
