"""What quantization costs in quality, on the default model (SmolLM2-135M-Instruct), on CPU
(or a GPU: `--device cuda`).

Held-out text: the odd half of Python's `pydoc_data` topics (the quantizers calibrate on the
even half), cut into `--windows` windows of `--seq-len` tokens, scored side by side (each
window attends only to itself). For each configuration:

- perplexity over the scored tokens (every token of a window but the first);
- mean |delta logprob|: the mean absolute difference, over the same tokens, between the log
  probability the configuration gives the actual next token and the one fp32 gives;
- top-1 agreement: how often the configuration's most likely next token is fp32's (what
  greedy decoding would pick, given the same text so far);
- the bytes of the decoder's linear layers (embeddings and the output head are never
  quantized and are left out).

Configurations: fp32; bf16; fp8 (W8A8, per-channel weights, per-token activations); int8
(weight-only, per-channel); int4 RTN, AWQ, GPTQ and GPTQ with act-order (group 128, asymmetric,
written by `radixlm quantize` and loaded back from disk); float weights with a float8 KV
cache (`kv_cache_dtype`: every token attends through the rounded K and V), also with the
attention's products in float8 as a float8 tensor-core kernel would compute them
(FP8_ATTENTION, emulated on the torch backend), or only q.k in float8 as our decode kernel's
fp8_qk path computes it (FP8_QK); and float weights whose linears' inputs are
rounded to int8 per group of 32 or 256, as llama.cpp's integer dot products round them
(INT8_ACTIVATIONS). Activations are
float32 except for bf16 (and fp8's quantized products) and the CPU paths: the GGUF file's own
blocks (the default CPU path), int8 as int4 planes and fp8 as bfloat16 weights, all with
bfloat16 activations.

    python benchmarks/quant_quality.py [--windows 8] [--seq-len 512] [--num-samples 32]

On a GPU, `--attention-backend triton` (or flashinfer) scores through that backend's kernels,
and `--one-token-steps` runs each window a token at a time, so that its decode kernels (and a
float8 cache's widening in them) produce the scores rather than its prefill kernel:

    python benchmarks/quant_quality.py --device cuda --attention-backend triton \
        --one-token-steps --configs bf16 "bf16, fp8_e4m3 KV" "fp32, fp8_e4m3 KV"
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import tempfile
import time
import types
from pathlib import Path

import torch

from radixlm.runtime.attention import create_backend, torch_native
from radixlm.runtime.models.layers.linear import Linear
from radixlm.runtime.models.loader import load_model, resolve_model
from radixlm.runtime.quantize.calibration import (
    calibration_text,
    pydoc_texts,
    sequence_scores,
    token_windows,
)
from radixlm.runtime.quantize.checkpoint import save_quantized
from radixlm.runtime.quantize.model_quantizer import QuantizeOptions, quantize_model

from results_dir import results_dir

# name -> (load dtype, online quantization, offline quantizer options)
CONFIGS: dict[str, tuple[torch.dtype, str | None, QuantizeOptions | None]] = {
    "fp32": (torch.float32, None, None),
    "bf16": (torch.bfloat16, "none", None),
    "fp8": (torch.float32, "fp8", None),
    "int8": (torch.float32, "int8", None),
    # The CPU paths, with bfloat16 activations: the GGUF model's own Q4_1/Q8_0 blocks (the
    # default), int8 as int4 planes, fp8 as bfloat16 weights.
    "GGUF blocks (CPU default)": (torch.bfloat16, None, None),
    "int8 CPU": (torch.bfloat16, "int8", None),
    "fp8 CPU": (torch.bfloat16, "fp8", None),
    "int4 RTN": (torch.float32, None, QuantizeOptions(method="rtn")),
    "int4 AWQ": (torch.float32, None, QuantizeOptions(method="awq")),
    "int4 GPTQ": (torch.float32, None, QuantizeOptions(method="gptq")),
    "int4 GPTQ act-order": (torch.float32, None, QuantizeOptions(method="gptq",
                                                                 desc_act=True)),
    # Float weights, the KV cache in float8 (KV_CACHE below): what kv_cache_dtype costs.
    "fp32, fp8_e4m3 KV": (torch.float32, None, None),
    "fp32, fp8_e5m2 KV": (torch.float32, None, None),
    "bf16, fp8_e4m3 KV": (torch.bfloat16, "none", None),
}
# Float weights whose every decoder linear sees its input rounded to int8 per group of this
# many values (scale: the group's largest |x| / 127), the way llama.cpp's Q8_0 / Q8_1 (32) and
# Q8_K (256) blocks round activations for its integer dot products: what an int8 input path
# of the CPU kernel would cost, apart from the weights' own rounding.
INT8_ACTIVATIONS = {"fp32, int8 activations /32": 32, "fp32, int8 activations /256": 256}
CONFIGS |= {name: (torch.float32, None, None) for name in INT8_ACTIVATIONS}
# Float weights and a float8 KV cache whose attention multiplies in float8 as well, as a
# float8 tensor-core kernel would (FP8_ATTENTION below): emulated on the torch backend.
# "fp8 q.k": only q.k in float8, the probabilities and V in 16 bits, as the Triton decode
# kernel's fp8_qk path (EngineConfig.fp8_attention) computes it.
FP8_ATTENTION = ("fp32, fp8_e4m3 KV, fp8 attention", "bf16, fp8_e4m3 KV, fp8 attention")
FP8_QK = ("fp32, fp8_e4m3 KV, fp8 q.k", "bf16, fp8_e4m3 KV, fp8 q.k")
CONFIGS |= {name: (torch.float32, None, None) if name.startswith("fp32")
            else (torch.bfloat16, "none", None) for name in FP8_ATTENTION + FP8_QK}
KV_CACHE = {"fp32, fp8_e4m3 KV": torch.float8_e4m3fn, "fp32, fp8_e5m2 KV": torch.float8_e5m2,
            "bf16, fp8_e4m3 KV": torch.float8_e4m3fn,
            **{name: torch.float8_e4m3fn for name in FP8_ATTENTION + FP8_QK}}
# The probabilities are scaled by this power of two before their rounding to e4m3 (and the
# sum divided by it after): exp(s - max) lies in (0, 1], and e4m3's normal range starts at
# 2^-6, below which small probabilities keep few bits or none. Measured, it changes little
# (docs/quantization.md); `--fp8-p-scale 1` leaves them unscaled.
P_SCALE = 256.0


def linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of the decoder linears' weights (a CPU form's packed planes are buffers)."""
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, Linear)
               for t in [*m.parameters(), *m.buffers()])


