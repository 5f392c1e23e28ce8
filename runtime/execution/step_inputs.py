"""A scheduled batch as the model's inputs: flat token rows on the host (`collect_inputs`),
then on the device (`device_batch`), or as one decode row per token for CUDA graphs
(`one_row_per_token`).

Rows are also picked here: which flat token of each request gets a next token, which score
prompt logprobs, and where each speculating request's drafts start.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixlm.kernels.host_copy import to_device
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.scheduling.pages import ReqToTokenTable
from radixlm.runtime.scheduling.request import Request
from radixlm.runtime.scheduling.scheduler import ScheduledBatch


class StepInputs(NamedTuple):
    """A step's inputs on the host: flat token rows, and per-sequence rows and lengths."""

    input_ids: list[int]
    positions: list[int]
    rows: list[int]  # slot-table row of each sequence
    q_lens: list[int]
    kv_lens: list[int]
    sample_rows: list[tuple[Request, int]]  # (request, flat token index)
    prompt_rows: list[tuple[Request, int, int]]  # (request, flat index, position)
    # Speculating requests: (request, flat index of its first token); its drafts follow.
    verify_rows: list[tuple[Request, int]]


def collect_inputs(scheduled: ScheduledBatch) -> StepInputs:
    """The step's token rows, and the rows that sample, score the prompt or verify drafts."""
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    q_lens, kv_lens = [], []
    sample_rows: list[tuple[Request, int]] = []  # (request, flat token index)
    prompt_rows: list[tuple[Request, int, int]] = []  # (request, flat index, position)
    verify_rows: list[tuple[Request, int]] = []
    follows = scheduled.pending_tokens is not None
    for request, count in zip(scheduled.requests, scheduled.num_new_tokens):
        # A step that follows one still on the device computes the token that step is
        # sampling: it is not in token_ids yet, and sits at position len(token_ids).
        start = len(request.token_ids) if follows else request.num_computed_tokens
        end = start + count
        flat = len(ids)
        drafts = request.draft_tokens
        if follows:
            ids.append(0)  # the device fills in the pending token
        elif drafts:  # its one uncomputed token, then the drafts to verify
            ids.extend(request.token_ids[start:])
            ids.extend(drafts)
            verify_rows.append((request, flat))
        else:
            ids.extend(request.token_ids[start:end])
        positions.extend(range(start, end))
        rows.append(request.table_row)
        q_lens.append(count)
        kv_lens.append(end)
        if not drafts and (follows or end == len(request.token_ids)):
            sample_rows.append((request, flat + count - 1))
        first = request.prompt_logprob_start
        if first is not None:
            # Hidden state at position p scores prompt token p + 1.
            for p in range(max(start, first - 1, 0), min(end, request.prompt_len - 1)):
                prompt_rows.append((request, flat + p - start, p))
    return StepInputs(ids, positions, rows, q_lens, kv_lens, sample_rows, prompt_rows,
                      verify_rows)


def device_batch(inputs: StepInputs, pending: torch.Tensor | None, table: ReqToTokenTable,
                 kv_cache: KVCache, device: torch.device) -> ForwardBatch:
    """The step's ForwardBatch on `device`; `pending` (the tokens a step still on the device
    is sampling) replaces the input ids when given."""
    # One copy for the three index lists; the views below slice it.
    num, seqs = len(inputs.input_ids), len(inputs.rows)
    packed = to_device(inputs.input_ids + inputs.positions + inputs.rows + inputs.q_lens,
                       torch.int64, device)
    input_ids, positions_t, rows_t, q_lens_t = packed.split([num, num, seqs, seqs])
    # output_size: the length is known here, so repeat_interleave need not ask the GPU.
    token_rows = torch.repeat_interleave(rows_t, q_lens_t, output_size=num)
    return ForwardBatch(
        input_ids=input_ids if pending is None else pending,
        positions=positions_t,
        q_lens=inputs.q_lens,
        kv_lens=inputs.kv_lens,
        out_slots=table.table[token_rows, positions_t],
        slot_table=table.table[rows_t, : max(inputs.kv_lens)],
        kv_cache=kv_cache,
    )


# Prompt chunks of at most this many tokens run as decode rows (one_row_per_token). Each row
# reads its sequence's keys again, so a chunk of q tokens after a prefix of L reads about q * L
# keys where the extend kernel reads L: cheap for the short chunks that dominate a step of
# running programs and multi-turn chats (a reply's text appended to a cached prefix, mostly
# served from L2), where the eager forward's host work would otherwise bound the step.
GRAPH_CHUNK_TOKENS = 32


def one_row_per_token(scheduled: ScheduledBatch, inputs: StepInputs, limit: int):
    """A step as one decode row per token, the form CUDA graphs replay: (requests, input
    ids, positions, slot-table rows, kv lens), or None when it has more than `limit` tokens
    or a prompt chunk longer than GRAPH_CHUNK_TOKENS.

    Token j of a sequence's chunk (a prompt chunk, or the drafts of a speculative
    verification) becomes a row of its own whose context ends at its position. Each layer
    stores the K/V of every new token before attention reads any, so these rows attend
    exactly as the causal extend or verify step would."""
    if len(inputs.input_ids) > limit:
        return None
    requests, rows, kv_lens = [], [], []
    for request, row, q_len, kv_len in zip(scheduled.requests, inputs.rows, inputs.q_lens,
                                           inputs.kv_lens):
        if q_len > GRAPH_CHUNK_TOKENS and not request.draft_tokens:
            return None
        requests.extend([request] * q_len)
        rows.extend([row] * q_len)
        kv_lens.extend(range(kv_len - q_len + 1, kv_len + 1))
    return requests, inputs.input_ids, inputs.positions, rows, kv_lens
