"""`radixlm quantize`: load a float model, quantize its decoder linears, write a checkpoint.

    radixlm quantize --method awq --bits 4 --group-size 128 --calib pydoc --out smollm2-awq
    radixlm quantize --model ./llama --method gptq --desc-act --device cuda --out llama-gptq
    radixlm generate --model smollm2-awq "def fib(n):"      (detected from config.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from radixlm.runtime.quantize.model_quantizer import METHODS


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="float model: folder, .gguf file, short name or Hub id "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--method", choices=METHODS, default="awq")
    parser.add_argument("--bits", type=int, choices=[4, 8], default=4)
    parser.add_argument("--group-size", type=int, default=128,
                        help="input channels per scale/zero point (-1: one per output channel)")
    parser.add_argument("--sym", action="store_true",
                        help="symmetric grid without zero points (default: asymmetric)")
    parser.add_argument("--desc-act", action="store_true", help="GPTQ act-order")
    parser.add_argument("--format", choices=["awq", "gptq"], default=None,
                        help="checkpoint format (default: awq for awq, gptq otherwise)")
    parser.add_argument("--calib", default="pydoc",
                        help="calibration text: 'pydoc' (half of Python's pydoc topics; the "
                             "other half is held out) or a UTF-8 text file")
    parser.add_argument("--num-samples", type=int, default=32,
                        help="calibration windows (sequences)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    parser.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening")
    parser.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    parser.add_argument("--out", required=True, help="output folder")


def run_quantize(args: argparse.Namespace) -> int:
    from radixlm.runtime.models.loader import ARCHITECTURE_PRESETS, load_model, resolve_model
    from radixlm.runtime.quantize.calibration import calibration_text, token_windows
    from radixlm.runtime.quantize.checkpoint import save_quantized
    from radixlm.runtime.quantize.model_quantizer import QuantizeOptions, quantize_model

    options = QuantizeOptions(method=args.method, bits=args.bits, group_size=args.group_size,
                              sym=args.sym, desc_act=args.desc_act, damp=args.damp)
    fmt = args.format or ("awq" if args.method == "awq" else "gptq")
    if fmt == "awq" and (args.bits != 4 or args.desc_act):
        raise ValueError("the AWQ format holds 4-bit weights without act-order; "
                         "use --format gptq")
    if args.model in ARCHITECTURE_PRESETS:
        raise ValueError(f"{args.model!r} is a weight-less shape; quantize a real model")
    device = torch.device(args.device if args.device != "auto" else
                          "cuda" if torch.cuda.is_available() else "cpu")
    folder = resolve_model(args.model)
    declared = _declared_method(folder)
    if declared not in (None, "gguf"):
        raise ValueError(f"{folder} is already quantized ({declared}); quantize its float "
                         f"checkpoint instead")
    if declared == "gguf":
        # A GGUF file's blocks dequantize to float weights (the embedded default is one):
        # quantizing those adds this method's error to the file's own.
        print(f"note: {folder.name} comes from a GGUF file; quantizing the float weights its "
              f"blocks dequantize to (start from the original float checkpoint where you "
              f"have it: the two roundings add up)", file=sys.stderr)
    # Quantize from float32 weights: the searches and Hessians want the precision.
    loaded = load_model(str(folder), "auto", torch.float32, device, quantization="none")
    calibration = None
    if args.method != "rtn":
        if loaded.tokenizer is None:
            raise ValueError(f"{folder} has no tokenizer to cut the calibration text with")
        text = calibration_text(args.calib)
        calibration = token_windows(loaded.tokenizer, text, args.seq_len, args.num_samples)
    start = time.perf_counter()
    results = quantize_model(loaded.model, calibration, options)
    out = save_quantized(loaded.model, results, options, fmt, folder, Path(args.out))
    print(f"wrote {args.method} {args.bits}-bit (group {args.group_size}) in the {fmt} format "
          f"to {out} in {time.perf_counter() - start:.1f} s")
    return 0


def _declared_method(folder: Path) -> str | None:
    """The quantization a checkpoint's config.json declares (`quant_method`), or None."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    declared = json.loads(config.read_text()).get("quantization_config")
    if not declared:
        return None
    return str(declared.get("quant_method") or declared.get("format") or "unknown")
