"""Pipeline and sequence parallelism: measured on this machine against one process and
tensor parallelism, and a paper model of the step time for 2-8 GPUs and 2 nodes.

Measured (each configuration in a fresh process, one engine per process): B prompts decoding
together (generated tokens per second), batch-1 decode ms/token ((time of N new tokens - time
of 1) / (N - 1)), the time to the first token of one long prompt (sequence parallelism's
case: its prefill chunks split across the ranks), and the pipeline's structure as rank 0
sees it: per launched batch, the time it computes the first stage, the time it waits for the
last stage's output (the pipeline not yet full, or a later stage slower), and the host's
share (scheduling, sampling). Those feed the model's prediction for the same run: with P
batches of B/P rows in flight, a batch leaves the pipeline every max(first stage + host,
slowest later stage + send), so predicted tokens/s = (B/P) / that.

The paper model (`paper_model`) prices one decode step and one prefill chunk from bytes,
FLOPs and link speeds: a stage reads its share of the weights and of the KV, computes its
share of the FLOPs, and sends the hidden states on; tensor parallelism reads 1/P of
everything but all-reduces twice per layer. It assumes CUDA graphs and full overlap of
stages; its point is the shape of the trade-off (when TP, when PP), not a promise.
`paper_prefill` does the same for one long prompt's prefill: TP splits every layer and
all-reduces its output; SP splits the rows (zig-zag, so each rank gets 1/P of the causal
attention) and all-gathers K and V per layer.

    python benchmarks/pp.py                         # CPU: default model, 1/pp2/pp3/tp3/sp2
    python benchmarks/pp.py --configs 1 pp2 --batch 8 --output-len 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from results_dir import results_dir

# -- the paper model -------------------------------------------------------------------------

HARDWARE = {  # bytes/s, FLOP/s, link bytes/s and latency (s)
    "H100": dict(hbm=3.35e12, flops=989e12, nvlink=450e9, nvlink_lat=6e-6, memory=80e9),
    "H200": dict(hbm=4.8e12, flops=989e12, nvlink=450e9, nvlink_lat=6e-6, memory=141e9),
}
NETWORK = dict(bw=50e9, lat=15e-6)  # 400 Gb/s InfiniBand per GPU, between nodes
MODELS = {  # parameters, layers, hidden, KV bytes per token (bf16, GQA)
    "llama-3-8b": dict(params=8.0e9, layers=32, hidden=4096, kv_token=2 * 32 * 8 * 128 * 2),
    "llama-3-70b": dict(params=70.6e9, layers=80, hidden=8192, kv_token=2 * 80 * 8 * 128 * 2),
}
HOST_S = 300e-6  # rank 0's scheduling and sampling per step (measured order on an H200)


def _stage_time(model: dict, hw: dict, share: float, rows: int, context: int,
                prefill_tokens: int = 0) -> float:
    """One stage (or one rank) holding `share` of the model, for `rows` decode rows at
    `context` tokens each, or a prefill of `prefill_tokens`: the larger of its memory time
    and its compute time."""
    weights = 2 * model["params"] * share
    kv = model["kv_token"] * share * (rows * context + prefill_tokens)
    flops = 2 * model["params"] * share * (rows + prefill_tokens)
    return max((weights + kv) / hw["hbm"], flops / hw["flops"])


def _all_reduce(nbytes: float, ranks: int, link: float, lat: float) -> float:
    """An all-reduce: 2 (P - 1) / P of the bytes over each link (ring bandwidth), and a
    latency that grows with log2 P (small messages go one-shot or by tree)."""
    return 2 * (ranks - 1) / ranks * nbytes / link + lat * (1 + math.log2(ranks))


def paper_model(gpu: str, model_name: str, rows: int, context: int,
                prefill_tokens: int = 2048) -> list[dict[str, Any]]:
    """Decode tokens/s at `rows` running requests and prefill tokens/s, for 1 GPU, TP=P and
    PP=P inside a node (P = 2, 4, 8), and for 2 nodes of 8: TP=16 against TP=8 x PP=2."""
    hw, model = HARDWARE[gpu], MODELS[model_name]
    layers, hidden = model["layers"], model["hidden"]
    out = []

    def add(name: str, ranks: int, decode_s: float, prefill_s: float) -> None:
        # Weights and the running requests' KV, split evenly over the GPUs.
        need = (2 * model["params"] + model["kv_token"] * rows * context) / ranks
        out.append({"config": name, "gpus": ranks, "decode_tok_s": rows / decode_s,
                    "decode_step_ms": decode_s * 1e3,
                    "prefill_tok_s": prefill_tokens / prefill_s,
                    "fits": need <= hw["memory"]})

    one = _stage_time(model, hw, 1.0, rows, context) + HOST_S
    add("1 GPU", 1, one, _stage_time(model, hw, 1.0, 0, 0, prefill_tokens))
    for p in (2, 4, 8):
        for where, link, lat in (("node", hw["nvlink"], hw["nvlink_lat"]),):
            ar_decode = 2 * layers * _all_reduce(rows * hidden * 2, p, link, lat)
            ar_prefill = 2 * layers * _all_reduce(prefill_tokens * hidden * 2, p, link, lat)
            tp_decode = _stage_time(model, hw, 1 / p, rows, context) + ar_decode + HOST_S
            tp_prefill = _stage_time(model, hw, 1 / p, 0, 0, prefill_tokens) + ar_prefill
            add(f"TP={p} ({where})", p, tp_decode, tp_prefill)
            pp_decode = _pipeline_round(model, hw, p, rows, context, link, lat, 0.0)
            chunk = prefill_tokens / p  # the chunk split in P micro-batches
            pp_prefill = (2 * p - 1) * (_stage_time(model, hw, 1 / p, 0, 0, chunk)
                                        + chunk * hidden * 2 / link + lat)
            add(f"PP={p} ({where})", p, pp_decode, pp_prefill)
    # Two nodes of 8 GPUs: all-reduces cross the network in TP=16; in TP=8 x PP=2 only the
    # stage boundary does.
    ar16 = 2 * layers * (_all_reduce(rows * hidden * 2, 16, NETWORK["bw"], NETWORK["lat"]))
    ar16_p = 2 * layers * _all_reduce(prefill_tokens * hidden * 2, 16, NETWORK["bw"],
                                      NETWORK["lat"])
    add("TP=16 (2 nodes)", 16, _stage_time(model, hw, 1 / 16, rows, context) + ar16 + HOST_S,
        _stage_time(model, hw, 1 / 16, 0, 0, prefill_tokens) + ar16_p)
    ar8 = 2 * layers / 2 * _all_reduce(rows / 2 * hidden * 2, 8, hw["nvlink"], hw["nvlink_lat"])
    ar8_p = 2 * layers / 2 * _all_reduce(prefill_tokens / 2 * hidden * 2, 8, hw["nvlink"],
                                         hw["nvlink_lat"])
    chunk_stage = (_stage_time(model, hw, 1 / 16, 0, 0, prefill_tokens / 2) + ar8_p
                   + prefill_tokens / 2 * hidden * 2 / NETWORK["bw"] + NETWORK["lat"])
    add("TP=8 x PP=2 (2 nodes)", 16,
        _pipeline_round(model, hw, 2, rows, context, NETWORK["bw"], NETWORK["lat"], ar8, 8),
        3 * chunk_stage)
    return out


def _pipeline_round(model: dict, hw: dict, stages: int, rows: int, context: int,
                    link: float, lat: float, reduce_s: float, tp: int = 1) -> float:
    """Seconds for every running request to advance a token through `stages` stages of `tp`
    GPUs each: min(stages, rows) batches in flight. One batch's step is a trip through every
    stage, then rank 0's host work; a stage works through the batches one after another."""
    batches = min(stages, rows)
    per_batch = rows / batches
    stage = (_stage_time(model, hw, 1 / (stages * tp), per_batch, context) + reduce_s
             + per_batch * model["hidden"] * 2 / link + lat)
    return max(stages * stage + HOST_S, batches * max(stage, HOST_S))


