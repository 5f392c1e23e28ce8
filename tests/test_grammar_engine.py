"""Structured output through the engine, on a tiny random Llama with the real SmolLM2
tokenizer: whatever the (random) model prefers, finished outputs match their grammar. The
engine-level tests run on both grammar engines (llguidance, outlines-core); the tests of
outlines-core's worker processes (timeouts, memory limits, its cache) use it alone."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import jsonschema
import pytest

from radixlm.runtime import Engine
from radixlm.runtime.grammar.interface import GrammarMatcher

SAMPLE = {"temperature": 1.0, "max_new_tokens": 40}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "format": "email"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["name", "age"]}
# Long fixed keys and short values: most of the output is forced.
ORDER = {"type": "object",
         "properties": {"customer_full_name": {"type": "string", "maxLength": 4},
                        "preferred_contact_method": {"enum": ["email", "phone"]},
                        "number_of_items_ordered": {"type": "integer", "minimum": 1,
                                                    "maximum": 9}},
         "required": ["customer_full_name", "preferred_contact_method",
                      "number_of_items_ordered"],
         "additionalProperties": False}


BACKENDS = ("llguidance", "outlines")


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=8192,
                grammar_backend=request.param) as eng:
        yield eng


@pytest.fixture(scope="module")
def outlines_engine(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=8192, grammar_backend="outlines") as eng:
        yield eng


def assert_no_leak(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["grammar_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert stats["kv_pages_evictable"] == stats["kv_pages_cached"]


def validate(text: str, schema: dict) -> None:
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))


REGEXES = [
    r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",  # IPv4
    r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",  # a date
    r"-?\d+",
    r"(yes|no|maybe)",
    r"(café|naïve|日本語|🙂)( [a-zé]{1,4})?",  # Unicode in the alternatives
    r'"[^"\\\n]{0,12}"',  # a short string: any character but a quote, backslash, newline
]


def test_regexes_hold_under_sampling(engine):
    params = [{**SAMPLE, "regex": r, "seed": s} for r in REGEXES for s in range(4)]
    outs = engine.generate(["Answer:"] * len(params), params)
    for p, out in zip(params, outs):
        assert out.error is None
        if out.finish_reason == "stop":
            assert re.fullmatch(p["regex"], out.text), (p["regex"], out.text)
        else:  # cut by max_new_tokens: still a prefix the grammar allows
            assert out.finish_reason == "length"
    finished = sum(o.finish_reason == "stop" for o in outs)
    assert finished >= len(outs) // 2
    assert_no_leak(engine)


def test_eos_only_where_the_grammar_accepts(engine):
    eos = engine.tokenizer.eos_token_id
    # Terminal state: "yes" ends the request at once, without sampling EOS.
    out = engine.generate("Q", {"regex": "yes", "temperature": 0})
    assert (out.text, out.finish_reason, out.matched_stop) == ("yes", "stop", None)
    assert eos not in out.token_ids
    # Accepting but not terminal: digits may go on, so EOS competes with them.
    outs = engine.generate(["N:"] * 8, [{"regex": "[0-9]{1,40}", "seed": s, **SAMPLE}
                                        for s in range(8)])
    for out in outs:
        if out.matched_stop == eos:
            assert re.fullmatch("[0-9]{1,40}", out.text)
    # ignore_eos: only the grammar ends it (or the length).
    out = engine.generate("N:", {"regex": "[0-9]+", "ignore_eos": True, "max_new_tokens": 6,
                                 "temperature": 0})
    assert out.finish_reason == "length" and re.fullmatch("[0-9]+", out.text)
    # The empty string is the only match: done before any step.
    assert engine.generate("Q", {"regex": "", "temperature": 0}).text == ""


def test_mixed_batch_leaves_unconstrained_output_unchanged(engine):
    prompts = ["The quick brown fox", "Once upon a time", "1 2 3", "def f(x):"]
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    alone = [o.token_ids for o in engine.generate(prompts, greedy)]
    mixed_params = [greedy, {**SAMPLE, "json_schema": PERSON, "seed": 1}, greedy,
                    {**SAMPLE, "regex": REGEXES[0], "seed": 2}, greedy, greedy,
                    {"json_object": True, "temperature": 0, "max_new_tokens": 30}]
    mixed_prompts = [prompts[0], "JSON:", prompts[1], "IP:", prompts[2], prompts[3], "JSON:"]
    outs = engine.generate(mixed_prompts, mixed_params)
    assert [outs[i].token_ids for i in (0, 2, 4, 5)] == alone
    if outs[1].finish_reason == "stop":
        validate(outs[1].text, PERSON)
    if outs[6].finish_reason == "stop":
        assert isinstance(json.loads(outs[6].text), dict)
    assert_no_leak(engine)


SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                      "id": {"type": "string", "format": "uuid"},
                                      "ok": {"type": "boolean"}},
     "required": ["when", "ok"]},
    {"type": "object", "properties": {
        "shape": {"enum": ["circle", "square"]},
        "dims": {"anyOf": [{"type": "object", "properties": {"r": {"type": "integer"}},
                            "required": ["r"]},
                           {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]},
        "note": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["shape", "dims"]},
    {"allOf": [{"$ref": "#/definitions/base"}, {"required": ["day"]}],
     "definitions": {"base": {"type": "object", "properties": {
         "day": {"type": "string", "format": "date"}, "n": {"type": "integer"}}}}},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_schemas_validate(engine, schema):
    params = [{**SAMPLE, "max_new_tokens": 80, "json_schema": schema, "seed": s}
              for s in range(4)]
    outs = engine.generate(["JSON:"] * len(params), params)
    assert all(o.error is None for o in outs)
    for out in outs:
        if out.finish_reason == "stop":
            validate(out.text, schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_forward_saves_steps_and_stays_valid(tiny_chat_model, backend):
    results = {}
    for jump in (False, True):
        with Engine(str(tiny_chat_model), max_total_tokens=4096, json_max_whitespace=0,
                    enable_jump_forward=jump, grammar_backend=backend) as eng:
            before = eng.stats()["steps"]
            out = eng.generate("Order:", {"json_schema": ORDER, "temperature": 0,
                                          "max_new_tokens": 100})
            results[jump] = (out, eng.stats()["steps"] - before, eng.stats())
    for out, _, _ in results.values():
        assert out.finish_reason == "stop"
        validate(out.text, ORDER)
    (_, steps_off, _), (_, steps_on, stats_on) = results[False], results[True]
    assert stats_on["jump_forward_tokens"] > 20
    assert steps_on < steps_off / 2, (steps_on, steps_off)


def test_greedy_grammar_output_is_stable_under_memory_pressure(tiny_chat_model, engine):
    params = [{"json_schema": SCHEMAS[i % 4], "temperature": 0, "max_new_tokens": 48}
              for i in range(6)]
    reference = [o.token_ids for o in engine.generate(["JSON:"] * 6, params)]
    with Engine(str(tiny_chat_model), max_total_tokens=96, page_size=8,
                grammar_backend=engine.config.grammar_backend) as small:
        outs = small.generate(["JSON:"] * 6, params)
        assert [o.token_ids for o in outs] == reference
        assert small.stats()["retractions"] > 0
        assert_no_leak(small)


def test_malformed_grammar_fields_are_refused_before_queuing(engine):
    before = engine.stats()["requests_finished"]
    deep = {"type": "array", "items": {}}
    node = deep["items"]
    for _ in range(200):  # deeper than any real schema, and than Python's recursion
        node["items"] = {}
        node = node["items"]
    for params, field in [({"json_schema": "{not json"}, "json_schema"),
                          ({"json_schema": deep}, "json_schema"),
                          ({"json_schema": "[" * 100_000 + "]" * 100_000}, "json_schema"),
                          ({"regex": "a\udc00"}, "regex"),
                          ({"ebnf": ""}, "ebnf"),
                          ({"regex": "a", "json_object": True}, "regex")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            engine.generate("x", params)
    assert engine.stats()["requests_finished"] == before


def test_grammars_that_cannot_compile_fail_as_invalid_naming_the_field(engine):
    cases = [({"regex": "(unclosed"}, "regex"),
             ({"json_schema": {"type": "string", "format": "uri-template"}}, "json_schema"),
             ({"json_schema": {"type": "object",
                               "properties": {"a": {"not": {"type": "string"}}}}},
              "json_schema"),
             ({"json_schema": {"type": "strin"}}, "json_schema")]
    if engine.config.grammar_backend == "llguidance":
        cases.append(({"ebnf": "start: (unclosed"}, "ebnf"))
    outs = engine.generate(["x"] * len(cases), [p for p, _ in cases])
    for (params, field), out in zip(cases, outs):
        assert out.finish_reason == "abort" and out.error_invalid, (params, out)
        assert out.error.startswith(field), out.error
    assert "/properties/a" in outs[2].error and "not" in outs[2].error
    assert_no_leak(engine)


class FailingMatcher:
    """A matcher that raises on `accept` or on `fill_mask`, as a buggy grammar engine might."""

    fill_masks = vars(GrammarMatcher)["fill_masks"]  # a batch's masks one by one

    def __init__(self, inner, fails: str) -> None:
        self.inner, self.fails = inner, fails

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def accept(self, token):
        if self.fails == "accept":
            raise RuntimeError("injected accept failure")
        self.inner.accept(token)

    def fill_mask(self, row):
        if self.fails == "mask":
            raise RuntimeError("injected mask failure")
        self.inner.fill_mask(row)

    def masks_along(self, tokens):
        if self.fails == "draft":
            raise RuntimeError("injected draft mask failure")
        return self.inner.masks_along(tokens)


def poison(engine, monkeypatch) -> None:
    """Requests whose grammar source starts with boomA / boomF / boomD get a FailingMatcher."""
    grammars = engine.core.grammar_engine()
    submit = grammars.submit

    def poisoned(spec):
        future = submit(spec)
        fails = {"boomA": "accept", "boomF": "mask", "boomD": "draft"}.get(spec.source[:5])
        if fails is None:
            return future
        compiled = future.result(timeout=60)
        proxy = Future()
        proxy.set_result(SimpleNamespace(warnings=(), matcher=lambda: FailingMatcher(
            compiled.matcher(), fails)))
        return proxy

    monkeypatch.setattr(grammars, "submit", poisoned)


def test_injected_grammar_failures_end_only_their_requests(engine, monkeypatch):
    """A grammar that throws while advancing or while masking aborts its own request with
    an error; the rest of the batch, constrained or not, finishes normally."""
    poison(engine, monkeypatch)
    params = [{"regex": "boomA[0-9]+", **SAMPLE}, {"regex": "[a-z]{1,8}", **SAMPLE},
              {"regex": "boomF[0-9]+", "temperature": 0}, {"temperature": 0, "max_new_tokens": 8},
              {"json_schema": PERSON, **SAMPLE}]
    outs = engine.generate(["x"] * len(params), params)
    assert outs[0].finish_reason == "abort" and "injected accept failure" in outs[0].error
    assert outs[2].finish_reason == "abort" and "injected mask failure" in outs[2].error
    assert not outs[0].error_invalid and not outs[2].error_invalid  # the engine's fault
    assert outs[1].error is None and outs[3].error is None and outs[4].error is None
    assert outs[3].completion_tokens == 8
    monkeypatch.undo()
    assert engine.generate("x", {"regex": "[a-z]{1,8}", **SAMPLE}).error is None
    assert_no_leak(engine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_grammar_failing_on_drafts_ends_only_its_request(tiny_chat_model, backend,
                                                           monkeypatch):
    from radixlm.runtime.execution.speculative.speculator import Speculator

    with Engine(str(tiny_chat_model), max_total_tokens=8192, speculative="ngram",
                grammar_backend=backend) as eng:
        poison(eng, monkeypatch)
        digit = eng.tokenizer.encode("7", add_special_tokens=False)[0]
        # Every request drafts: constrained ones get the drafts their grammar allows.
        monkeypatch.setattr(Speculator, "_ngram", lambda self, request, k: [digit] * k)
        params = [{"regex": "boomD[0-9]{1,12}", "temperature": 0, "max_new_tokens": 20},
                  {"regex": "[0-9]{1,12}", "temperature": 0, "max_new_tokens": 20},
                  {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}]
        outs = eng.generate(["N:"] * 3, params)
        assert outs[0].finish_reason == "abort" and "injected draft mask" in outs[0].error
        assert outs[1].error is None and re.fullmatch("[0-9]{1,12}", outs[1].text)
        assert outs[2].completion_tokens == 8
        assert eng.stats()["spec_drafted_tokens"] > 0
        assert_no_leak(eng)


def test_compile_failure_and_timeout_fail_only_their_request(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=4096, grammar_compile_timeout=1.0,
                grammar_backend="outlines") as eng:
        slow = '"[^"]{0,1000}"'  # ~10 s to compile on a 49k vocabulary
        impossible = r"[^\s\S]"  # valid syntax, but no token can ever match
        params = [{"regex": slow, **SAMPLE}, {"regex": impossible, **SAMPLE},
                  {"regex": "[a-z]{2,6}", **SAMPLE}, {"temperature": 0, "max_new_tokens": 5}]
        start = time.perf_counter()
        outs = eng.generate(["x"] * 4, params)
        assert time.perf_counter() - start < 8
        assert outs[0].finish_reason == "abort" and "timed out" in outs[0].error
        assert outs[1].finish_reason == "abort" and "regex" in outs[1].error
        assert outs[2].error is None and outs[3].completion_tokens == 5
        stats = eng.stats()
        assert stats["grammar_compile_timeouts"] == 1 and stats["grammar_compile_errors"] == 1
        assert_no_leak(eng)
        # The cached failure answers a resubmission at once; the engine keeps serving.
        again = eng.generate("x", {"regex": slow, **SAMPLE})
        assert again.finish_reason == "abort" and "timed out" in again.error
        assert eng.generate("x", {"regex": "[0-9]{3}", "temperature": 0}).finish_reason == "stop"


def test_a_compile_over_its_memory_limit_fails_alone(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=4096, grammar_backend="outlines",
                grammar_compile_max_memory_gb=0.3) as eng:
        outs = eng.generate(["x", "y"], [{"regex": '"[^"]{0,700}"', **SAMPLE},
                                         {"regex": "[a-z]{3}", **SAMPLE}])
        assert outs[0].finish_reason == "abort" and "worker died" in outs[0].error
        assert outs[1].error is None and re.fullmatch("[a-z]{3}", outs[1].text)
        assert_no_leak(eng)


def test_compiled_grammars_are_cached_within_a_memory_budget(tiny_chat_model):
    from radixlm.runtime.grammar.outlines import compiler

    with Engine(str(tiny_chat_model), max_total_tokens=4096, grammar_backend="outlines",
                grammar_cache_memory_gb=1e-4) as eng:  # ~100 kB
        small, large = r"[a-c]{2}", '"[^"]{0,40}"'  # a few kB and a few MB of index
        for _ in range(2):
            eng.generate(["x", "x"], [{"regex": small, **SAMPLE}, {"regex": large, **SAMPLE}])
        stats = eng.stats()
        assert stats["grammar_compiles"] == 3 and stats["grammar_cache_hits"] == 1
        cached = [f.result().regex for f in compiler._CACHE.values()
                  if f.done() and not f.exception()]
        assert small in cached and large not in cached


def test_a_compiling_grammar_does_not_hold_up_other_requests(outlines_engine):
    engine = outlines_engine  # its compiles take seconds; llguidance's, milliseconds
    result = {}
    slow = '"[^"]{0,400}"'  # a few seconds to compile
    thread = threading.Thread(target=lambda: result.update(
        out=engine.generate("x", {"regex": slow, "temperature": 0, "max_new_tokens": 4})))
    thread.start()
    while engine.stats()["grammar_waiting"] == 0:
        time.sleep(0.005)
    quick = engine.generate("y", {"temperature": 0, "max_new_tokens": 4})
    assert quick.completion_tokens == 4 and engine.stats()["grammar_waiting"] == 1
    thread.join(timeout=120)
    assert result["out"].error is None and result["out"].text.startswith('"')
    assert_no_leak(engine)


def test_a_grammar_outgrowing_the_matcher_limits_fails_alone_as_invalid(tiny_chat_model):
    # "(a|b)*a(a|b){16}" has 2^17 lexer states, built lazily as the output goes on: with the
    # limit at its floor (1000 states), the matcher gives up mid-output, which is the
    # request's grammar at fault (a 400 from the server), not the engine.
    with Engine(str(tiny_chat_model), max_total_tokens=8192, grammar_backend="llguidance",
                grammar_compile_max_memory_gb=1e-6) as eng:
        outs = eng.generate(["x", "y"], [
            {"regex": "(a|b)*a(a|b){16}", "temperature": 1.0, "max_new_tokens": 1000,
             "ignore_eos": True},
            {"regex": "[a-z]{3}", **SAMPLE}])
        assert outs[0].finish_reason == "abort" and outs[0].error_invalid
        assert outs[0].error.startswith("regex: ") and "too many states" in outs[0].error
        assert outs[1].error is None and re.fullmatch("[a-z]{3}", outs[1].text)
        assert_no_leak(eng)


def test_a_grammar_outgrowing_its_limits_mid_output_ends_that_request_only(engine,
                                                                         monkeypatch):
    """llguidance may exhaust its lexer or parser limits while generating (not only when
    compiling): the request ends with an error naming the limit, the others go on."""
    if engine.config.grammar_backend != "llguidance":
        pytest.skip("llguidance's limits")
    from radixlm.runtime.grammar.llguidance_engine import LLGuidanceMatcher, matcher_error

    checked = LLGuidanceMatcher._check
    masks: dict[int, int] = {}

    def exhausted_after_four_masks(self) -> None:
        masks[id(self)] = masks.get(id(self), 0) + 1
        if masks[id(self)] > 4:  # what llguidance reports then
            raise matcher_error("too many lexer states (max_lexer_states)")
        checked(self)

    monkeypatch.setattr(LLGuidanceMatcher, "_check", exhausted_after_four_masks)
    before = engine.stats()["grammar_errors"]
    outs = engine.generate(["A:", "B:"], [
        {"regex": "[a-z ]{1,40}", "max_new_tokens": 30, "temperature": 0},
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}])
    assert outs[0].finish_reason == "abort" and outs[0].error_invalid
    assert outs[0].error.startswith("regex: the grammar grew past the matcher's limits")
    assert "max_lexer_states" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 12
    assert engine.stats()["grammar_errors"] == before + 1
    assert_no_leak(engine)
