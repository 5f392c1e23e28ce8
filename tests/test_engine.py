"""The offline Engine on a tiny random Llama with the real SmolLM2 tokenizer."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest
import torch

from radixlm.runtime import Engine, EngineClosedError, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "1 2 3",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Les sanglots longs des violons de l'automne",
    "你好，世界！今天天气",
    "A" * 60,
    "Question: what is two plus two?\nAnswer:",
]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=8192, page_size=16) as eng:
        yield eng


def assert_no_leak(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    # Every page is free or held by the prefix cache, and nothing is locked any more.
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["kv_pages_evictable"] == stats["kv_pages_cached"]


def greedy_ids(engine: Engine, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def reference(engine):
    return greedy_ids(engine)


def test_generate_shapes_and_accounting(engine):
    out = engine.generate("Hello there", {"max_new_tokens": 5, "temperature": 0,
                                          "ignore_eos": True})
    assert out.finish_reason == "length" and out.completion_tokens == 5
    assert len(out.token_ids) == 5
    assert out.prompt_tokens == len(engine.tokenizer.encode("Hello there"))
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert_no_leak(engine)


def test_greedy_unchanged_by_batching_and_chunking(tiny_chat_model, engine, reference):
    # Alone, one at a time.
    alone = [engine.generate(p, GREEDY).token_ids for p in PROMPTS]
    assert alone == reference
    # Tiny chunks and a tiny token budget force many mixed prefill/decode steps.
    with Engine(str(tiny_chat_model), max_total_tokens=8192, chunked_prefill_size=5,
                max_num_batched_tokens=11, page_size=4) as small:
        assert greedy_ids(small) == reference
        assert_no_leak(small)


def test_tiny_pool_preempts_and_still_completes(tiny_chat_model, reference):
    # Demand is ~8 x (20 + 24) tokens; the pool holds 96, so requests must be preempted and
    # recomputed. Every request still completes with the same greedy output.
    with Engine(str(tiny_chat_model), max_total_tokens=96, page_size=8) as eng:
        assert greedy_ids(eng) == reference
        assert eng.stats()["retractions"] > 0
        assert_no_leak(eng)


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_new_tokens=16,
                            ignore_eos=True)
    alone = engine.generate(PROMPTS[1], params).token_ids
    others = [{"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}] * 3
    batch = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
                            [others[0], others[1], params, others[2]])
    assert batch[2].token_ids == alone
    other_seed = engine.generate(PROMPTS[1], params.replace(seed=99)).token_ids
    assert other_seed != alone


def test_top_k_one_equals_greedy(engine, reference):
    params = {"temperature": 1.0, "top_k": 1, "max_new_tokens": 24, "ignore_eos": True}
    assert greedy_ids(engine, params) == reference


def test_n_samples(engine):
    outs = engine.generate(PROMPTS[0], {"n": 3, "temperature": 1.0, "seed": 7,
                                         "max_new_tokens": 8, "ignore_eos": True})
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    batch = engine.generate(PROMPTS[:2], {"n": 2, "max_new_tokens": 3, "temperature": 0})
    assert len(batch) == 4 and batch[0].token_ids == batch[1].token_ids
    assert_no_leak(engine)


def test_stop_string_spanning_tokens(engine):
    base = engine.generate(PROMPTS[3], GREEDY)
    ids = base.token_ids
    tok = engine.tokenizer
    # A stop string that starts inside token 5 and ends inside token 8.
    before = tok.decode(ids[:5])
    stop = tok.decode(ids[:8])[len(before) - 1:-1] if len(tok.decode(ids[4:5])) > 1 else \
        tok.decode(ids[:8])[len(before):]
    assert stop
    out = engine.generate(PROMPTS[3], {**GREEDY, "stop": [stop]})
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert stop not in out.text
    assert base.text.startswith(out.text + stop)


def test_no_stop_trim_keeps_the_stop_string_and_the_stop_token(engine, reference):
    base = engine.generate(PROMPTS[3], GREEDY)
    stop = engine.tokenizer.decode(base.token_ids[:6])[-3:]
    trimmed = engine.generate(PROMPTS[3], {**GREEDY, "stop": [stop]})
    kept = engine.generate(PROMPTS[3], {**GREEDY, "stop": [stop], "no_stop_trim": True})
    assert kept.text == trimmed.text + stop and kept.token_ids == trimmed.token_ids
    first = reference[0]
    stop_id = first[3]
    by_id = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [stop_id]})
    kept_id = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [stop_id],
                                           "no_stop_trim": True})
    assert by_id.token_ids == kept_id.token_ids
    assert kept_id.text == engine.tokenizer.decode(kept_id.token_ids)
    assert kept_id.text.startswith(by_id.text) and kept_id.text != by_id.text
    assert_no_leak(engine)


def test_logit_bias_forces_and_bans_tokens_and_keeps_raw_logprobs(engine, reference):
    first = reference[0]
    forced = next(t for t in range(100, 49152) if t != first[0])
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 3, "logprobs": True,
                                       "logit_bias": {str(forced): 100}})
    assert out.token_ids == [forced] * 3
    assert out.logprobs[0].logprob < -1  # the raw distribution, not the biased one
    banned = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 1,
                                          "logit_bias": {first[0]: -100}})
    assert banned.token_ids[0] != first[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(PROMPTS[0], {"logit_bias": {49152: 1}})
    assert_no_leak(engine)


def test_stop_token_ids_min_and_zero_new_tokens(engine, reference):
    first = reference[0]
    out = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [first[3]]})
    assert out.finish_reason == "stop" and out.matched_stop == first[3]
    assert out.token_ids == first[: first.index(first[3]) + 1]
    banned = engine.generate(PROMPTS[0], {**GREEDY, "stop_token_ids": [first[0]],
                                          "min_new_tokens": 4, "max_new_tokens": 4})
    assert first[0] not in banned.token_ids[:4] and banned.finish_reason == "length"
    zero = engine.generate(PROMPTS[0], {"max_new_tokens": 0})
    assert zero.token_ids == [] and zero.finish_reason == "length"
    assert_no_leak(engine)


def test_streaming_deltas_add_up(engine):
    async def collect():
        chunks = []
        async for chunk in engine.generate_stream(PROMPTS[5], GREEDY):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(collect())
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.delta for c in chunks) == chunks[-1].text
    assert chunks[-1].token_ids == engine.generate(PROMPTS[5], GREEDY).token_ids


def test_submit_stream_calls_back_on_the_engine_thread(engine):
    """submit_stream: every Output goes to the callback, on the engine's own thread, n samples
    under their own ids; bad input raises at once, before anything is queued."""
    got: list = []
    threads: set[str] = set()
    done = threading.Event()

    def on_output(out):
        threads.add(threading.current_thread().name)
        got.append(out)
        if sum(o.finished for o in got) == 2:
            done.set()

    params = {**GREEDY, "n": 2, "temperature": 0.8, "seed": 3}
    ids = engine.submit_stream(on_output, PROMPTS[0], params, request_id="cb")
    assert ids == ["cb#0", "cb#1"]
    assert done.wait(60)
    assert threads == {"radixlm-engine"}
    for index in (0, 1):
        mine = [o for o in got if o.index == index]
        assert mine[-1].finished and not any(o.finished for o in mine[:-1])
        assert "".join(o.delta for o in mine) == mine[-1].text
        assert len(mine[-1].token_ids) == GREEDY["max_new_tokens"]
    with pytest.raises(ValueError, match="prompt"):
        engine.submit_stream(on_output, ["two", "prompts"], GREEDY)
    with pytest.raises(ValueError):
        engine.submit_stream(on_output, input_ids=[10**9], sampling_params=GREEDY)
    assert_no_leak(engine)


def test_abort_and_early_stream_exit(engine):
    long = {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}

    async def stop_early():
        async for chunk in engine.generate_stream(PROMPTS[0], long, request_id="early"):
            if chunk.completion_tokens >= 3:
                break

    asyncio.run(stop_early())
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(out=engine.generate(PROMPTS[1], long, request_id="x")))
    thread.start()
    before = engine.stats()["generated_tokens"]
    while engine.stats()["generated_tokens"] < before + 5:
        time.sleep(0.01)
    engine.abort("x")
    thread.join(timeout=60)
    assert result["out"].finish_reason == "abort"
    assert result["out"].completion_tokens < 500
    engine.generate("sync", {"max_new_tokens": 1})  # the loop has processed everything
    assert_no_leak(engine)


def test_logprobs_match_transformers(tiny_chat_model, engine):
    import transformers

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model,
                                                                  dtype=torch.float32)
    out = engine.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 6, "logprobs": True,
                                       "top_logprobs_num": 3, "logprob_start_len": 0})
    prompt_ids = engine.tokenizer.encode(PROMPTS[3])
    full = torch.tensor([prompt_ids + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(full).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    for pos in range(1, len(prompt_ids)):
        entry = out.prompt_logprobs[pos]
        assert entry.token_id == prompt_ids[pos]
        assert abs(entry.logprob - ref[pos - 1, prompt_ids[pos]].item()) < 1e-4
    for i, entry in enumerate(out.logprobs):
        pos = len(prompt_ids) - 1 + i
        assert entry.token_id == out.token_ids[i]
        assert abs(entry.logprob - ref[pos, entry.token_id].item()) < 1e-4
        top_ids = [t for t, _ in entry.top]
        assert top_ids == ref[pos].topk(3).indices.tolist()
        assert top_ids[0] == entry.token_id  # greedy picks the most likely token


def test_chat_applies_template(engine):
    out = engine.chat([{"role": "user", "content": "Hi"}], {"max_new_tokens": 2})
    text = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert out.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert engine.encode_chat([{"role": "user", "content": "Hi"}]) == \
        engine.tokenizer.encode(text, add_special_tokens=False)
    outs = engine.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                       {"max_new_tokens": 2})
    assert len(outs) == 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="x " * 5000), "prompt"),
    (dict(prompt=123), "prompt"),
    (dict(prompt="x", sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
    (dict(prompt="x", sampling_params={"temperature": -0.5}), "temperature"),
    (dict(prompt="x", sampling_params={"top_p": 0}), "top_p"),
    (dict(prompt="x", sampling_params={"top_p": 1.5}), "top_p"),
    (dict(prompt="x", sampling_params={"max_tokens_typo": 3}), "max_tokens_typo"),
    (dict(prompt="x", sampling_params={"max_new_tokens": "5"}), "max_new_tokens"),
    (dict(prompt="x", sampling_params={"stop": [1, 2]}), "stop"),
    (dict(input_ids=[1, 2, 10**9]), "input_ids"),
    (dict(input_ids=[]), "input_ids"),
    (dict(prompt=["ok", ""]), "prompt"),
])
def test_bad_input_is_rejected_before_queueing(tiny_chat_model, kwargs, field):
    with Engine(str(tiny_chat_model), max_total_tokens=2048, max_model_len=1024) as eng:
        result = {}
        long = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
        thread = threading.Thread(target=lambda: result.update(out=eng.generate("Hello", long)))
        thread.start()
        with pytest.raises(ValueError, match=field):
            eng.generate(**kwargs)
        thread.join(timeout=60)
        assert result["out"].completion_tokens == 64  # the other request was not disturbed
        assert eng.stats()["requests_finished"] == 1  # nothing of the bad call was queued
        assert_no_leak(eng)


def test_unknown_engine_option_is_named(tiny_chat_model):
    with pytest.raises(ValueError, match="max_batch_sise"):
        Engine(str(tiny_chat_model), max_batch_sise=3)


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty"])
def test_non_finite_sampling_values_are_refused(field):
    from radixlm.runtime import SamplingParams

    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_remaining_new_tokens_is_one_rule_for_max_new_tokens_and_the_context():
    from radixlm.runtime.protocol.fields import ApiError
    from radixlm.runtime.protocol.sampling_fields import fit_context
    from radixlm.runtime.scheduling.request import Request

    params = SamplingParams(max_new_tokens=5, min_new_tokens=4)
    # (generated so far, tokens so far, context) -> what may still come
    assert params.remaining_new_tokens(0, 3, 100) == 5
    assert params.remaining_new_tokens(2, 5, 100) == 3
    assert params.remaining_new_tokens(1, 98, 100) == 2  # the context is the tighter bound
    assert params.remaining_new_tokens(5, 8, 100) == 0
    assert params.remaining_new_tokens(0, 100, 100) == 0
    request = Request("r", [1, 2, 3], params, frozenset(), None, lambda out: None,
                      max_total_len=9)
    assert request.remaining_new_tokens == 5
    request.token_ids += [4, 5, 6, 7]
    assert request.remaining_new_tokens == 1  # two generated: 3 more allowed, 2 fit
    request.token_ids.append(8)
    assert request.remaining_new_tokens == 0
    # The server's context fit is the same rule before anything is generated.
    assert fit_context(params, 3, 100, True, "prompt", "max_tokens", "min_tokens") is params
    clipped = fit_context(params.replace(min_new_tokens=2), 97, 100, False, "prompt",
                          "max_tokens", "min_tokens")
    assert (clipped.max_new_tokens, clipped.min_new_tokens) == (3, 2)
    # A minimum that cannot fit is refused by name, never cut (the server and Engine alike).
    with pytest.raises(ApiError, match="min_tokens") as refused:
        fit_context(params, 97, 100, False, "prompt", "max_tokens", "min_tokens")
    assert refused.value.param == "min_tokens"


def test_replace_checks_only_the_changed_fields(monkeypatch):
    from radixlm.runtime.grammar import spec

    params = SamplingParams(json_schema={"type": "object"}, stop="x", max_new_tokens=9)
    calls = []
    check = spec.check_grammar_fields
    monkeypatch.setattr(spec, "check_grammar_fields", lambda *a: calls.append(a) or check(*a))
    clipped = params.replace(max_new_tokens=4, min_new_tokens=2)
    assert calls == []  # the schema was checked once, when params was built
    assert (clipped.max_new_tokens, clipped.json_schema, clipped.stop) == (
        4, '{"type":"object"}', ("x",))
    assert params.replace(ebnf=None, json_schema=None, regex="a+").regex == "a+"
    assert len(calls) == 1  # a changed grammar is checked
    with pytest.raises(ValueError, match="min_new_tokens"):
        params.replace(min_new_tokens=10)  # rules between fields still hold
    with pytest.raises(ValueError, match="max_new_tokens must be an int"):
        params.replace(max_new_tokens="4")
    with pytest.raises(ValueError, match="regex and json_schema are exclusive"):
        params.replace(regex="a")


def test_a_closed_engine_is_freed_without_a_garbage_collection(tiny_chat_model):
    """Closing an engine frees its weights and KV pool at once, even while the Engine object
    is still referenced (the name a `with` block leaves): no reference cycle keeps them alive
    until a collection (on a GPU that pool is most of the card's memory, and the next
    engine sizes its own by what is free)."""
    gc.collect()
    gc.disable()
    try:
        engine = Engine(str(tiny_chat_model), max_total_tokens=2048, page_size=16)
        engine.generate("hello", {"max_new_tokens": 2, "json_object": True})  # grammar path
        kv_cache, core = weakref.ref(engine.core.kv_cache), weakref.ref(engine.core)
        weights = weakref.ref(next(engine.core.runner.model.parameters()))
        engine.close()
        assert core() is None and kv_cache() is None and weights() is None
        assert engine.stats()["requests_finished"] == 1 and not engine.has_work
        with pytest.raises(EngineClosedError):
            engine.generate("hello")
    finally:
        gc.enable()


def test_an_explicit_max_new_tokens_beyond_the_context_is_refused(tiny_chat_model):
    """As the server answers 400: the prompt plus an explicit max_new_tokens must fit the
    context; a default max_new_tokens is clipped to what is left."""
    with Engine(str(tiny_chat_model), max_total_tokens=2048, max_model_len=64) as eng:
        prompt = list(range(10, 50))  # 40 tokens: 24 positions left
        for params in ({"max_new_tokens": 100, "temperature": 0},
                       SamplingParams(max_new_tokens=25, temperature=0)):
            with pytest.raises(ValueError, match=r"max_new_tokens.*\(40 tokens\).*64"):
                eng.generate(input_ids=prompt, sampling_params=params)
        with pytest.raises(ValueError, match="max_new_tokens"):  # one of a batch
            eng.generate(input_ids=[[5, 6], prompt],
                         sampling_params={"max_new_tokens": 30, "temperature": 0})
        assert eng.stats()["requests_finished"] == 0  # nothing was queued
        fits = eng.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
        clipped = eng.generate(input_ids=prompt, sampling_params={
            "temperature": 0, "ignore_eos": True, "min_new_tokens": 10})  # the default: 128
        assert fits.completion_tokens == clipped.completion_tokens == 24
        with pytest.raises(ValueError, match=r"min_new_tokens.*\(40 tokens\).*64"):
            eng.generate(input_ids=prompt, sampling_params={"min_new_tokens": 100})
        assert clipped.finish_reason == "length"


def test_cached_tokens_never_exceed_the_prompt(engine):
    """Usage's cached_tokens is a part of prompt_tokens, however the prompt was cached: a
    repeat, a prompt whose length is a whole number of pages, samples of one prompt, a longer
    turn after a shorter one, a grammar, prompt logprobs."""
    page = list(range(100, 164))  # 64 tokens: four whole pages
    cases = [(page, {}), (page, {}), (page, {"n": 3}), (page + [7, 8, 9], {}),
             (page[:40], {}), (page, {"json_object": True}),
             (page, {"logprobs": True, "logprob_start_len": 0})]
    for ids, extra in cases:
        outs = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 3,
                                                                **extra})
        for out in outs if isinstance(outs, list) else [outs]:
            assert 0 <= out.cached_tokens <= out.prompt_tokens == len(ids), (extra, out)
    assert_no_leak(engine)
