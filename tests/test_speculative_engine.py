"""Speculative decoding inside the engine: greedy output identical with and without it, for
n-gram drafts and for a draft model (one that agrees with the target and one that mostly does
not), KV pages accounted for after rejections, and only verified tokens in the prefix cache."""

from __future__ import annotations

import pytest

from radixlm.runtime import Engine, SamplingParams

TEXT = ("The radix cache keeps every computed prefix in a tree of pages. A request that "
        "shares a prefix with an earlier one reuses its pages instead of computing them.")
PROMPTS = [
    f"Repeat this text exactly.\n\n{TEXT}\n\nRepeated:\n{TEXT[:40]}",
    f"{TEXT}\n\nQuote the first sentence of the text above:",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]


def mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
            SamplingParams(temperature=0, max_new_tokens=30),
            SamplingParams(temperature=0, max_new_tokens=25, stop=("13",)),
            SamplingParams(temperature=0, max_new_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_new_tokens=33, ignore_eos=True)]


def generate(model, prompts=PROMPTS, params=None, **options):
    # float32: speculation must not change greedy output, and only float32 is exact on CPU
    # (in bfloat16 a verify step's attention rounds differently from a decode step's).
    options.setdefault("dtype", "float32")
    with Engine(str(model), max_total_tokens=8192, page_size=4, **options) as engine:
        outputs = engine.generate(list(prompts), params or mixed_params())
        stats = engine.stats()
        prompt_ids = [engine.tokenizer.encode(p) for p in prompts]
        cached = [prefix for _, prefix, _ in engine.core.cache.walk()]
    # No page leaked: every page is free or cached, and nothing is locked.
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["kv_pages_evictable"] == stats["kv_pages_cached"]
    # The prefix cache holds only verified tokens: every cached path is a prefix of some
    # request's prompt + output (a rejected draft would show up as a path of its own).
    full = [p + o.token_ids for p, o in zip(prompt_ids, outputs)]
    for prefix in cached:
        assert any(seq[: len(prefix)] == list(prefix) for seq in full), \
            "the prefix cache holds tokens no request produced"
    return outputs, stats


@pytest.fixture(scope="module")
def plain(default_model_folder):
    return generate(default_model_folder)[0]


def test_ngram_greedy_identical_and_faster_per_forward(default_model_folder, plain):
    outputs, stats = generate(default_model_folder, speculative="ngram")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain]
    assert [o.text for o in outputs] == [o.text for o in plain]
    # The extractive prompts repeat text: drafts are accepted and forwards saved.
    assert stats["spec_accepted_tokens"] > 20
    assert stats["spec_mean_accept_length"] > 1.5
    assert stats["spec_drafted_tokens"] >= stats["spec_accepted_tokens"]


def test_draft_model_that_disagrees_keeps_greedy_output(default_model_folder, tiny_chat_model,
                                                         plain):
    """A tiny random draft with the same tokenizer: most drafts are rejected, so every
    rejection path (first position, middle, bonus after all) runs."""
    outputs, stats = generate(default_model_folder, speculative="draft",
                                    draft_model=str(tiny_chat_model),
                                    num_speculative_tokens=3)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert stats["spec_drafted_tokens"] > 3 * stats["spec_accepted_tokens"]


def test_draft_model_equal_to_target_accepts_everything(tiny_chat_model):
    params = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)] * 3
    base, _ = generate(tiny_chat_model, PROMPTS[:3], params)
    outputs, stats = generate(tiny_chat_model, PROMPTS[:3], params, speculative="draft",
                                    draft_model=str(tiny_chat_model), num_speculative_tokens=5)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accept_length"] > 4


