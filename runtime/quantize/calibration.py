"""Calibration text, and running a model's decoder layers one at a time over whole sequences.

The default text is Python's own documentation (`pydoc_data.topics`, shipped with CPython, so
it needs no download): the topics sorted by name, even positions for calibration and odd ones
held out for measuring perplexity, so a quantizer never sees the text it is scored on.

Quantizers work layer by layer (GPTQ's "sequential" order): the calibration hidden states
enter layer i, the layer's linear inputs are recorded through forward pre-hooks, the layer is
quantized, and its quantized output becomes layer i + 1's input. Forward passes reuse the
model's own layers and the torch attention backend over a small paged KV cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from radixlm.runtime.attention.backend import AttentionBackend, ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.attention.torch_native import TorchNativeAttention


def pydoc_texts(split: str) -> list[str]:
    """The `pydoc_data` topics of one split: "calibration" (even) or "heldout" (odd)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    if split not in ("calibration", "heldout"):
        raise ValueError(f"split must be 'calibration' or 'heldout', got {split!r}")
    return [topics[name] for name in names[split == "heldout"::2]]


def calibration_text(source: str) -> str:
    """`pydoc` (the calibration half of the pydoc topics) or a path to a UTF-8 text file."""
    if source == "pydoc":
        return "\n\n".join(pydoc_texts("calibration"))
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"calibration text {source!r}: expected 'pydoc' or a text file")
    return path.read_text(encoding="utf-8")


def token_windows(tokenizer: Any, text: str, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` consecutive windows of `seq_len` tokens of text: [count, seq_len]."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < count * seq_len:
        raise ValueError(f"the text has {len(ids)} tokens; {count} windows of {seq_len} need "
                         f"{count * seq_len}")
    return torch.tensor(ids[:count * seq_len]).view(count, seq_len)


def prefill_batch(ids: torch.Tensor, cache: KVCache) -> ForwardBatch:
    """Sequences ids [S, L] as one prefill step from position 0, in slots 0 .. S * L - 1."""
    num_seqs, seq_len = ids.shape
    device = cache.k.device
    slots = torch.arange(num_seqs * seq_len, device=device)
    return ForwardBatch(
        input_ids=ids.reshape(-1).to(device),
        positions=torch.arange(seq_len, device=device).repeat(num_seqs),
        q_lens=[seq_len] * num_seqs, kv_lens=[seq_len] * num_seqs, out_slots=slots,
        slot_table=slots.view(num_seqs, seq_len), kv_cache=cache)


def make_cache(model: nn.Module, num_tokens: int, dtype: torch.dtype,
               storage_dtype: torch.dtype | None = None) -> KVCache:
    cfg = model.config
    device = model.model.embed_tokens.weight.device
    return KVCache(cfg.num_layers, num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                   storage_dtype=storage_dtype)


def token_steps(ids: torch.Tensor, cache: KVCache) -> Iterator[ForwardBatch]:
    """Sequences ids [S, L] as L - 1 one-token (decode) steps of S rows: step t feeds each
    sequence's token t at position t (sequence s in slots s * L .. s * L + L - 1), attending to
    its tokens 0 .. t."""
    num_seqs, seq_len = ids.shape
    device = cache.k.device
    slots = torch.arange(num_seqs * seq_len, device=device).view(num_seqs, seq_len)
    ids = ids.to(device)
    for t in range(seq_len - 1):
        yield ForwardBatch(input_ids=ids[:, t].contiguous(),
                           positions=torch.full((num_seqs,), t, device=device),
                           q_lens=[1] * num_seqs, kv_lens=[t + 1] * num_seqs,
                           out_slots=slots[:, t].contiguous(), slot_table=slots, kv_cache=cache)


@torch.inference_mode()
def sequence_scores(model: nn.Module, ids: torch.Tensor, kv_dtype: torch.dtype | None = None,
                    attn: AttentionBackend | None = None,
                    one_token_steps: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For each next token of the sequences ids ([L], or [S, L] scored side by side): its
    log-probability and the model's own top choice, each [S * (L - 1)] in sequence order
    (float32 and token ids). kv_dtype: the KV cache's storage (float8), which every token then
    attends through. attn: the attention backend (torch's by default). one_token_steps: run the
    sequences as decode steps, a token at a time, rather than as one prefill, so that the
    scores come from the backend's decode kernels. Logits are scored a step (or a sequence) at
    a time, so at most [max(S, L), vocab] of them exist at once."""
    ids = ids.view(-1, ids.shape[-1])
    dtype = model.model.embed_tokens.weight.dtype
    cache = make_cache(model, ids.numel(), dtype, kv_dtype)
    attn = attn or TorchNativeAttention(model.config.head_dim ** -0.5)
    targets = ids[:, 1:].to(cache.k.device)
    if one_token_steps:
        scored = []
        for t, step in enumerate(token_steps(ids, cache)):
            attn.plan(step)
            scored.append(_score(model.compute_logits(model(step, attn)), targets[:, t]))
        logprobs, top = (torch.stack(parts, 1) for parts in zip(*scored))  # [S, L - 1] each
    else:
        batch = prefill_batch(ids, cache)
        attn.plan(batch)
        hidden = model(batch, attn).view(*ids.shape, -1)
        scored = [_score(model.compute_logits(h[:-1]), t) for h, t in zip(hidden, targets)]
        logprobs, top = (torch.stack(parts) for parts in zip(*scored))
    return logprobs.reshape(-1), top.reshape(-1)


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of logits [N, vocab]: the log-probability of each row's target, and its argmax."""
    logprobs = torch.log_softmax(logits, -1)
    return logprobs.gather(1, targets[:, None]).squeeze(1), logprobs.argmax(-1)


def sequence_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token of one sequence ids [L]: [L - 1] float32."""
    return sequence_scores(model, ids)[0]


class LayerwiseRunner:
    """Hidden states of calibration sequences, advanced through the decoder one layer at a
    time. Sequences go `micro_batch` at a time, so activations and the KV cache stay small."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, micro_batch: int = 4) -> None:
        self.model = model
        self.dtype = model.model.embed_tokens.weight.dtype
        self.chunks = list(ids.split(micro_batch))
        self.cache = make_cache(model, micro_batch * ids.shape[1], self.dtype)
        self.attn = TorchNativeAttention(model.config.head_dim ** -0.5)
        self.batches = [prefill_batch(chunk, self.cache) for chunk in self.chunks]
        with torch.inference_mode():
            self.hidden = [model.model.embed_tokens(b.input_ids) for b in self.batches]
            self.rope = [model.rotary.cos_sin(b.positions, self.dtype) for b in self.batches]

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[0] for h in self.hidden)

    @torch.inference_mode()
    def run(self, layer: nn.Module, advance: bool) -> None:
        """Run one decoder layer over every chunk (forward hooks see its linears' inputs);
        with advance, its outputs become the hidden states."""
        outputs = []
        for hidden, rope, batch in zip(self.hidden, self.rope, self.batches):
            self.attn.plan(batch)
            outputs.append(layer(hidden, rope, batch, self.attn))
        if advance:
            self.hidden = outputs


def record_inputs(modules: dict[str, nn.Module],
                  observe: Callable[[str, torch.Tensor], None]) -> list[Any]:
    """Call observe(name, x [T, in]) with every input of each module; returns the hook handles
    (remove them when done)."""
    def hook_for(name: str):
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            observe(name, args[0].reshape(-1, args[0].shape[-1]))
        return hook

    return [module.register_forward_pre_hook(hook_for(name)) for name, module in modules.items()]
