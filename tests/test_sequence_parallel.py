"""Sequence parallelism for prefill on CPU with gloo: a long step's rows split across ranks
that each hold the whole model, K and V exchanged at every layer; shorter steps on rank 0
alone, their K and V handed to the others. Tokens and logprobs are one process's, bit for bit
where the CPU kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.parallel.sequence import rank_batch, row_ranges, sub_batch, zigzag

from conftest import save_tiny_hf_model
from test_model_families import save_family


def test_rows_split_into_ranges_and_sub_steps():
    assert row_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_ranges(2, 3) == [(0, 1), (1, 2), (2, 2)]
    # Two sequences: a 5-row prefill chunk at positions 3..7 (kv 8) and a decode row (kv 4).
    table = torch.arange(2 * 8).view(2, 8)
    batch = ForwardBatch(input_ids=torch.arange(6), positions=torch.tensor([3, 4, 5, 6, 7, 3]),
                         q_lens=[5, 1], kv_lens=[8, 4], out_slots=torch.arange(100, 106),
                         slot_table=table, kv_cache=None)
    first, second = sub_batch(batch, 0, 3), sub_batch(batch, 3, 6)
    assert (first.q_lens, first.kv_lens) == ([3], [6])  # positions 3..5: context cut at 6
    assert first.positions.tolist() == [3, 4, 5] and torch.equal(first.slot_table, table[:1])
    assert (second.q_lens, second.kv_lens) == ([2, 1], [8, 4])
    assert second.out_slots.tolist() == [103, 104, 105]
    # The zig-zag: of 2 x 2 pieces, rank 0 takes the first and the last, rank 1 the middle
    # two; a sequence cut by it is an entry per piece, each attending up to its last row.
    assert zigzag(10, 2) == [[(0, 3), (8, 10)], [(3, 6), (6, 8)]]
    assert zigzag(3, 2) == [[(0, 1)], [(1, 2), (2, 3)]]
    ends = rank_batch(batch, zigzag(6, 2)[0])  # rows 0..1 and 5 (pieces of 2, 2, 1, 1)
    assert (ends.q_lens, ends.kv_lens) == ([2, 1], [5, 4])
    assert ends.positions.tolist() == [3, 4, 3] and ends.out_slots.tolist() == [100, 101, 105]
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="sp_size"):
            EngineConfig(sp_size=bad)
    for clash, words in ((dict(tp_size=2), "tp_size"), (dict(pp_size=2), "pp_size"),
                         (dict(lora_modules=("a=/x",)), "lora_modules"),
                         (dict(overlap_schedule="on"), "overlap_schedule"),
                         (dict(disk_cache_dir="/tmp/x"), "disk_cache_dir")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(sp_size=2, **clash)


def _outputs(engine: Engine, params: dict, **prompts) -> list:
    outs = engine.generate(**prompts, sampling_params=params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.token_ids, [entry[1] for entry in o.logprobs]) for o in outs]


def test_default_model_split_prefill_gives_one_process_bits():
    """The default model (GGUF blocks, bfloat16, the CPU kernel) on two ranks: long prompts'
    chunks split, short steps on rank 0; a second turn extends the first's prompt and output,
    so its split prefill attends to positions rank 0 decoded alone (their K and V handed on)
    and the prefix cache had. Same tokens and logprobs as one process, bit for bit."""
    story = "The old lighthouse keeper counted the ships that passed each night. " * 12
    texts = [story + "How many ships?", story + "Who kept the lighthouse?", "2 + 2 =",
             "Name a color:"]
    params = {"max_new_tokens": 10, "temperature": 0, "logprobs": True}
    options = dict(chunked_prefill_size=96, max_num_batched_tokens=192, tp_timeout=60)

    def run(engine: Engine) -> list:
        first = _outputs(engine, params, prompt=texts)
        # Long enough a second turn that its new tokens are split too.
        turn = [texts[0] + engine.generate(texts[0], sampling_params=params).text
                + " And then? " + story]
        return first + _outputs(engine, params, prompt=turn)

    with Engine(None, **options) as engine:
        expected = run(engine)
        cached = engine.stats()["cached_tokens"]
    with Engine(None, sp_size=2, sp_min_tokens=64, **options) as engine:
        assert run(engine) == expected
        stats = engine.stats()
        assert engine._tp.split_steps > 0
        assert stats["cached_tokens"] == cached > 0
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_4k_prompt_prefilled_on_two_ranks(tmp_path, family):
    """A 4096-token prompt, prefilled in 1024-token chunks split across two ranks: the same
    greedy tokens as one process; bit for bit on the CPU kernel's path (Llama, float32), to
    rounding on the eager path (Gemma 3: the kernel does not cover it; torch's matmuls round
    by their shapes)."""
    if family == "llama":
        folder = save_tiny_hf_model(tmp_path, "llama", max_position_embeddings=8192)
    else:
        folder = save_family(tmp_path, family, tie=True, max_position_embeddings=8192)
    prompt = torch.randint(3, 500, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    params = {"max_new_tokens": 8, "temperature": 0, "logprobs": True}
    options = dict(dtype="float32", device="cpu", max_total_tokens=8192 + 64,
                   chunked_prefill_size=1024, max_num_batched_tokens=1024)
    with Engine(str(folder), **options) as engine:
        expected = _outputs(engine, params, input_ids=[prompt])
    with Engine(str(folder), sp_size=2, sp_min_tokens=512, **options) as engine:
        got = _outputs(engine, params, input_ids=[prompt])
        assert engine.stats()["steps"] == 4 + 8 - 1  # four chunks, then decode
        assert engine._tp.split_steps == 4
    assert got[0][0] == expected[0][0]
    if family == "llama":
        assert got == expected
    else:
        assert max(abs(a - b) for a, b in zip(got[0][1], expected[0][1])) < 1e-4