def test_sampling_with_a_draft_model_is_seeded_and_complete(tiny_chat_model):
    """Rejection sampling in the engine: seeded requests give the same output on a rerun,
    and every request runs to its length (the distribution itself is checked on the
    acceptance rule, tests/test_speculative_rule.py)."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_new_tokens=20,
                             ignore_eos=True) for i in range(3)]
    runs = [generate(tiny_chat_model, PROMPTS[:3], params, speculative="draft",
                     draft_model=str(tiny_chat_model))[0] for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == 20 for o in runs[0])


def test_penalties_min_tokens_and_logprobs_under_speculation(tiny_chat_model):
    """Position j of a verify step must be processed as plain decoding processes it after
    the first j drafts (they count as output for penalties and the min_new_tokens ban).
    Drafts here are the plain run's own tokens, so a correct verifier accepts every one;
    any position processed differently shows up as a rejection and a changed token."""
    params = [SamplingParams(temperature=0, max_new_tokens=16, logprobs=True,
                             top_logprobs_num=2, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=24, repetition_penalty=3.0,
                             frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True),
              None]
    prompts = [PROMPTS[0], "A" * 40, "The capital of France is"]
    # min_new_tokens: a stop id the model picks right at the first allowed position m, so
    # the ban must lift exactly there, also inside a verify step.
    free = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    probe = generate(tiny_chat_model, prompts[2:], [free])[0][0].token_ids
    m = next(i for i in range(1, 16) if probe[i] not in probe[:i])
    params[2] = SamplingParams(temperature=0, max_new_tokens=16, min_new_tokens=m,
                               stop_token_ids=(probe[m],), ignore_eos=True)
    base, _ = generate(tiny_chat_model, prompts, params)
    assert base[2].finish_reason == "stop" and len(base[2].token_ids) == m + 1
    with Engine(str(tiny_chat_model), max_total_tokens=8192, page_size=4,
                speculative="ngram", speculative_adaptive=False) as engine:
        truth: list[int] = []
        engine.core.speculator._ngram = lambda request, k: truth[
            request.num_output_tokens:request.num_output_tokens + k]
        outputs = []
        for prompt, p, plain in zip(prompts, params, base):  # one at a time: one truth
            truth[:] = plain.token_ids
            outputs.append(engine.generate(prompt, p))
        stats = engine.stats()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_accepted_tokens"] > 20
    got, want = outputs[0].logprobs, base[0].logprobs
    assert [e.token_id for e in got] == [e.token_id for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    assert [[i for i, _ in e.top] for e in got] == [[i for i, _ in e.top] for e in want]


@pytest.mark.parametrize("options, field", [
    ({"speculative": "draft"}, "draft_model"),
    ({"speculative": "ngram", "draft_model": "x"}, "draft_model"),
    ({"speculative": "medusa"}, "speculative"),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        Engine(**options)


def test_ngram_under_a_grammar_is_valid_and_identical(default_model_folder):
    """Drafts are cut where the grammar forbids them and every position is verified under
    its own state: the output matches the schema and equals constrained decoding without
    speculation."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"}}, "required": ["name", "city", "age"]}
    record = '{"name": "Alice Martin", "city": "Lyon", "age": 34}'
    prompts = [f"Copy this record as JSON.\nRecord: {record}\nJSON: ",
               f"Records:\n{record}\n{record.replace('Alice', 'Bob')}\nThe first one again: "]
    params = [SamplingParams(temperature=0, max_new_tokens=60, json_schema=schema)] * 2
    base, _ = generate(default_model_folder, prompts, params)
    outputs, stats = generate(default_model_folder, prompts, params, speculative="ngram")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in base]
    for out in outputs:
        jsonschema.validate(json.loads(out.text), schema)
    assert stats["spec_accepted_tokens"] > 0


def test_draft_model_under_a_grammar_is_valid_and_identical(tiny_chat_model):
    """The draft samples under the grammar's masks; greedy output equals constrained decoding
    without speculation, and sampled output stays valid."""
    regex = r"(ab|cd|[0-9]{2}){2,12}"
    greedy = [SamplingParams(temperature=0, max_new_tokens=30, regex=regex)] * 2
    sampled = [SamplingParams(temperature=1.0, seed=4, max_new_tokens=30, regex=regex)]
    params = greedy + sampled
    base, _ = generate(tiny_chat_model, PROMPTS[:3], params)
    outputs, stats = generate(tiny_chat_model, PROMPTS[:3], params, speculative="draft",
                              draft_model=str(tiny_chat_model))
    assert [o.token_ids for o in outputs[:2]] == [o.token_ids for o in base[:2]]
    import re
    for out in outputs:
        assert re.fullmatch(regex, out.text), out.text
    assert stats["spec_accepted_tokens"] > 0