def paper_prefill(gpu: str, model_name: str, tokens: int) -> list[dict[str, Any]]:
    """Time to first token of one `tokens`-long prompt on 1 GPU, TP=P and SP=P (P = 2, 4, 8)
    inside a node, and SP=2 across two nodes (a GPU each)."""
    hw, model = HARDWARE[gpu], MODELS[model_name]
    layers, hidden = model["layers"], model["hidden"]
    linear = 2 * model["params"] * tokens / hw["flops"]
    attention = 2 * tokens * tokens * hidden * layers / hw["flops"]  # causal: half of 4 T^2 d L
    kv_bytes = tokens * model["kv_token"] / layers  # one layer's K and V of the whole prompt
    weights = 2 * model["params"]
    out = [{"config": "1 GPU", "gpus": 1, "ttft_ms": (linear + attention) * 1e3,
            "fits": weights <= hw["memory"]}]
    for p, where, link, lat in ((2, "node", hw["nvlink"], hw["nvlink_lat"]),
                                (4, "node", hw["nvlink"], hw["nvlink_lat"]),
                                (8, "node", hw["nvlink"], hw["nvlink_lat"]),
                                (2, "2 nodes", NETWORK["bw"], NETWORK["lat"])):
        reduce = 2 * layers * _all_reduce(tokens * hidden * 2, p, link, lat)
        out.append({"config": f"TP={p} ({where})", "gpus": p,
                    "ttft_ms": ((linear + attention) / p + reduce) * 1e3,
                    "fits": weights / p <= hw["memory"]})
        # The zig-zag split gives every rank 1/P of the causal pairs.
        gather = layers * ((p - 1) / p * kv_bytes / link + lat * (1 + math.log2(p)))
        out.append({"config": f"SP={p} ({where})", "gpus": p,  # every GPU holds the model
                    "ttft_ms": ((linear + attention) / p + gather) * 1e3,
                    "fits": weights <= hw["memory"]})
    return out


