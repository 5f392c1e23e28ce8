"""The laptop case: decode speed and time to first token on the CPU, ours in each CPU format
against llama.cpp (llama-cpp-python, when installed) and `transformers`, on the same GGUF (the
embedded SmolLM2-135M-Instruct Q4_1), the same chat prompt, interleaved repeats, medians.

Batch 1: TTFT (chat messages in, first token out: template, tokenization and prefill) and
decode tokens/s over `--tokens` greedy tokens. Batched: `--batch` different prompts of
`--batch-tokens` tokens each, output tokens/s (llama.cpp through its C API's parallel decoding:
one sequence per prompt in a shared KV cache, one batch per step).

Each system runs in a worker process of its own, so that one system's OpenMP threads never
share a process with another's (a second thread pool in a process stops every pool's workers
from spinning, which slows small ops several-fold). The floor beside each row: the bytes that
system reads per decode step (its weights; the embedding table counts one row) over this
machine's measured memory bandwidth.

    python benchmarks/cpu_decode.py [--threads 2] [--tokens 128] [--repeats 3]
        [--formats gguf,float32,bfloat16,int8] [--batch 64] [--batch-tokens 64]
        [--requantize Q4_K_M,Q5_K_M,Q6_K,Q8_0]

Formats: gguf is the default CPU path for a GGUF model (its blocks packed, bfloat16
activations); float32 and bfloat16 dequantize the blocks (quantization="none"); int8 and fp8
quantize those float weights on load. llama-cpp-python is not a dependency (building it takes
a few minutes on 2 cores); without it the llama.cpp rows are left out and the JSON says so.
`--requantize` (needs llama-cpp-python) also writes the embedded file in other GGUF types with
llama.cpp's own quantizer (from its Q4_1 blocks: the speed of each type's kernels, not its
quality) and measures batch 1 on each, ours beside llama.cpp on the same file.
`--families gemma3,qwen3,gemma2,qwen3moe` (needs llama-cpp-python) does the same for random-weight
files of other families at the shapes of real small checkpoints, with their large
vocabularies (benchmarks/random_gguf.py), in each of `--family-types` (default Q4_K_M).
`--long-prompts 1024,2048` (ours and llama.cpp) times a cold long prompt to its first token,
then 32 greedy tokens decoded after it (the decode speed at that context).
`--small-pages-too` also runs ours on every GGUF file with its weights in ordinary 4 KiB pages
(RADIXLM_HUGE_PAGES=0), to measure what huge pages give in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from results_dir import results_dir

PROMPT = ("Explain in a few sentences why the sky is blue, and what makes sunsets red, for "
          "a curious ten-year-old who likes science.")
TOPICS = ["volcanoes", "the moon", "bees", "rainbows", "trains", "chess", "glaciers", "coral",
          "owls", "bread", "magnets", "comets", "tides", "deserts", "violins", "bridges"]


SMALL_PAGES = " small-pages"  # a system run with RADIXLM_HUGE_PAGES=0 (--small-pages-too)
SEQUENCE_CELLS = 256  # llama.cpp's KV cells per sequence in the batched run (prompt + tokens)
LONG_DECODE = 32  # greedy tokens decoded after each long prompt (--long-prompts)


def batch_prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (variant {i})."
            for i in range(n)]


def long_prompt(tokens: int) -> str:
    """A document of about `tokens` tokens (the long-prompt prefill runs): varied sentences, so
    that no tokenizer compresses it much."""
    words = [f"{TOPICS[i % len(TOPICS)]} number {i} is described in sentence {i * 7 % 101}."
             for i in range(tokens)]
    return " ".join(words)


def machine() -> str:
    """The CPU's model name and core count (platform.processor() is often just the ISA)."""
    name = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def bandwidth_gb_s(mib: int = 256) -> float:
    """Memory read bandwidth: a large tensor summed, best of five."""
    import torch

    data = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def step_bytes(model: Any) -> int:
    """Bytes a batch-1 decode step reads: every parameter and buffer once (packed quantized
    weights and the CPU kernel's tiles are buffers), of the embedding table one row, unless
    it is also the float head, and of a mixture of experts' experts the top-k's share."""
    from radixlm.runtime.models.moe import SparseMoeBlock

    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = {t.data_ptr(): t for _, t in named}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    table = model.model.embed_tokens
    if model.lm_head is not None or table.packed_logits is not None:
        total -= table.weight[1:].numel() * table.weight.element_size()
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = block.experts
            unread = 1 - block.top_k / experts.num_experts
            held = [*experts.parameters(), *experts.buffers(),
                    *(t for s in getattr(experts, "cpu_stacks", {}).values() for t in s.tensors)]
            total -= int(unread * sum(t.numel() * t.element_size() for t in held))
    return total


