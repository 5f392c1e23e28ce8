"""The LoRA shrink/expand Triton kernels (kernels/lora.py) on CPU, under the Triton
interpreter, against kernels/reference.py: rows of several adapters interleaved with base-model
rows, ranks below the slots' rank, fused parts, an input split over several programs, and
unused tiles (a CUDA graph's padding). The GPU test covers bf16 at real sizes."""

from __future__ import annotations

import pytest
import torch

from interpreter_cases import collect_cases, main, results_under_interpreter


def _case(token_slots: list[int], in_features: int, part_sizes: list[int], stride: int,
          ranks: list[int], spare_tiles: int = 0, seed: int = 0) -> str:
    from radixlm.kernels.lora import TILE_FIELDS, group_rows, lora_add
    from radixlm.kernels.reference import lora_add_reference

    gen = torch.Generator().manual_seed(seed)
    slots, parts, out_features = len(ranks), len(part_sizes), sum(part_sizes)
    a = torch.zeros(slots, parts * stride, in_features)
    b = torch.zeros(slots, parts * stride, out_features)
    cols = [0]
    for size in part_sizes:
        cols.append(cols[-1] + size)
    for slot, rank in enumerate(ranks):
        for p in range(parts):
            rows = slice(p * stride, p * stride + rank)
            a[slot, rows] = torch.randn(rank, in_features, generator=gen)
            b[slot, rows, cols[p]:cols[p + 1]] = torch.randn(rank, part_sizes[p], generator=gen)
    x = torch.randn(len(token_slots), in_features, generator=gen)
    out = torch.randn(len(token_slots), out_features, generator=gen)
    rows, tiles = group_rows(token_slots)
    tiles += [(-1, 0, 0)] * spare_tiles
    want = lora_add_reference(x, out, a, b, token_slots)
    got = lora_add(x, out.clone(), a, b, torch.tensor(rows + [0], dtype=torch.int32),
                   torch.tensor(tiles, dtype=torch.int32).reshape(-1, TILE_FIELDS), len(tiles),
                   torch.tensor(ranks, dtype=torch.int32),
                   torch.tensor([[cols[p], cols[p + 1]] for p in range(parts)],
                                dtype=torch.int32), stride)
    err = ((got - want).norm() / (want - out).norm()).item()
    assert err < 1e-5, f"relative error {err:.2e}"
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
