"""Overlap scheduling: a decode step launched before the previous step's tokens reach the host
must change nothing a user sees. On CPU the forward is synchronous, so these tests force the
mode on and check the bookkeeping (pending tokens, follow-up steps, late stops, aborts)."""

from __future__ import annotations

import pytest

from radixlm.runtime import Engine, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "1 2 3",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Question: what is two plus two?\nAnswer:",
    "A" * 40,
]


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampling, stops (by string, by id, by EOS), logprobs, uneven lengths,
    penalties and a grammar: the follow-up step must fall back or drop tokens correctly."""
    return [
        SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=30, stop=("e",)),
        SamplingParams(temperature=0, max_new_tokens=9, logprobs=True, top_logprobs_num=3,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=25),
        SamplingParams(temperature=1.0, seed=3, max_new_tokens=12, min_new_tokens=4,
                       repetition_penalty=1.3, ignore_eos=True),
    ]


def run(model, overlap: str, prompts=PROMPTS, params=None):
    with Engine(str(model), max_total_tokens=4096, page_size=4,
                overlap_schedule=overlap) as engine:
        outputs = engine.generate(list(prompts), params or mixed_params())
        stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["kv_pages_evictable"] == stats["kv_pages_cached"]
    return outputs, stats


def test_overlap_changes_no_output(tiny_chat_model):
    plain, plain_stats = run(tiny_chat_model, "off")
    overlapped, stats = run(tiny_chat_model, "on")
    for a, b in zip(plain, overlapped):
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert a.finish_reason == b.finish_reason
        assert [e.token_id for e in a.logprobs or []] == [e.token_id for e in b.logprobs or []]
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
            assert [i for i, _ in x.top] == [i for i, _ in y.top]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)
    # Follow-up steps ran (the same tokens in fewer host round trips is the point).
    assert stats["generated_tokens"] == plain_stats["generated_tokens"]
    assert stats["overlapped_steps"] > 0 and plain_stats["overlapped_steps"] == 0


def test_overlap_with_structured_output_and_late_stops(tiny_chat_model):
    params = [SamplingParams(temperature=0, max_new_tokens=12, regex=r"[0-9]{3}-[a-z]{2,6}"),
              SamplingParams(temperature=0, max_new_tokens=40, stop=(" ",)),
              SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=(17, 42, 99))]
    prompts = PROMPTS[:3]
    plain, _ = run(tiny_chat_model, "off", prompts, params)
    overlapped, _ = run(tiny_chat_model, "on", prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in overlapped]
    assert [o.finish_reason for o in plain] == [o.finish_reason for o in overlapped]


def test_overlap_streaming_and_abort(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=4096, page_size=4,
                overlap_schedule="on") as engine:
        params = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
        whole = engine.generate(PROMPTS[1], params)

        async def stream_then_stop() -> str:
            text = ""
            async for chunk in engine.generate_stream(PROMPTS[1], params):
                text += chunk.delta
                if len(text) > 10:
                    break  # the consumer leaves: the request is aborted mid-flight
            return text

        import asyncio
        partial = asyncio.run(stream_then_stop())
        assert whole.text.startswith(partial)
        again = engine.generate(PROMPTS[1], params)  # nothing left behind
        assert again.token_ids == whole.token_ids
        stats = engine.stats()
        assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
