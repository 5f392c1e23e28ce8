"""The `radixlm` command. Subcommands: `generate`, `models`, `serve`, `quantize`, `cache`.

    radixlm generate "The capital of France is" --max-new-tokens 16 --temperature 0
    radixlm generate --chat "Write a haiku about the sea." --stream
    radixlm models
    radixlm serve --port 30000          (the HTTP server; see docs/server.md)
    radixlm quantize --method awq --out ~/models/smollm2-awq     (see docs/quantization.md)
    radixlm cache list                  (converted GGUF models; `clear` deletes them)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Sequence


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    from radixlm.runtime.config.engine_config import (
        DTYPE_ALIASES,
        DTYPES,
        KV_CACHE_DTYPES,
        LOAD_FORMATS,
        QUANTIZATIONS,
        SPECULATIVE_METHODS,
    )

    parser.add_argument("--model", "--model-path", default=None,
                        help="model folder, .gguf file, short name or Hub id "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--revision", default=None, help="Hub revision of the model")
    parser.add_argument("--tokenizer", default=None,
                        help="another tokenizer than the model's (a folder or Hub id)")
    parser.add_argument("--chat-template", default=None,
                        help="a chat template (a file, or Jinja text) for --chat")
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                        help="dummy: random weights (with a model folder or a preset shape)")
    parser.add_argument("--dtype", default="auto", type=str.lower,
                        choices=["auto", *DTYPES, *DTYPE_ALIASES],
                        help="activations (auto: bfloat16 on CUDA, and on CPU for quantized "
                             "weights such as the default GGUF model; else float32)")
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N], or auto")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV pool size in tokens (default: sized from free memory)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="how the KV cache stores K and V (fp8: half the memory)")
    parser.add_argument("--quantization", default=None,
                        choices=QUANTIZATIONS,
                        help="quantized linears (default: what the checkpoint declares)")
    parser.add_argument("--speculative", default=None, choices=SPECULATIVE_METHODS,
                        help="speculative decoding (see docs/speculative.md)")
    parser.add_argument("--draft-model", default=None, help="the draft model of --speculative "
                                                            "draft")
    parser.add_argument("--tp", "--tensor-parallel-size", "-tp", type=int, default=1,
                        dest="tp_size",
                        help="tensor-parallel ranks (processes); see docs/distributed.md")
    parser.add_argument("--pp", "--pipeline-parallel-size", "-pp", type=int, default=1,
                        dest="pp_size",
                        help="pipeline stages (tp x pp processes); see docs/distributed.md")
    parser.add_argument("--sp", "--sequence-parallel-size", "-sp", type=int, default=1,
                        dest="sp_size",
                        help="processes that split long prefills (each holds the whole "
                             "model); see docs/distributed.md")
    parser.add_argument("--deterministic", action="store_true",
                        help="the same tokens and logprobs whatever the batch "
                             "(CUDA; see docs/deterministic.md)")


def _cmd_generate(args: argparse.Namespace) -> int:
    from radixlm.runtime import Engine, SamplingParams

    # The prompts first: nothing to generate is an error before a model loads.
    texts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise ValueError("no prompt: give one as an argument, or one per line on stdin")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop or ()))
    options = {name: getattr(args, name) for name in (
        "revision", "tokenizer", "chat_template", "load_format", "dtype", "device",
        "max_total_tokens", "kv_cache_dtype", "quantization", "speculative", "draft_model",
        "tp_size", "pp_size", "sp_size", "deterministic")}
    with Engine(args.model, **options) as engine:
        # Chat prompts are token ids: the template already holds the special tokens.
        prompts = ([{"input_ids": engine.encode_chat([{"role": "user", "content": t}])}
                    for t in texts] if args.chat else [{"prompt": t} for t in texts])
        if args.stream:
            for prompt in prompts:
                asyncio.run(_stream(engine, prompt, params))
            return 0
        key = "input_ids" if args.chat else "prompt"
        outputs = engine.generate(sampling_params=params, **{key: [p[key] for p in prompts]})
        for index, out in enumerate(outputs):  # in the order of the prompts
            print(out.text if len(outputs) == 1 else f"[{index}] {out.text}")
    return 0


async def _stream(engine, prompt: dict, params) -> None:
    async for chunk in engine.generate_stream(sampling_params=params, **prompt):
        print(chunk.delta, end="", flush=True)
    print()


def _cmd_models(args: argparse.Namespace) -> int:
    from radixlm.runtime.models.architecture.model_config import SUPPORTED_ARCHITECTURES
    from radixlm.runtime.models.loader import ARCHITECTURE_PRESETS, DEFAULT_MODEL, EMBEDDED_MODELS

    print(f"default model: {DEFAULT_MODEL}")
    print("embedded models: " + ", ".join(EMBEDDED_MODELS))
    print("shapes for --load-format dummy: " + ", ".join(ARCHITECTURE_PRESETS))
    print("supported architectures: " + ", ".join(SUPPORTED_ARCHITECTURES))
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    import datetime

    from radixlm.runtime.models.gguf_cache import cache_entries, cache_root, clear_cache

    if args.action == "clear":
        freed = clear_cache()
        print(f"removed {freed / 2**20:.0f} MiB from {cache_root()}")
        return 0
    entries = cache_entries()
    print(f"{cache_root()}: {len(entries)} converted model(s)")
    for e in entries:
        when = (datetime.datetime.fromtimestamp(e["converted"]).strftime("%Y-%m-%d %H:%M")
                if e["converted"] else "?")
        print(f"  {e['folder'].name}  {e['bytes'] / 2**20:8.0f} MiB  {when}  "
              f"from {e['source'] or '?'}")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    from radixlm.runtime.quantize.command import run_quantize

    return run_quantize(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from radixlm.runtime.server.launch import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    from radixlm.runtime.quantize.command import add_quantize_args
    from radixlm.runtime.server.args import CommandParser, add_serve_args

    parser = CommandParser(prog="radixlm", description="radixlm LLM runtime")
    parser.add_argument("--version", action="version", version=f"radixlm {version('radixlm')}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with the local engine")
    gen.add_argument("prompt", nargs="*", help="prompts (default: one per line of stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate, at most")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0, the default here: greedy, the same text every run (the Engine "
                          "and the server default to 1.0: sampling)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    gen.add_argument("--top-k", type=int, default=-1, help="the k likeliest tokens (-1: off)")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    _add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    models = sub.add_parser("models", help="list the default, embedded and supported models")
    models.set_defaults(func=_cmd_models)
    serve = sub.add_parser("serve", help="run the HTTP server (native and OpenAI-compatible "
                                         "routes)")
    add_serve_args(serve)
    serve.set_defaults(func=_cmd_serve)
    cache = sub.add_parser("cache", help="list or clear the converted GGUF models (the cache "
                                         "in $RADIXLM_CACHE_DIR or ~/.cache/radixlm)")
    cache.add_argument("action", choices=["list", "clear"])
    cache.set_defaults(func=_cmd_cache)
    quantize = sub.add_parser("quantize", help="quantize a model (RTN, AWQ or GPTQ) into an "
                                               "AWQ/GPTQ-format checkpoint")
    add_quantize_args(quantize)
    quantize.set_defaults(func=_cmd_quantize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: a message, not a traceback
        print(f"radixlm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user knows; no traceback
        print("radixlm: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