def gguf_step_bytes(path: Path) -> int:
    """Bytes llama.cpp reads a batch-1 decode step: the file's, less the experts that a
    token's top-k routing leaves unread."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    count = reader.fields.get(f"{arch}.expert_count")
    total = path.stat().st_size
    if count is None:
        return total
    unread = 1 - reader.fields[f"{arch}.expert_used_count"].contents() / count.contents()
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    return total - int(unread * experts)


def requantized(type_name: str, threads: int, source: Path | None = None) -> Path:
    """`source` (default: the embedded model) written in GGUF type `type_name` (e.g. Q4_K_M)
    by llama.cpp's quantizer, cached next to the results."""
    import llama_cpp

    from radixlm.runtime.models.loader import embedded_model_file

    source = source or embedded_model_file()
    path = results_dir() / "ggufs" / f"{source.stem.rsplit('.', 1)[0]}.{type_name}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.allow_requantize, params.nthread = True, threads
    partial = path.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(),
                                      params) != 0:
        raise RuntimeError(f"llama.cpp could not write {type_name}")
    partial.rename(path)  # a killed run leaves no half file under the final name
    return path


def random_family_file(family: str) -> Path:
    """The family's random float16 GGUF (benchmarks/random_gguf.py), cached next to the
    results."""
    from random_gguf import write_random_gguf

    from radixlm.runtime.models.loader import embedded_model_file

    path = results_dir() / "ggufs" / f"random-{family}.F16.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_gguf(path, family, embedded_model_file())
    return path


def file_label(system: str) -> str:
    """The GGUF a system runs: 'Q4_1' (the embedded file), a --requantize type, or a
    family's file and type ('gemma3-Q4_K_M')."""
    words = system.split()
    if words[0] == "llama.cpp":
        return words[1]
    return words[2] if len(words) > 2 else "Q4_1"


def ours(fmt: str, path: Path | None = None) -> tuple[dict[str, Callable], int]:
    from radixlm.runtime import Engine

    options: dict[str, Any] = {"max_total_tokens": 16384, "max_running_requests": 128}
    if path is not None:
        options["model"] = str(path)
    if fmt in ("float32", "bfloat16"):
        options |= {"dtype": fmt, "quantization": "none"}
    elif fmt in ("int8", "fp8"):
        options |= {"dtype": "bfloat16", "quantization": fmt}
    elif fmt != "gguf":
        raise ValueError(f"unknown format {fmt!r}")
    engine = Engine(**options)
    messages = [{"role": "user", "content": PROMPT}]

    def batch1(tokens: int) -> tuple[float, float]:
        engine.flush_cache()  # the same work as the others: no prefix reuse across runs
        start = time.perf_counter()
        engine.chat(messages, {"max_new_tokens": 1, "temperature": 0})
        ttft = time.perf_counter() - start
        engine.flush_cache()
        start = time.perf_counter()
        out = engine.chat(messages, {"max_new_tokens": tokens, "min_new_tokens": tokens,
                                     "temperature": 0})
        total = time.perf_counter() - start
        return ttft, (out.completion_tokens - 1) / max(total - ttft, 1e-9)

    def batched(n: int, tokens: int) -> float:
        engine.flush_cache()
        chats = [[{"role": "user", "content": p}] for p in batch_prompts(n)]
        start = time.perf_counter()
        outs = engine.chat(chats, {"max_new_tokens": tokens, "min_new_tokens": tokens,
                                   "temperature": 0})
        return sum(o.completion_tokens for o in outs) / (time.perf_counter() - start)
    def prefill(tokens: int) -> tuple[int, float, float]:
        """(prompt tokens, seconds to the first token, decode tokens/s after it) of a long
        prompt, cold cache: the decode run reuses the cached prompt, so it is LONG_DECODE + 1
        steps at that context (the first recomputes the prompt's last token)."""
        ids = engine.tokenizer.encode(long_prompt(tokens), add_special_tokens=False)[:tokens]
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": LONG_DECODE + 1, "min_new_tokens": LONG_DECODE + 1,
            "temperature": 0})
        return len(ids), ttft, (LONG_DECODE + 1) / (time.perf_counter() - start)
    return ({"batch1": batch1, "batched": batched, "prefill": prefill},
            step_bytes(engine.core.runner.model))


