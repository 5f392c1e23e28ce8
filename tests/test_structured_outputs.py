"""Structured output on the real default model (SmolLM2-135M-Instruct) over real-world
JSON Schemas from JSONSchemaBench: every finished output must validate."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from radixlm.runtime import Engine, SamplingParams

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench" / "Glaiveai2K"
SAMPLE_SIZE = 36  # a few are unsupported (named errors); at least 30 must run
MAX_NEW_TOKENS = 128


@pytest.fixture(scope="module")
def engine(default_model_folder):
    with Engine(max_total_tokens=32768) as eng:
        yield eng


def schema_sample() -> list[tuple[str, dict]]:
    if not DATA.is_dir():
        pytest.skip(f"JSONSchemaBench data not found at {DATA}")
    files = random.Random(1).sample(sorted(p.name for p in DATA.glob("*.json")), SAMPLE_SIZE)
    return [(f, json.loads((DATA / f).read_text())) for f in files]


def prompt(name: str, schema: dict) -> list[dict]:
    function = name.rsplit("_", 1)[0]
    return [{"role": "user", "content": (
        f"Call the function `{function}` with realistic arguments. Its parameters follow this "
        f"JSON Schema:\n{json.dumps(schema, separators=(',', ':'))}\n"
        "Reply with the JSON arguments only.")}]


def test_jsonschemabench_outputs_validate(engine):
    convs, params, cases, unsupported = [], [], [], []
    for name, schema in schema_sample():
        # A mild repetition penalty keeps the small model from looping inside arrays.
        params.append(SamplingParams(json_schema=schema, temperature=0, repetition_penalty=1.2,
                                     max_new_tokens=MAX_NEW_TOKENS))
        convs.append(prompt(name, schema))
        cases.append((name, schema))
    outs = engine.chat(convs, params)
    finished, cut = 0, []
    for (name, schema), out in zip(cases, outs):
        if out.error_invalid:  # refused by the grammar engine, naming what it cannot enforce
            assert out.finish_reason == "abort" and out.error.startswith("json_schema")
            unsupported.append(name)
            continue
        assert out.error is None, (name, out.error)
        if out.finish_reason == "length":
            cut.append(name)
            continue
        assert out.finish_reason == "stop"
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(out.text))
        finished += 1
    ran = len(cases) - len(unsupported)
    print(f"\njsonschemabench sample: {ran} run, {finished} finished and valid, "
          f"{len(cut)} cut at {MAX_NEW_TOKENS} tokens {cut}, {len(unsupported)} unsupported "
          f"{unsupported}")
    assert ran >= 30, unsupported
    assert finished >= 0.8 * ran
    stats = engine.stats()
    assert stats["grammar_errors"] == len(unsupported) and stats["jump_forward_tokens"] > 0


def test_short_regexes_on_the_real_model(engine):
    ask = [{"role": "user", "content": "Is Paris the capital of France? Answer yes or no."}]
    out = engine.chat(ask, {"regex": "(yes|no)", "temperature": 0})
    assert out.text == "yes" and out.finish_reason == "stop"
    ask = [{"role": "user", "content": "How many legs does a spider have? Reply with a number."}]
    out = engine.chat(ask, {"regex": r"-?\d+", "temperature": 0, "max_new_tokens": 8})
    assert re.fullmatch(r"-?\d+", out.text)
    ask = [{"role": "user", "content": "Name a fruit."}]
    out = engine.chat(ask, {"regex": r"[^\n]*", "temperature": 0, "max_new_tokens": 16})
    assert "\n" not in out.text and out.text


def test_structured_mds_grammar_example_ends_where_it_says(engine):
    """docs/structured.md's GBNF example, as printed there: bounded digits end in "C"."""
    grammar = 'root ::= ("sunny" | "rainy") ", " [0-9]{1,2} "C"'
    out = engine.generate("Weather:", {"ebnf": grammar, "temperature": 0})
    assert out.finish_reason == "stop" and out.text == "sunny, 20C"