# -- the measurement -------------------------------------------------------------------------

def _config_options(config: str) -> dict[str, int]:
    if config == "1":
        return {}
    kind, size = config[:2], int(config[2:])
    return {{"pp": "pp_size", "tp": "tp_size", "sp": "sp_size"}[kind]: size}


def measure(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in its own process: throughput, batch-1 decode, and rank 0's
    time split per launched batch."""
    from radixlm.runtime import Engine
    from radixlm.runtime.parallel import sharded

    spans = {"stage0_s": 0.0, "wait_s": 0.0, "batches": 0}
    forward_kernel, forward_model = sharded.ShardedKernel.forward, sharded.ShardedModel.__call__
    hand_on = sharded.TensorParallelGroup.hand_on

    def timed(original):
        def call(self, *a):
            start = time.perf_counter()
            out = original(self, *a)
            spans["stage0_s"] += time.perf_counter() - start
            spans["batches"] += 1
            return out
        return call

    def timed_hand_on(self, stream):
        pending = hand_on(self, stream)
        wait = pending.wait

        def timed_wait():
            start = time.perf_counter()
            out = wait()
            spans["wait_s"] += time.perf_counter() - start
            return out
        pending.wait = timed_wait
        return pending

    sharded.ShardedKernel.forward = timed(forward_kernel)
    sharded.ShardedModel.__call__ = timed(forward_model)
    sharded.TensorParallelGroup.hand_on = timed_hand_on
    options = dict(json.loads(args.engine_options), **_config_options(config))
    with Engine(args.model, **options) as engine:
        prompt = list(range(10, 10 + args.prompt_len))
        batch = [[7 + i] + prompt[1:] for i in range(args.batch)]  # no shared prefix
        params = {"temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=batch[:2], sampling_params=dict(params, max_new_tokens=4))
        one = dict(params, max_new_tokens=1)
        many = dict(params, max_new_tokens=args.output_len)
        start = time.perf_counter()
        engine.generate(input_ids=[[3] + prompt], sampling_params=one)
        t1 = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(input_ids=[[4] + prompt], sampling_params=many)
        tn = time.perf_counter() - start
        decode_ms = (tn - t1) / (args.output_len - 1) * 1e3
        long_prompt = [5] + [(7 * i) % 40000 + 100 for i in range(args.long_prompt - 1)]
        start = time.perf_counter()
        engine.generate(input_ids=[long_prompt], sampling_params=one)
        ttft_ms = (time.perf_counter() - start) * 1e3
        before = dict(spans)
        steps_before = engine.stats()["steps"]
        start = time.perf_counter()
        outs = engine.generate(input_ids=batch, sampling_params=many)
        elapsed = time.perf_counter() - start
        stats = engine.stats()
    generated = sum(len(o.token_ids) for o in outs)
    batches = spans["batches"] - before["batches"]
    run = {"config": config, "batch": args.batch, "decode_ms_per_token": decode_ms,
           "long_prompt_ttft_ms": ttft_ms,
           "throughput_tok_s": generated / elapsed, "elapsed_s": elapsed,
           "steps": stats["steps"] - steps_before, "pipelined_steps": stats["pipelined_steps"]}
    if batches:
        stage0 = (spans["stage0_s"] - before["stage0_s"]) / batches
        wait = (spans["wait_s"] - before["wait_s"]) / batches
        per_batch = elapsed / batches
        run.update(stage0_ms=stage0 * 1e3, wait_ms=wait * 1e3, per_batch_ms=per_batch * 1e3,
                   host_ms=(per_batch - stage0 - wait) * 1e3)
        pp = options.get("pp_size", 1)
        if pp > 1:
            # Equal stages: the later ones take about the first's time (minus the embedding,
            # plus the final norm); a batch leaves every max(stage 0 + host, stage).
            cycle = max(stage0 + (per_batch - stage0 - wait), stage0)
            run["predicted_tok_s"] = (args.batch / pp) / cycle
    return run


def _print_paper(title: str, rows: list[dict[str, Any]], columns: dict[str, Any]) -> None:
    """One paper-model table: a row per configuration, `columns` formatting each cell."""
    print(f"\npaper model: {title}")
    print(f"{'config':>24} " + " ".join(f"{name:>14}" for name in columns))
    for row in rows:
        cells = " ".join(f"{format_(row):>14}" for format_ in columns.values())
        print(f"{row['config']:>24} {cells}" + ("" if row["fits"] else "  (does not fit)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--engine-options", default=json.dumps({"tp_timeout": 120}))
    parser.add_argument("--configs", nargs="+", default=["1", "pp2", "pp3", "tp3", "sp2"],
                        help="1, ppN (pipeline stages), tpN (tensor-parallel ranks), spN "
                             "(sequence-parallel ranks)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--long-prompt", type=int, default=2048,
                        help="tokens of the prompt whose time to first token is measured")
    parser.add_argument("--gpu", default="H100", choices=sorted(HARDWARE))
    parser.add_argument("--paper-rows", type=int, default=256)
    parser.add_argument("--paper-context", type=int, default=2048)
    parser.add_argument("--paper-prompt", type=int, default=32768)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    runs = []
    for config in args.configs:
        with ProcessPoolExecutor(1) as pool:  # a fresh process: one engine per process
            runs.append(pool.submit(measure, config, args).result())
    base = runs[0]["throughput_tok_s"]
    print(f"\nmeasured on {os.cpu_count()} CPU threads, batch {args.batch}, "
          f"{args.prompt_len} prompt + {args.output_len} new tokens")
    print(f"{'config':>7} {'tok/s':>8} {'vs 1':>6} {'b1 ms/tok':>10} {'TTFT ms':>8} "
          f"{'stage0 ms':>10} {'wait ms':>8} {'host ms':>8} {'predicted':>10}")
    for run in runs:
        print(f"{run['config']:>7} {run['throughput_tok_s']:8.1f} "
              f"{run['throughput_tok_s'] / base:5.2f}x {run['decode_ms_per_token']:10.2f} "
              f"{run['long_prompt_ttft_ms']:8.0f} "
              f"{run.get('stage0_ms', float('nan')):10.2f} {run.get('wait_ms', float('nan')):8.2f} "
              f"{run.get('host_ms', float('nan')):8.2f} "
              f"{run.get('predicted_tok_s', float('nan')):10.1f}")
    paper = {name: paper_model(args.gpu, name, args.paper_rows, args.paper_context)
             for name in MODELS}
    for name, rows in paper.items():
        _print_paper(f"{name} bf16 on {args.gpu}, {args.paper_rows} running requests at "
                     f"{args.paper_context} tokens, prefill chunks of 2048", rows,
                     {"decode tok/s": lambda r: f"{r['decode_tok_s']:.0f}",
                      "step ms": lambda r: f"{r['decode_step_ms']:.2f}",
                      "prefill tok/s": lambda r: f"{r['prefill_tok_s']:.0f}"})
    prefill = {name: paper_prefill(args.gpu, name, args.paper_prompt) for name in MODELS}
    for name, rows in prefill.items():
        _print_paper(f"one {args.paper_prompt}-token prompt's prefill, {name} bf16 on "
                     f"{args.gpu}", rows,
                     {"TTFT ms": lambda r: f"{r['ttft_ms']:.1f}",
                      "x 1 GPU": lambda r, one=rows[0]: f"{one['ttft_ms'] / r['ttft_ms']:.2f}x"})
    record = {"benchmark": "pp", "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(),
                          "threads": os.cpu_count()},
              "config": vars(args), "measured": runs, "paper_model": paper,
              "paper_prefill": prefill,
              "paper_assumptions": {"hardware": HARDWARE[args.gpu], "network": NETWORK,
                                    "host_s": HOST_S}}
    out = args.out or str(results_dir() / "pp.json")
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