def hf() -> tuple[dict[str, Callable], int]:
    import torch
    import transformers

    from radixlm.runtime.models.loader import embedded_model_file

    path = embedded_model_file()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": PROMPT}]

    def encode(chats: list) -> dict:
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                 for c in chats]
        return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def batch1(tokens: int) -> tuple[float, float]:
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(**encode([messages]), max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(**encode([messages]), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False)
            total = time.perf_counter() - start
        return ttft, (tokens - 1) / max(total - ttft, 1e-9)

    def batched(n: int, tokens: int) -> float:
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        inputs = encode([[{"role": "user", "content": p}] for p in batch_prompts(n)])
        with torch.no_grad():
            start = time.perf_counter()
            model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=tok.pad_token_id)
        return n * tokens / (time.perf_counter() - start)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"batch1": batch1, "batched": batched}, weights


def llama_cpp(threads: int, path: Path | None = None) -> tuple[dict[str, Callable], int]:
    import llama_cpp
    import numpy as np

    from radixlm.runtime.models.loader import embedded_model_file

    path = path or embedded_model_file()
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_ctx=4096, n_batch=512,
                          verbose=False)
    messages = [{"role": "user", "content": PROMPT}]
    eos = llm.token_eos()

    def batch1(tokens: int) -> tuple[float, float]:
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
    def prefill(tokens: int) -> tuple[int, float, float]:
        ids = llm.tokenize(long_prompt(tokens).encode(), add_bos=False)[:tokens]
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)  # the prompt, logits of its last token (what one token needs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(LONG_DECODE):  # greedy, one token a step, as ours
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx),
                                           shape=(llm.n_vocab(),))
            llm.eval([int(logits.argmax())])
        return len(ids), ttft, LONG_DECODE / (time.perf_counter() - start)
    return ({"batch1": batch1, "batched": llama_cpp_batched(llm, threads), "prefill": prefill},
            gguf_step_bytes(path))