def round_to_int8_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each group of `group` values along the last axis rounded to int8 steps of the
    group's largest |x| / 127 (float32 values)."""
    groups = x.float().reshape(-1, group)
    step = groups.abs().amax(-1, keepdim=True) / 127
    rounded = torch.where(step > 0, torch.round(groups / step) * step, groups)
    return rounded.reshape(x.shape).to(x.dtype)


def round_linear_inputs(model: torch.nn.Module, group: int) -> None:
    """Every decoder linear rounds its input with round_to_int8_groups first."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.register_forward_pre_hook(
                lambda _, args: (round_to_int8_groups(args[0], group), *args[1:]))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (values within +-448), back in float32."""
    return x.to(torch.float8_e4m3fn).float()


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  visible: torch.Tensor | None, scale: float,
                  p_scale: float | None = P_SCALE) -> torch.Tensor:
    """Attention as a float8 tensor-core kernel would compute it over a float8 cache: q
    [B, H, Q, D] rounded to e4m3 per row (scale: the row's max |q| / 448) and multiplied by
    the keys (k, v [B, Hkv, L, D]: the cache's e4m3 values) with float32 sums; the softmax in
    float32; each row's probabilities exp(s - max) times p_scale rounded to e4m3 before their
    product with V, their sum taken before the rounding (p_scale None: not rounded).
    `visible` (broadcastable to [B, H, Q, L]) or, None, causal. The row max is the whole
    row's, where a kernel keeps a running one per key tile: the same rounding for every tile
    at or after the row's largest score, the normal range's same relative step before it."""
    group = q.shape[1] // k.shape[1]
    q = q.float()
    q_scale = (q.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    keys = k.float().repeat_interleave(group, dim=1)
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(e4m3(q / q_scale), keys.transpose(-1, -2)) * (q_scale * scale)
    if visible is None:
        q_len, kv_len = scores.shape[-2:]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(
            kv_len - q_len)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    if p_scale is None:
        return torch.matmul(probs, values) / probs.sum(-1, keepdim=True)
    rounded = e4m3(probs * p_scale)
    return torch.matmul(rounded, values) / (p_scale * probs.sum(-1, keepdim=True))


@contextlib.contextmanager
def emulated_fp8_attention(p_scale: float | None):
    """The torch backend's prefill (SDPA) and decode products through fp8_attention while
    the block runs (no softcap: not the default model's)."""
    def sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        return fp8_attention(q, k, v, attn_mask, scale, p_scale).to(q.dtype)

    def decode(q, k, v, valid, scale):  # q [B, H, D], k/v [B, L, Hkv, D], valid [B, 1, 1, L]
        out = fp8_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), valid, scale,
                            p_scale)
        return out.squeeze(2).to(q.dtype)

    functional = types.SimpleNamespace(**{**vars(torch_native.F),
                                          "scaled_dot_product_attention": sdpa})
    saved = torch_native.F, torch_native._decode_attention
    torch_native.F, torch_native._decode_attention = functional, decode
    try:
        yield
    finally:
        torch_native.F, torch_native._decode_attention = saved


