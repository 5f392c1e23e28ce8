"""Structural tags: both request shapes, every format, special-token triggers, and shape errors
that name the place; the grammar checked on the real tokenizer with llguidance."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.grammar import structural_tag

from conftest import structural_tag_acceptor

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}


def test_vllm_shape_free_text_with_held_tags(default_model_folder):
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=weather>", "schema": CITY, "end": "</function>"},
        {"begin": "<function=time>", "schema": {"type": "object"}, "end": "</function>"}]}
    accepts = structural_tag_acceptor(tag, default_model_folder)
    assert accepts("No call needed.")
    assert accepts('Sure. <function=weather>{"city":"Oslo"}</function> Then '
                   '<function=time>{}</function>.')
    assert not accepts('<function=weather>{"city":"Rio de Janeiro"}</function>')  # maxLength
    assert not accepts("<function=stock>{}</function>")  # no such tag
    assert not accepts("<function=weather>")  # an open tag must close


def test_format_tree_shapes(default_model_folder):
    think = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "any_text"}, {"type": "const_string", "value": "</think>"},
        {"type": "or", "elements": [{"type": "regex", "pattern": "[0-9]+/[0-9]+"},
                                    {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}]}]}}
    accepts = structural_tag_acceptor(think, default_model_folder)
    assert accepts("Let me think </think> a bit.</think>3/4") is False  # text ends at the tag
    assert accepts("hmm, é</think>3/4") and accepts("ok</think>no")
    assert not accepts("ok</think>maybe")
    once = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<n>"], "at_least_one": True,
        "stop_after_first": True, "tags": [{"begin": "<n>", "content": {
            "type": "json_schema", "json_schema": {"type": "integer"}}, "end": "</n>"}]}}
    accepts = structural_tag_acceptor(once, default_model_folder)
    assert accepts("so <n>42</n>") and not accepts("so") and not accepts("<n>1</n> more")


def test_special_tokens_are_matched_as_tokens(default_model_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_folder))
    start, mark = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<repo_name>"])
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags",
           "triggers": ["<|im_start|>"], "tags": [{"begin": "<|im_start|>call ", "content": {
               "type": "json_schema", "json_schema": {"type": "integer"}},
               "end": "<repo_name>"}]}}
    accepts = structural_tag_acceptor(tag, default_model_folder)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)
    assert accepts(ids=ids("hi ") + [start] + ids("call 7") + [mark] + ids(" bye"))
    assert not accepts(ids=ids("hi ") + [start] + ids("cal 7"))


@pytest.mark.parametrize(("tag", "place"), [
    ({"type": "structural_tag"}, "structural_tag.structures"),
    ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>"}},
     "structural_tag.format.content"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<b"],
                                           "tags": [{"begin": "<a>", "content": {
                                               "type": "any_text"}}]}},
     "structural_tag.format.tags[0].begin"),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "nope"}]}}, "structural_tag.format.elements[0].type"),
    ({"type": "structural_tag", "triggers": ["<a"], "structures": [
        {"begin": "<a>", "schema": 5}]}, "structural_tag.structures[0].schema"),
    ("{not json", "structural_tag is not valid JSON"),
])
def test_bad_shapes_are_refused_naming_the_place(tag, place):
    with pytest.raises(ValueError, match=place.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(structural_tag=tag)


def test_kept_as_compact_json_of_the_format_shape():
    legacy = {"type": "structural_tag", "triggers": ["<a"],
              "structures": [{"begin": "<a>", "schema": CITY, "end": "</a>"}]}
    params = SamplingParams(structural_tag=json.dumps(legacy))
    normal = json.loads(params.structural_tag)
    assert normal["type"] == "triggered_tags" and normal["tags"][0]["content"] == {
        "type": "json_schema", "json_schema": CITY}
    assert structural_tag.check({"type": "structural_tag", "format": normal}) == \
        params.structural_tag
    with pytest.raises(ValueError, match="exclusive"):
        SamplingParams(structural_tag=legacy, regex="a")