def llama_cpp_batched(llm: Any, threads: int) -> Callable[[int, int], float]:
    """llama.cpp's parallel decoding (what its `batched` example and `llama-batched-bench` do),
    through llama-cpp-python's bindings of the C API: every prompt in one sequence of a shared
    KV cache, all prompts prefilled in one batch, then one batch of a token per sequence per
    step, greedy (argmax of each sequence's logits)."""
    import llama_cpp
    import numpy as np
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    formatter = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"],
                                    eos_token="", bos_token="")

    def batched(n: int, tokens: int) -> float:
        params = llama_cpp.llama_context_default_params()
        # A KV stream per sequence (not unified): each token attends to its own sequence's
        # cells only, not to every sequence's under a mask.
        params.n_ctx = n * SEQUENCE_CELLS
        params.n_batch = 16384
        params.n_seq_max, params.kv_unified = n, False
        params.n_threads = params.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(llm.model, params)
        batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        try:
            start = time.perf_counter()
            prompts = [llm.tokenize(formatter(messages=[{"role": "user", "content": p}])
                                    .prompt.encode(), add_bos=False, special=True)
                       for p in batch_prompts(n)]
            entries = [(t, pos, seq, pos == len(ids) - 1)
                       for seq, ids in enumerate(prompts) for pos, t in enumerate(ids)]
            lengths = [len(ids) for ids in prompts]
            made = 0
            while made < n * tokens:
                for i, (token, pos, seq, wants_logits) in enumerate(entries):
                    batch.token[i], batch.pos[i], batch.logits[i] = token, pos, wants_logits
                    batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
                batch.n_tokens = len(entries)
                if llama_cpp.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx),
                                               shape=(n, n_vocab))
                next_tokens = logits.argmax(axis=1).tolist()
                entries = [(t, lengths[seq], seq, True) for seq, t in enumerate(next_tokens)]
                lengths = [length + 1 for length in lengths]
                made += n
            return made / (time.perf_counter() - start)
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
    return batched