def build(name: str, folder: Path, calibration: torch.Tensor, work: Path,
          device: torch.device) -> tuple:
    """The model of one configuration, and the seconds its quantizer took (0 if none).
    Quantizers run where the model is loaded."""
    dtype, online, offline = CONFIGS[name]
    if offline is None:
        model = load_model(str(folder), "auto", dtype, device, quantization=online).model
        if name in INT8_ACTIVATIONS:
            round_linear_inputs(model, INT8_ACTIVATIONS[name])
        return model, 0.0
    source = load_model(str(folder), "auto", torch.float32, device).model
    start = time.perf_counter()
    results = quantize_model(source, calibration, offline)
    seconds = time.perf_counter() - start
    fmt = "awq" if offline.method == "awq" else "gptq"
    out = save_quantized(source, results, offline, fmt, folder, work / name.replace(" ", "_"))
    return load_model(str(out), "auto", dtype, device).model, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8, help="held-out windows")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch",
                        choices=["torch", "triton", "flashinfer"])
    parser.add_argument("--one-token-steps", action="store_true",
                        help="score each window a token at a time (the decode kernels)")
    parser.add_argument("--fp8-p-scale", type=float, default=P_SCALE,
                        help="the fp8-attention configs' scale of the probabilities")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)

    folder = resolve_model(None)
    tokenizer = load_model(str(folder), "auto", torch.float32, torch.device("cpu")).tokenizer
    heldout = token_windows(tokenizer, "\n\n".join(pydoc_texts("heldout")), args.seq_len,
                            args.windows)
    calibration = token_windows(tokenizer, calibration_text("pydoc"), args.seq_len,
                                args.num_samples)
    rows, reference = [], None
    names = ["fp32"] + [n for n in args.configs if n != "fp32"]  # fp32 first: the reference
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            model, quantize_s = build(name, folder, calibration, Path(work), device)
            attn = create_backend(args.attention_backend, model.config.head_dim ** -0.5,
                                  device)
            start = time.perf_counter()
            if name in FP8_ATTENTION + FP8_QK and args.attention_backend != "torch":
                raise SystemExit(f"{name!r} is emulated on the torch attention backend")
            with (emulated_fp8_attention(args.fp8_p_scale) if name in FP8_ATTENTION
                  else emulated_fp8_attention(None) if name in FP8_QK
                  else contextlib.nullcontext()):
                logprobs, top1 = sequence_scores(model, heldout, KV_CACHE.get(name), attn,
                                                 args.one_token_steps)
            logprobs, top1 = logprobs.cpu(), top1.cpu()
            eval_s = time.perf_counter() - start
            if reference is None:
                reference, reference_top1 = logprobs, top1
            row = {"config": name, "perplexity": torch.exp(-logprobs.mean()).item(),
                   "mean_abs_delta_logprob": (logprobs - reference).abs().mean().item(),
                   "top1_agreement": (top1 == reference_top1).float().mean().item(),
                   "linear_weight_mb": linear_bytes(model) / 1e6,
                   "quantize_s": round(quantize_s, 1), "eval_s": round(eval_s, 1)}
            rows.append(row)
            print(f"{name:>20}  ppl {row['perplexity']:7.3f}  |dlogp| "
                  f"{row['mean_abs_delta_logprob']:.4f}  top-1 {row['top1_agreement']:.3f}  "
                  f"linears {row['linear_weight_mb']:6.1f} "
                  f"MB  quantize {quantize_s:5.1f} s  eval {eval_s:5.1f} s", flush=True)
            del model
    record = {
        "benchmark": "quant_quality", "date": datetime.date.today().isoformat(),
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    # the held-out text is this Python's pydoc_data: it differs by version
                    "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
        "config": {"model": "smollm2-135m-instruct", "heldout": "pydoc_data topics, odd",
                   "calibration": "pydoc_data topics, even", "windows": args.windows,
                   "seq_len": args.seq_len, "scored_tokens": int(reference.numel()),
                   "calibration_windows": args.num_samples, "group_size": 128,
                   "int4_grid": "asymmetric (zero point)", "device": args.device,
                   "attention_backend": args.attention_backend,
                   "one_token_steps": args.one_token_steps,
                   "fp8_attention_p_scale": args.fp8_p_scale},
        "rows": rows,
    }
    out = Path(args.out or results_dir() /
               f"quant_quality_{device.type}_{record['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
