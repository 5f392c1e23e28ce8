"""Structured output building blocks, without a model: vocabularies, pattern and schema
checks, schema -> regex soundness, masks, jump-forward tokenization."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime import SamplingParams
from radixlm.runtime.execution.sampling.logit_processing import apply_token_bitmask
from radixlm.runtime.grammar.outlines import json_regex as jr
from radixlm.runtime.grammar.outlines.json_schema import json_object_regex, schema_to_regex
from radixlm.runtime.grammar.outlines.matcher import OutlinesGrammar
from radixlm.runtime.grammar.outlines.vocabulary import build_vocabulary
from radixlm.runtime.grammar.regex_check import check_regex, json_string_pattern
from radixlm.runtime.grammar.spec import choices_regex


@pytest.fixture(scope="module")
def smol_tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


@pytest.fixture(scope="module")
def smol_vocab(smol_tokenizer):
    return build_vocabulary(smol_tokenizer)


# -- vocabularies --------------------------------------------------------------------------------


def test_byte_level_vocabulary(smol_tokenizer, smol_vocab):
    assert smol_vocab.kind == "byte_level" and smol_vocab.size == len(smol_tokenizer)
    special = {i for i, t in smol_tokenizer.added_tokens_decoder.items() if t.special}
    assert special and all(smol_vocab.token_bytes[i] is None for i in special)
    assert smol_vocab.automaton_eos in special
    # Token bytes concatenate to the exact UTF-8 of any text, multi-byte characters included.
    for text in ["Hello world!\n", "  indented\tcode();", "naïve café — 日本語 🙂", '{"a": 1}']:
        ids = smol_tokenizer.encode(text, add_special_tokens=False)
        assert smol_vocab.bytes_of(ids) == text.encode("utf-8")
    assert smol_vocab.token_bytes[smol_tokenizer.convert_tokens_to_ids("Ġthe")] == b" the"
    # Jump-forward walks the automaton one byte at a time through these.
    assert all(smol_vocab.single_byte[b] is not None for b in range(0x20, 0x7F))


def test_sentencepiece_vocabulary():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "\u2581hello", "\u2581wor", "ld", "<0x0A>", "<0xE6>",
              "\u2581", "é", "<|user|>"]
    model = models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                       unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                         decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.add_tokens(["<|user|>"], special_tokens=True)
    vocab = build_vocabulary(tok)
    assert vocab.kind == "sentencepiece"
    got = dict(zip(pieces, vocab.token_bytes))
    assert got["\u2581hello"] == b" hello" and got["ld"] == b"ld" and got["\u2581"] == b" "
    assert got["<0x0A>"] == b"\n" and got["<0xE6>"] == b"\xe6" and got["é"] == "é".encode()
    for special in ("<unk>", "<s>", "</s>", "<|user|>"):
        assert got[special] is None
    assert vocab.automaton_eos == 2


# -- patterns and fields -------------------------------------------------------------------------


@pytest.mark.parametrize("pattern, expected", [
    (r"^\d+$", "[0-9]+"), (r"-?\d+", "-?[0-9]+"), ("(yes|no)", "(yes|no)"),
    (r"[^\n]*", r"[^\n]*"), (r"abc\$", r"abc\$"), (r"\Aab\Z", "ab"), (r"[\d.]+", "[0-9.]+"),
    (r"[^\d]", r"[^\d]"), (r"\\d", r"\\d")])
def test_check_regex_strips_anchors_and_makes_digits_ascii(pattern, expected):
    assert check_regex(pattern) == expected


@pytest.mark.parametrize("pattern, message", [
    ("(", "invalid regular expression"), (r"(?=a)b", "look-ahead"), (r"(a)\1", "backref"),
    (r"\bword", "anchors"), ("^a|b$", "anchors"), ("x{0,5000}", "positions"),
    (r"(?>a)b", "atomic")])
def test_check_regex_refuses(pattern, message):
    with pytest.raises(ValueError, match="^regex: .*" + message):
        check_regex(pattern)


def test_json_string_pattern_keeps_json_strings_valid():
    assert json_string_pattern("^[a-z]+$", "p") == "[a-z]+"
    assert json_string_pattern(r"^\d+$", "p") == "[0-9]+"
    safe = re.compile(json_string_pattern(r".*\S", "p"))
    assert safe.fullmatch("ab c") and not safe.fullmatch('a"b') and not safe.fullmatch("a\nb")
    with pytest.raises(ValueError, match="quote"):
        json_string_pattern('say "hi"', "p")


def test_sampling_params_grammar_fields():
    p = SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert p.json_schema == '{"type":"object","properties":{"a":{"type":"integer"}}}'
    assert p.constrained and hash(p) == hash(SamplingParams(json_schema=p.json_schema))
    assert not SamplingParams().constrained
    with pytest.raises(ValueError, match="regex and json_schema are exclusive"):
        SamplingParams(regex="a", json_schema="{}")
    with pytest.raises(ValueError, match="json_object must be a bool"):
        SamplingParams(json_object="yes")
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{oops")
    with pytest.raises(ValueError, match="ebnf and json_object are exclusive"):
        SamplingParams(ebnf="start: a", json_object=True)
    # What only a compile can tell (an invalid schema, a keyword no engine enforces) is the
    # grammar engine's to find, off the caller's thread: submission stays cheap.
    assert SamplingParams(json_schema={"type": "integr"}).constrained
    assert SamplingParams(ebnf='root ::= "a"').constrained
    with pytest.raises(ValueError, match="json_schema is not a valid JSON Schema"):
        schema_to_regex(json.dumps({"type": "integr"}), 1)
    with pytest.raises(ValueError, match=r"json_schema: 'not' is not supported \(at /properties/x"):
        schema_to_regex(json.dumps({"properties": {"x": {"not": {"type": "null"}}}}), 1)


def test_choices_regex_escapes():
    pattern = choices_regex(["a.b", "c|d (e)", "f"])
    assert [bool(re.fullmatch(pattern, s)) for s in ("a.b", "c|d (e)", "f", "axb")] == \
        [True, True, True, False]


# -- schema -> regex: sound by construction, checked by sampling ----------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(0, 10**6), st.integers(-10**7, 10**7))
def test_integer_range_is_exact(lo, width, probe):
    hi = lo + width
    pattern = re.compile(jr.integer_range(lo, hi))
    for n in (lo, hi, lo - 1, hi + 1, probe, (lo + hi) // 2):
        assert bool(pattern.fullmatch(str(n))) == (lo <= n <= hi), (lo, hi, n)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 18, "maximum": 99},
                                      "score": {"type": "number", "exclusiveMinimum": -1,
                                                "maximum": 2.5}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 1,
     "maxItems": 3},
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "boolean"},
               {"type": "string", "format": "uuid"}, {"type": "string", "format": "date-time"},
               {"type": "string", "format": "email"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"const": "x"}}, "required": ["b"]}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}, "b": {}},
                "additionalProperties": False},
               {"properties": {"b": {"type": "null"}, "c": {"type": "integer"}}}]},
    {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer"},
                                      "s": {"type": "string", "maxLength": 2}},
     "oneOf": [{"required": ["n"]}, {"required": ["s"]}, {"required": ["n", "s"]}]},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"},
                                      "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}},
     "required": ["ip", "code", "extra"]},
    {"definitions": {"pt": {"type": "object", "properties": {"x": {"type": "number"}},
                            "required": ["x"]}},
     "type": "object", "properties": {"p": {"$ref": "#/definitions/pt"},
                                      "tags": {"type": "array", "items": {"type": "string"}}}},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_schema_regex_only_matches_valid_json(schema, data):
    regex = schema_to_regex(json.dumps(schema), 1)
    text = data.draw(st.from_regex(regex, fullmatch=True))
    validate(json.loads(text), schema)


def validate(instance, schema) -> None:
    """jsonschema validation, formats included (as far as jsonschema can check them)."""
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(instance)


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "multipleOf": 3}, "'multipleOf' is not supported"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not supported"),
    ({"type": "string", "format": "ipv6"}, "format 'ipv6' is not supported"),
    ({"type": "object", "minProperties": 2}, "'minProperties'"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 4}, "pattern"),
    ({"$defs": {"n": {"properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
     "recursive"),
    ({"type": "string", "minLength": 500}, "minLength 500"),
    ({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "patternProperties"),
])
def test_unsupported_schema_features_are_named(schema, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schema_to_regex(json.dumps(schema), 1)


def test_absurd_bounds_are_clamped_and_whitespace_bounded():
    regex = schema_to_regex(json.dumps({"type": "string", "maxLength": 32767}), 1)
    assert "{0,64}" in regex
    compact = schema_to_regex(json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}), 0)
    assert re.fullmatch(compact, '{"a":12}') and not re.fullmatch(compact, '{ "a":12}')
    loose = json_object_regex(2)
    assert re.fullmatch(loose, '{  "a" :  [1, 2], "b": {"c": null}}')
    assert not re.fullmatch(loose, '{   "a": 1}') and not re.fullmatch(loose, '{\n"a": 1}')
    assert not re.fullmatch(loose, '{"a": 1' + "0" * 20 + "}")  # digits are bounded too


# -- masks and jump-forward on the real tokenizer ------------------------------------------------


def compile_grammar(vocab, regex: str) -> OutlinesGrammar:
    import outlines_core

    index = outlines_core.Index(regex, outlines_core.Vocabulary(vocab.automaton_eos,
                                                                vocab.byte_map()))
    return OutlinesGrammar(index, vocab, -(-vocab.size // 32), regex)


def allowed_ids(grammar, matcher) -> set[int]:
    row = np.zeros(grammar.mask_words, dtype=np.uint32)
    matcher.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_masks_terminal_states_and_eos(smol_vocab, smol_tokenizer):
    grammar = compile_grammar(smol_vocab, "(yes|no)!?")
    m = grammar.matcher()
    allowed = allowed_ids(grammar, m)
    assert smol_tokenizer.convert_tokens_to_ids("yes") in allowed
    assert all(smol_vocab.token_bytes[t] and (b"yes!".startswith(smol_vocab.token_bytes[t])
                                              or b"no!".startswith(smol_vocab.token_bytes[t]))
               for t in allowed)
    assert smol_vocab.automaton_eos not in allowed and not m.is_final
    m.accept(smol_tokenizer.convert_tokens_to_ids("yes"))
    assert m.is_final and not m.is_terminated  # "!" may still follow
    m.accept(smol_tokenizer.convert_tokens_to_ids("!"))
    assert m.is_terminated and allowed_ids(grammar, m) == set()
    with pytest.raises(Exception, match="not allowed"):
        m.accept(smol_tokenizer.convert_tokens_to_ids("!"))


def test_state_info_from_masks_matches_the_index(smol_vocab, smol_tokenizer):
    regex = schema_to_regex(json.dumps({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 30}, "tag": {"enum": ["x", "yz"]},
        "note": {"type": "string", "maxLength": 3}}, "required": ["id", "tag"]}), 1)
    grammar = compile_grammar(smol_vocab, regex)
    m = grammar.matcher()
    for token in smol_tokenizer.encode('{"id": 27, "tag":"yz", "note": "ab"}',
                                       add_special_tokens=False):
        assert grammar._info_from_mask(m.state, m.guide) == grammar._info_from_list(m.state)
        m.accept(token)
    assert m.is_terminated


def test_jump_forward_tokens_are_canonical_and_back_off(smol_vocab, smol_tokenizer):
    from radixlm.runtime.grammar.outlines.jump_forward import forced_tokens

    regex = schema_to_regex(json.dumps({"type": "object", "properties": {
        "customer_name": {"type": "string"}, "quantity": {"type": "integer"}},
        "required": ["customer_name", "quantity"]}), 0)
    grammar = compile_grammar(smol_vocab, regex)
    m = grammar.matcher()
    prompt = smol_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert m.forced_bytes() == b'{"customer_name":"'
    tokens = forced_tokens(m, prompt, smol_tokenizer)
    text = smol_vocab.bytes_of(tokens)
    # A prefix of the forced text, tokenized as the tokenizer would, ending before `":"`
    # (a longer allowed token such as `":"J` could span past the forced part).
    assert b'{"customer_name":"'.startswith(text) and text.startswith(b'{"customer')
    assert tokens == smol_tokenizer.encode(text.decode(), add_special_tokens=False)
    for t in tokens:
        m.accept(t)
    assert m.forced_bytes() == b'{"customer_name":"'[len(text):]


@pytest.mark.parametrize("path", ["table", "shifts"])
def test_apply_token_bitmask_matches_a_loop(path, monkeypatch):
    from radixlm.runtime.execution.sampling import logit_processing

    if path == "shifts":  # the GPU path, checked here on CPU
        monkeypatch.setattr(logit_processing, "_apply_by_byte_table",
                            logit_processing._apply_by_shifts)
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    bits = torch.zeros(2, 2, dtype=torch.int32)  # covers ids 0..63; 64..69 are padding
    allowed = [{0, 5, 31, 33, 63}, {1}]
    for r, ids in enumerate(allowed):
        for t in ids:
            word = int(bits[r, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bits[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    out = apply_token_bitmask(logits, [0, 2], bits)
    assert torch.equal(out[1], logits[1])  # an unconstrained row is untouched
    for row, ids in zip((0, 2), allowed):
        expect = torch.full((70,), float("-inf"))
        expect[list(ids)] = logits[row, list(ids)]
        assert torch.equal(out[row], expect)
    everything = apply_token_bitmask(logits[[0, 2]], [0, 1], bits)  # the all-rows path
    assert torch.equal(everything[0], out[0]) and torch.equal(everything[1], out[2])
