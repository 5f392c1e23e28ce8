"""The LoRA shrink/expand Triton kernels (kernels/lora.py) on CPU, under the Triton
interpreter, against kernels/reference.py: rows of several adapters interleaved with base-model
rows, ranks below the slots' rank, fused parts, an input split over several programs, and
unused tiles (a CUDA graph's padding). The GPU test covers bf16 at real sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interpreter_cases import collect_cases, main, results_under_interpreter


def random_slots(ranks: list[int | list[int]], stride: int, in_features: int,
                 part_sizes: list[int], gen: torch.Generator, a_scale: float = 1.0,
                 b_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Slots as runtime/models/lora/slots.py lays them out (A [S, P R, in], B [S, P R, out],
    zeros beyond each slot's rank and outside each part's columns) filled at random, and the
    parts' (first, stop) output columns. ranks[slot]: one rank for every part, or a list of
    the parts' ranks (0: a part the adapter does not train)."""
    parts, out_features = len(part_sizes), sum(part_sizes)
    a = torch.zeros(len(ranks), parts * stride, in_features)
    b = torch.zeros(len(ranks), parts * stride, out_features)
    cols, first = [], 0
    for size in part_sizes:
        cols.append([first, first + size])
        first += size
    for slot, part_ranks in enumerate(per_part(ranks, parts)):
        for p, ((lo, hi), rank) in enumerate(zip(cols, part_ranks)):
            rows = slice(p * stride, p * stride + rank)
            a[slot, rows] = torch.randn(rank, in_features, generator=gen) * a_scale
            b[slot, rows, lo:hi] = torch.randn(rank, hi - lo, generator=gen) * b_scale
    return a, b, cols


def per_part(ranks: list[int | list[int]], parts: int) -> list[list[int]]:
    return [r if isinstance(r, list) else [r] * parts for r in ranks]


def kernel_args(token_slots: list[int], ranks: list[int | list[int]], cols: list[list[int]],
                device: str = "cpu", spare_tiles: int = 0) -> tuple:
    """lora_add's rows, tiles, tile count, parts' ranks and part columns for a batch, with
    `spare_tiles` unused tiles after the real ones (a captured graph's padding)."""
    from radixlm.kernels.lora_rows import TILE_FIELDS, group_rows

    rows, tiles = group_rows(token_slots)
    tiles = tiles + [(-1, 0, 0)] * spare_tiles
    int32 = dict(dtype=torch.int32, device=device)
    return (torch.tensor(rows + [0], **int32),
            torch.tensor(tiles, **int32).reshape(-1, TILE_FIELDS), len(tiles),
            torch.tensor(per_part(ranks, len(cols)), **int32), torch.tensor(cols, **int32))


def _case(token_slots: list[int], in_features: int, part_sizes: list[int], stride: int,
          ranks: list[int | list[int]], spare_tiles: int = 0, seed: int = 0) -> str:
    from radixlm.kernels.lora import lora_add
    from radixlm.kernels.lora_rows import BLOCK_R
    from radixlm.kernels.reference import lora_add_reference

    gen = torch.Generator().manual_seed(seed)
    a, b, cols = random_slots(ranks, stride, in_features, part_sizes, gen)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    out = torch.randn(len(token_slots), sum(part_sizes), generator=gen)
    want = lora_add_reference(x, out, a, b, token_slots)
    # The rank blocks past a part's rank are never read: NaN there must not reach the output.
    a_read, b_read = a.clone(), b.clone()
    for slot, part_ranks in enumerate(per_part(ranks, len(part_sizes))):
        for p, rank in enumerate(part_ranks):
            unread = slice(p * stride + -(-rank // BLOCK_R) * BLOCK_R, (p + 1) * stride)
            a_read[slot, unread] = b_read[slot, unread] = float("nan")
    got = lora_add(x, out.clone(), a_read, b_read,
                   *kernel_args(token_slots, ranks, cols, spare_tiles=spare_tiles), stride)
    err = ((got - want).norm() / (want - out).norm()).item()
    assert err < 1e-5, f"relative error {err:.2e}"
    # Columns no part of a row's adapter trains are left as they were, bit for bit.
    for row, slot in enumerate(token_slots):
        for (lo, hi), rank in zip(cols, per_part(ranks, len(part_sizes))[max(slot, 0)]):
            if slot < 0 or rank == 0:
                assert torch.equal(got[row, lo:hi], out[row, lo:hi]), (row, lo, hi)
    return f"rel err {err:.1e}"


def case_mixed_rows_fused_parts():
    """Three slots (ranks 16, 5, 32 in rank-32 slots) over 21 rows with base rows between,
    a qkv-like layer of three parts; one slot has more rows than a tile."""
    slots = [0, -1, 1, 0, 2, 2, -1, 0] + [0] * 13
    return _case(slots, 48, [32, 16, 16], 32, [16, 5, 32])


def case_split_input_and_spare_tiles():
    """An input long enough to be split over programs (3 splits of 1024), one row (batch-1
    decode), and tiles beyond the batch marked unused, as a captured graph replays them."""
    return _case([1], 2100, [40], 16, [3, 16], spare_tiles=4)


def case_parts_inside_one_output_tile():
    """Parts narrower than an output tile: both rank blocks are read for the shared tile."""
    return _case([0, 0, 1], 24, [24, 40], 16, [16, 8])


def case_parts_an_adapter_does_not_train():
    """Adapters of some parts only (q and v of a qkv layer; k and v; all three), rank blocks
    beyond a part's rank filled with NaN: an untrained part's weights are not read and its
    columns not written."""
    return _case([0, 1, 2, 0, -1, 1], 40, [64, 32, 32], 32, [[8, 0, 16], [0, 32, 4], 16])


@given(st.lists(st.integers(-1, 5), max_size=80))
@settings(deadline=None)  # the first example imports the kernels' module
def test_rows_grouped_by_slot_in_tiles(token_slots):
    """group_rows against a naive grouping: every adapted row once, slot by slot in row order,
    tiles of at most 16 rows of one slot covering them, within max_tiles."""
    from radixlm.kernels.lora_rows import BLOCK_M, group_rows, max_tiles

    rows, tiles = group_rows(token_slots)
    want = [r for slot in sorted(set(token_slots) - {-1})
            for r, s in enumerate(token_slots) if s == slot]
    assert rows == want
    covered = []
    for slot, first, stop in tiles:
        assert 0 < stop - first <= BLOCK_M
        assert all(token_slots[r] == slot for r in rows[first:stop])
        covered.extend(range(first, stop))
    assert covered == list(range(len(rows)))
    assert len(tiles) <= max_tiles(len(token_slots), 6)


CASES = collect_cases(globals())


@pytest.fixture(scope="module")
def results():
    return results_under_interpreter(__file__)


@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["detail"]


if __name__ == "__main__":
    main(globals())