def worker(system: str, threads: int, path: Path | None, conn: Any) -> None:
    """One system in this process: build it, then run what the parent asks, one at a time."""
    if system.startswith("radixlm "):
        import radixlm  # noqa: F401  (before torch, as a program does: lang/openmp_spin.py)
    import torch

    torch.set_num_threads(threads)
    if system.endswith(SMALL_PAGES):
        os.environ["RADIXLM_HUGE_PAGES"] = "0"  # read as the weights are tiled
    if system.startswith("radixlm "):
        runs, weights = ours(system.split()[1], path)
    elif system == "transformers float32":
        runs, weights = hf()
    else:
        runs, weights = llama_cpp(threads, path)
    conn.send(("ready", weights, sorted(runs)))
    while True:
        message = conn.recv()
        if message is None:
            return
        kind, args = message
        conn.send(runs[kind](*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default="gguf,float32,bfloat16,int8",
                        help="ours on the embedded file in these formats ('' for none: only "
                             "the --requantize and --families files)")
    parser.add_argument("--batch", type=int, default=64, help="0: skip the batched runs")
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--long-prompts", default="",
                        help="prompt lengths whose prefill (time to the first token, cold "
                             f"cache) and decode speed after it ({LONG_DECODE} greedy tokens) "
                             "to measure, ours against llama.cpp, e.g. 512,1024,2048")
    parser.add_argument("--requantize", default="",
                        help="GGUF types to also measure at batch 1 (ours and llama.cpp on "
                             "the same file), e.g. Q4_K_M,Q5_K_M,Q6_K,Q8_0")
    parser.add_argument("--families", default="",
                        help="random-weight files of other families to also measure at batch "
                             "1, ours against llama.cpp: gemma3, qwen3, gemma2, qwen3moe")
    parser.add_argument("--family-types", default="Q4_K_M",
                        help="the GGUF types of the --families files, e.g. Q4_K_M,Q6_K")
    parser.add_argument("--families-batched", action="store_true",
                        help="also run the batched case (--batch) on the --families files")
    parser.add_argument("--small-pages-too", action="store_true",
                        help="also run ours on each GGUF file with its weights in ordinary "
                             "pages (RADIXLM_HUGE_PAGES=0; docs/cpu.md), in the same run")
    parser.add_argument("--out", default=None, help="JSON file (default: a dated file in "
                        "$RADIXLM_RESULTS_DIR or ~/.cache/radixlm/benchmarks)")
    args = parser.parse_args()
    systems = [f"radixlm {fmt}" for fmt in filter(None, args.formats.split(","))]
    systems.append("transformers float32")
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    if has_llama:
        systems.append("llama.cpp Q4_1")
    files: dict[str, Path | None] = {name: None for name in systems}
    for type_name in filter(None, args.requantize.split(",")):
        if not has_llama:
            raise SystemExit("--requantize needs llama-cpp-python")
        path = requantized(type_name, args.threads)
        files[f"radixlm gguf {type_name}"] = files[f"llama.cpp {type_name}"] = path
    for family in filter(None, args.families.split(",")):
        if not has_llama:
            raise SystemExit("--families needs llama-cpp-python")
        source = random_family_file(family)
        for type_name in filter(None, args.family_types.split(",")):
            path = requantized(type_name, args.threads, source)
            label = f"{family}-{type_name}"
            files[f"radixlm gguf {label}"] = files[f"llama.cpp {label}"] = path
    if args.small_pages_too:
        for name in [n for n in files if n.startswith("radixlm gguf")]:
            label = name if name.count(" ") > 1 else f"{name} Q4_1"
            files[f"{label}{SMALL_PAGES}"] = files[name]
    systems = list(files)
    ctx = mp.get_context("spawn")
    pipes, procs, weights, kinds = {}, [], {}, {}
    for name in systems:  # one at a time: loading is not what is measured
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(name, args.threads, files[name], child),
                           daemon=True)
        proc.start()
        child.close()  # a worker that dies then ends recv() with EOFError instead of a hang
        _, weights[name], kinds[name] = parent.recv()
        pipes[name] = parent
        procs.append(proc)

    def call(name: str, kind: str, *call_args: Any) -> Any:
        pipes[name].send((kind, call_args))
        return pipes[name].recv()

    for name in systems:
        call(name, "batch1", 8)  # warm-up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    # Batched runs on the embedded file (and the families' with --families-batched): the
    # other types are there for batch-1 speed.
    batched: dict[str, list[float]] = {
        name: [] for name in systems if "batched" in kinds[name] and (
            files[name] is None or (args.families_batched and "-" in file_label(name)))}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits all alike
        for name in systems:
            samples[name].append(call(name, "batch1", args.tokens))
        for name in batched if args.batch else ():
            batched[name].append(call(name, "batched", args.batch, args.batch_tokens))
    lengths = [int(n) for n in filter(None, args.long_prompts.split(","))]
    prefill: dict[str, dict[int, list[tuple[int, float, float]]]] = {
        name: {n: [] for n in lengths} for name in systems
        if "prefill" in kinds[name] and files[name] is None}
    for _ in range(args.repeats if lengths else 0):
        for n in lengths:
            for name in prefill:
                prefill[name][n].append(call(name, "prefill", n))
    for name in systems:
        pipes[name].send(None)
    for proc in procs:
        proc.join(timeout=30)
    gbs = bandwidth_gb_s()
    rows = []
    for name in systems:
        row = {"system": name, "ttft_ms": statistics.median(s[0] for s in samples[name]) * 1e3,
               "decode_tokens_per_s": statistics.median(s[1] for s in samples[name]),
               "step_mb": weights[name] / 1e6, "floor_tokens_per_s": gbs * 1e9 / weights[name]}
        if batched.get(name):
            row["batched_tokens_per_s"] = statistics.median(batched[name])
        rows.append(row)
    peers = {file_label(r["system"]): r for r in rows if r["system"].startswith("llama.cpp")}
    hf_row = next(r for r in rows if r["system"].startswith("transformers"))
    for r in rows:  # each beside llama.cpp on the same file
        peer = peers.get(file_label(r["system"]))
        if peer is not None:
            r["vs_llama_cpp"] = r["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
    def times(value: float | None, base: dict | None, key: str) -> str:
        return f"{value / base[key]:.2f}x" if value and base and base.get(key) else "-"

    print(f"{'system':<44}{'TTFT ms':>9}{'decode tok/s':>14}{'step MB':>9}{'floor tok/s':>13}"
          f"{'vs llama.cpp':>14}{'batched tok/s':>15}{'vs HF':>8}{'vs llama.cpp':>14}")
    for r in rows:
        b = r.get("batched_tokens_per_s")
        peer = peers.get(file_label(r["system"]))
        print(f"{r['system']:<44}{r['ttft_ms']:>9.0f}{r['decode_tokens_per_s']:>14.1f}"
              f"{r['step_mb']:>9.0f}{r['floor_tokens_per_s']:>13.0f}"
              f"{times(r['decode_tokens_per_s'], peer, 'decode_tokens_per_s'):>14}"
              f"{(f'{b:.0f}' if b else '-'):>15}{times(b, hf_row, 'batched_tokens_per_s'):>8}"
              f"{times(b, peer, 'batched_tokens_per_s'):>14}")
    print(f"memory bandwidth {gbs:.1f} GB/s; {args.threads} threads; batch 1: {args.tokens} "
          f"tokens; batched: {args.batch} prompts x {args.batch_tokens} tokens")
    prefill_rows = []
    for n in lengths:
        for name, by_length in prefill.items():
            tokens = by_length[n][0][0]
            seconds = statistics.median(t for _, t, _ in by_length[n])
            prefill_rows.append({"system": name, "length": n, "prompt_tokens": tokens,
                                 "ttft_ms": seconds * 1e3,
                                 "prefill_tokens_per_s": tokens / seconds,
                                 "decode_tokens_per_s": statistics.median(
                                     d for _, _, d in by_length[n])})
    if prefill_rows:
        print(f"\n{'long prompt':<24}{'tokens':>8}{'TTFT ms':>10}{'tok/s':>8}{'vs llama.cpp':>14}"
              f"{'decode tok/s':>14}{'vs llama.cpp':>14}")
        for r in prefill_rows:
            peer = next((p for p in prefill_rows if p["system"].startswith("llama.cpp")
                         and p["length"] == r["length"]), None)
            ratio = f"{peer['ttft_ms'] / r['ttft_ms']:.2f}x" if peer else "-"
            decode = (f"{r['decode_tokens_per_s'] / peer['decode_tokens_per_s']:.2f}x"
                      if peer else "-")
            print(f"{r['system']:<24}{r['prompt_tokens']:>8}{r['ttft_ms']:>10.0f}"
                  f"{r['prefill_tokens_per_s']:>8.0f}{ratio:>14}"
                  f"{r['decode_tokens_per_s']:>14.1f}{decode:>14}")
    import torch

    today = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"cpu_decode_{today}.json")
    out.write_text(json.dumps({
        "date": today, "machine": machine(),
        "threads": args.threads, "tokens": args.tokens, "repeats": args.repeats,
        "batch": args.batch, "batch_tokens": args.batch_tokens, "bandwidth_gb_s": gbs,
        "llama_cpp": has_llama, "requantized": args.requantize, "families": args.families,
        "family_types": args.family_types, "torch": torch.__version__,
        "rows": rows, "long_prompts": prefill_rows}, indent=2) + "\n")
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"), args)


def plot(rows: list[dict], path: Path, args: argparse.Namespace) -> None:
    """Batch-1 decode tokens/s per system beside its bandwidth floor, and batched tokens/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    names = [r["system"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 1.8))
    y = range(len(rows))
    left.barh(y, [r["decode_tokens_per_s"] for r in rows], color="tab:blue", label="measured")
    left.scatter([r["floor_tokens_per_s"] for r in rows], y, color="black", marker="|", s=300,
                 label="bandwidth floor")
    left.set_yticks(list(y), names)
    left.invert_yaxis()
    left.set_xlabel(f"batch-1 decode tokens/s ({args.tokens} tokens, {args.threads} threads)")
    left.legend(loc="upper right", fontsize=8)
    batched = [r.get("batched_tokens_per_s", 0) for r in rows]
    right.barh(y, batched, color="tab:green")
    right.set_yticks(list(y), [""] * len(rows))
    right.invert_yaxis()
    right.set_xlabel(f"batched tokens/s ({args.batch} prompts x {args.batch_tokens} tokens)")
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1 GGUF) on the CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
