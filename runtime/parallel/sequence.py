"""Sequence parallelism for prefill: a long step's rows split across ranks that each hold the
whole model.

A step of at least `sp_min_tokens` tokens (a long prompt's prefill chunk, or many prompts'
at once) is cut into `sp_size` contiguous ranges of rows, one per rank; a range may start or
end inside a sequence. Each rank runs every layer for its rows only: the linears, norms and
the MLP on 1/sp_size of the tokens. Attention is the one place where rows depend on each
other: once a layer has written its rows' K and V to the cache, `KVExchange` all-gathers the
step's K and V rows, so that every rank's cache holds the whole step's, and each row then
attends to all of its sequence's keys in its own rank's cache. With grouped-query attention
the exchanged K and V are a fraction of the hidden states a tensor-parallel all-reduce moves
(two all-reduces of [T, d] per layer there; one all-gather of [T, 2 Hkv D] here). At the
end the ranks' hidden rows are gathered for rank 0 to score.

Shorter steps (decode, short prompts) run on rank 0 alone, as on one device; rank 0 then
sends their K and V rows (every layer's) to the other ranks, so that every rank's cache
stays whole and a later split step can attend to any cached position, prefix-cache hits
included. Each row is computed by the same code whichever rank holds it, so on the CPU (the
C++ kernel computes each row independently of the others) a request's tokens and logprobs
are the same bits as on one process.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from radixlm.runtime.attention.backend import FULL_ATTENTION, ForwardBatch, LayerAttention
from radixlm.runtime.attention.kv_cache import KVCache


def row_ranges(num_tokens: int, size: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) rows of a step: contiguous, sizes differing by at most one."""
    base, extra = divmod(num_tokens, size)
    ranges, start = [], 0
    for rank in range(size):
        end = start + base + (1 if rank < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def sub_batch(batch: ForwardBatch, start: int, end: int) -> ForwardBatch:
    """Rows [start, end) of a step as a step of their own: each sequence they touch keeps
    its slot-table row, with its query rows and its context cut at the last row kept."""
    q_lens, kv_lens, sequences = [], [], []
    offset = 0
    for index, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        first, last = max(start, offset), min(end, offset + q_len)
        if first < last:
            q_lens.append(last - first)
            kv_lens.append(kv_len - (offset + q_len - last))
            sequences.append(index)
        offset += q_len
    return ForwardBatch(input_ids=batch.input_ids[start:end],
                        positions=batch.positions[start:end], q_lens=q_lens, kv_lens=kv_lens,
                        out_slots=batch.out_slots[start:end],
                        slot_table=batch.slot_table[sequences], kv_cache=batch.kv_cache)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[slots, Hkv, D] of any dtype as [slots, Hkv, D * itemsize] bytes (float8 included:
    collectives need a dtype they know)."""
    return x.view(torch.uint8)


class KVExchange:
    """Called with a layer's index once this rank's rows of a split step have stored their K
    and V: all-gathers every rank's rows and writes the others' into this rank's cache."""

    def __init__(self, batch: ForwardBatch, ranges: list[tuple[int, int]], rank: int) -> None:
        self.cache = batch.kv_cache
        self.rank = rank
        self.slots = [batch.out_slots[start:end] for start, end in ranges]
        self.rows = max(end - start for start, end in ranges)

    def __call__(self, layer: int) -> None:
        k, v = (_as_bytes(t) for t in self.cache.layer(layer))
        width = k.shape[-1]
        own = self.slots[self.rank]
        mine = torch.cat([k[own], v[own]], dim=-1)
        padded = mine.new_zeros((self.rows, *mine.shape[1:]))
        padded[: len(own)] = mine
        parts = [torch.empty_like(padded) for _ in self.slots]
        dist.all_gather(parts, padded)
        for rank, (part, slots) in enumerate(zip(parts, self.slots)):
            if rank != self.rank:
                k[slots] = part[: len(slots), :, :width]
                v[slots] = part[: len(slots), :, width:]


def gather_rows(own: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Every rank's hidden rows of a split step, in step order: [T, d]."""
    rows = max(end - start for start, end in ranges)
    padded = own.new_zeros((rows, own.shape[1]))
    padded[: own.shape[0]] = own
    parts = [torch.empty_like(padded) for _ in ranges]
    dist.all_gather(parts, padded)
    return torch.cat([part[: end - start] for part, (start, end) in zip(parts, ranges)])


def kv_rows(cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
    """The K and V of `slots` in every layer, as bytes: [layers, n, Hkv, 2 D * itemsize]."""
    return torch.stack([torch.cat([_as_bytes(k)[slots], _as_bytes(v)[slots]], dim=-1)
                        for k, v in (cache.layer(i) for i in range(cache.k.shape[0]))])


def store_kv_rows(cache: KVCache, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Write what kv_rows read (on another rank) at the same slots of this rank's cache."""
    for layer, row in enumerate(rows):
        k, v = (_as_bytes(t) for t in cache.layer(layer))
        width = k.shape[-1]
        k[slots] = row[..., :width]
        v[slots] = row[..., width:]


class ExchangingAttention:
    """An attention backend that runs a KVExchange between storing a layer's K and V and
    attending (the eager path's counterpart of the CPU kernel's `stored` hook)."""

    def __init__(self, inner: Any, stored: Callable[[int], None]) -> None:
        self.inner = inner
        self.stored = stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, layer: LayerAttention = FULL_ATTENTION,
                kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            batch.kv_cache.store(layer_id, batch.out_slots, k, v)
        self.stored(layer_id)
        return self.inner.forward(q, k, v, layer_id, batch, layer, kv_stored=True)
