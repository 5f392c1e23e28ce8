"""Sequence parallelism for prefill: a long step's rows split across ranks that each hold the
whole model.

A step of at least `sp_min_tokens` tokens (a long prompt's prefill chunk, or many prompts'
at once) is cut into 2 x `sp_size` contiguous pieces of rows, and rank r takes pieces r and
2 sp_size - 1 - r (a zig-zag): under causal attention a later row sees more keys, so each
rank gets an early piece and a late one and the ranks' attention work evens out (with
contiguous ranges the last of P ranks would do (2P - 1)/P² of it). A piece may start or end
inside a sequence. Each rank runs every layer for its rows only: the linears, norms and
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
    """`size` contiguous [start, end) ranges of a step's rows, sizes differing by at most
    one."""
    base, extra = divmod(num_tokens, size)
    ranges, start = [], 0
    for rank in range(size):
        end = start + base + (1 if rank < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# Each rank's rows of a split step: its pieces, in step order.
Pieces = list[tuple[int, int]]


def zigzag(num_tokens: int, size: int) -> list[Pieces]:
    """Each rank's pieces of a step: of 2 x size contiguous pieces, rank r takes pieces r and
    2 size - 1 - r (empty pieces left out)."""
    pieces = row_ranges(num_tokens, 2 * size)
    return [[p for p in (pieces[r], pieces[2 * size - 1 - r]) if p[1] > p[0]]
            for r in range(size)]


def rank_batch(batch: ForwardBatch, pieces: Pieces) -> ForwardBatch:
    """A rank's pieces of a step as a step of their own: each piece's sequences are entries of
    their own (a sequence cut by the zig-zag appears once per piece, each entry attending up
    to its own last row)."""
    parts = [sub_batch(batch, start, end) for start, end in pieces]
    if len(parts) == 1:
        return parts[0]
    return ForwardBatch(input_ids=torch.cat([p.input_ids for p in parts]),
                        positions=torch.cat([p.positions for p in parts]),
                        q_lens=[n for p in parts for n in p.q_lens],
                        kv_lens=[n for p in parts for n in p.kv_lens],
                        out_slots=torch.cat([p.out_slots for p in parts]),
                        slot_table=torch.cat([p.slot_table for p in parts]),
                        kv_cache=batch.kv_cache)


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

    def __init__(self, batch: ForwardBatch, ranks: list[Pieces], rank: int) -> None:
        self.cache = batch.kv_cache
        self.rank = rank
        self.slots = [torch.cat([batch.out_slots[start:end] for start, end in pieces])
                      for pieces in ranks]
        self.rows = max(len(slots) for slots in self.slots)

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


def gather_rows(own: torch.Tensor, ranks: list[Pieces]) -> torch.Tensor:
    """Every rank's hidden rows of a split step, in step order: [T, d]."""
    counts = [sum(end - start for start, end in pieces) for pieces in ranks]
    padded = own.new_zeros((max(counts), own.shape[1]))
    padded[: own.shape[0]] = own
    parts = [torch.empty_like(padded) for _ in ranks]
    dist.all_gather(parts, padded)
    out = own.new_empty((sum(counts), own.shape[1]))
    for part, pieces in zip(parts, ranks):
        offset = 0
        for start, end in pieces:
            out[start:end] = part[offset: offset + end - start]
            offset += end - start
    return out


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
