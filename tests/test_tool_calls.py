"""OpenAI tool calling: the parsers of each chat format (whole and streamed), and
/v1/chat/completions with the official `openai` SDK on a tiny random model, in every
`tool_choice` mode, streamed and not, over a two-turn conversation.

The model is random, so `auto` replies are text; `required` and named replies are calls that
the grammar makes valid, checked with `jsonschema` on seeded samples."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import radixlm as rl
from radixlm.backends.server_process import ServerProcess
from radixlm.runtime import Engine
from radixlm.runtime.protocol import tool_formats as tp
from radixlm.runtime.protocol.tool_stream import StreamingToolParser

from conftest import save_tiny_chat_model, structural_tag_acceptor

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
ORDER = {"type": "function", "function": {  # nested objects and arrays
    "name": "place_order", "parameters": {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 8},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "quantity"], "additionalProperties": False}}},
        "required": ["customer", "items"], "additionalProperties": False}}}
TOOLS = [WEATHER, ORDER]
NAMES = ["get_weather", "place_order"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- parsers ----------------------------------------------------------------------------------

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
REPLIES = {
    "hermes": ("Let me check.\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>\n"
               "<tool_call>\n" + json.dumps({**CALL, "arguments": {"city": "Oslo"}})
               + "\n</tool_call>", "Let me check.", ["Paris", "Oslo"]),
    "llama3_json": ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": {
        "city": "Paris"}}) + "; " + json.dumps({"name": "get_weather", "parameters": {
            "city": "Oslo"}}), "", ["Paris", "Oslo"]),
    "mistral": ("[TOOL_CALLS]" + json.dumps([CALL, {**CALL, "arguments": {"city": "Oslo"}}]),
                "", ["Paris", "Oslo"]),
}


def _stream(fmt: str, text: str, step: int, cut: bool = False):
    """(content, {index: [name, arguments]}, calls made, deltas) of `text` streamed in pieces
    of `step` characters, assembled as the SDK's stream helpers do."""
    parser = StreamingToolParser(fmt, NAMES)
    content, deltas = "", []
    for i in range(0, len(text), step):
        piece, more = parser.feed(text[i:i + step])
        content += piece
        deltas += more
    rest, more, made = parser.finish(cut)
    calls: dict[int, list[str]] = {}
    for d in deltas + more:
        entry = calls.setdefault(d["index"], ["", ""])
        entry[0] += d["function"].get("name") or ""
        entry[1] += d["function"]["arguments"]
    return content + rest, calls, made, deltas


@pytest.mark.parametrize("fmt", tp.FORMATS)
def test_each_format_parses_whole_and_streamed_alike(fmt):
    text, content, cities = REPLIES[fmt]
    got_content, calls = tp.parse(fmt, text, NAMES)
    assert got_content == content
    assert [json.loads(c.arguments)["city"] for c in calls] == cities
    assert all(c.name == "get_weather" and c.id for c in calls)
    for step in (1, 5, len(text)):
        streamed, streamed_calls, made, deltas = _stream(fmt, text, step)
        assert streamed.strip() == content and made == len(calls)
        assert [(n, json.loads(a)) for n, a in streamed_calls.values()] == [
            (c.name, json.loads(c.arguments)) for c in calls]
        if step == 1:  # name first, with the id; then the arguments in fragments as written
            first = [d for d in deltas if d["index"] == 0]
            assert first[0]["id"] and first[0]["function"] == {"name": "get_weather",
                                                                "arguments": ""}
            assert len(first) > 5 and all("name" not in d["function"] for d in first[1:])


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # unknown
    ("hermes", "Just text, no calls."),
    ("llama3_json", '{"name": "get_weather", "parameters": [1, 2]}'),
    ("llama3_json", "The weather is fine {not json}"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": "{bad"}]'),
])
def test_a_reply_that_is_not_a_valid_call_is_text(fmt, text):
    assert tp.parse(fmt, text, NAMES) == (text, [])
    streamed, calls, made, _ = _stream(fmt, text, 1)
    if text.endswith("Par"):  # streaming had opened the call already: it stays a call
        assert streamed == "" and made == 1 and calls[0][0] == "get_weather"
    else:
        assert streamed == text and made == 0


@pytest.mark.parametrize("fmt", tp.FORMATS)
def test_a_reply_cut_inside_its_second_call_returns_the_first_as_a_call(fmt):
    text = REPLIES[fmt][0]
    cut = text[:text.rindex("Oslo")]
    assert tp.parse(fmt, "No call.", NAMES, cut=True) == ("No call.", [])
    assert tp.parse(fmt, cut, NAMES)[1] == []  # not a reply of whole calls...
    content, calls = tp.parse(fmt, cut, NAMES, cut=True)  # ...but the budget ended it
    assert content == REPLIES[fmt][1] and "tool_call" not in content
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}]
    streamed, streamed_calls, made, _ = _stream(fmt, cut, 3, cut=True)
    assert streamed.strip() == content and json.loads(streamed_calls[0][1]) == {"city": "Paris"}


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.integers(1, 9))
def test_streamed_content_is_never_lost_or_reordered(prefix, step):
    text = prefix + "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"
    streamed, calls, made, _ = _stream("hermes", text, step)
    whole_content, whole_calls = tp.parse("hermes", text, NAMES)
    assert streamed in (whole_content, prefix)  # the text before the call, as sent
    assert made == len(whole_calls) and len(calls) == len(whole_calls)


@pytest.mark.parametrize("fmt", tp.FORMATS)
def test_the_call_grammar_takes_parallel_calls_only_when_allowed(fmt, default_model_folder):
    tools = [t["function"] for t in TOOLS]
    one = {"name": "get_weather", "arguments": {"city": "Paris"}}
    if fmt == "llama3_json":
        one = {"name": "get_weather", "parameters": {"city": "Paris"}}
    text = {"hermes": "<tool_call>\n{0}\n</tool_call>", "llama3_json": "{0}",
            "mistral": "[TOOL_CALLS][{0}]"}[fmt].format(json.dumps(one))
    two = {"hermes": text + "\n" + text, "llama3_json": text + "; " + text,
           "mistral": text[:-1] + ", " + json.dumps(one) + "]"}[fmt]
    bad = text.replace("Paris", "P" * 30)  # longer than the schema's maxLength
    for required in (True, False):
        accepts = {parallel: structural_tag_acceptor(
            tp.call_structural_tag(fmt, tools, parallel, required), default_model_folder)
            for parallel in (False, True)}
        assert accepts[False](text) and accepts[True](text)
        assert accepts[True](two) and not accepts[False](two)
        assert not accepts[True](bad)
        # auto: plain text is a reply too; required: only calls are
        assert accepts[True]("I can answer that myself.") is not required
    assert [c.name for c in tp.parse(fmt, two, NAMES)[1]] == ["get_weather"] * 2


def test_auto_holds_a_started_call_to_its_schema_and_resolves_local_refs(default_model_folder):
    unit = {"type": "function", "function": {"name": "convert", "parameters": {
        "$defs": {"Unit": {"type": "string", "enum": ["C", "F"]}},
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Unit"}}, "required": ["to"]}}}
    tools = [t["function"] for t in (WEATHER, unit)]
    accepts = structural_tag_acceptor(tp.call_structural_tag("hermes", tools, True, False),
                       default_model_folder)
    call = '<tool_call>\n{"name": "convert", "arguments": {"to": "F"}}\n</tool_call>'
    assert accepts("Sure. " + call + " Done.")
    assert accepts(call + "\n" + call.replace('"F"', '"C"'))
    assert not accepts("Sure. " + call.replace('"F"', '"K"'))  # not a Unit
    assert not accepts('Sure. <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>')
    assert not accepts("Sure. <tool_call>\nanything")  # once started, a call


@pytest.mark.parametrize(("template", "fmt"), [
    ("hermes_tools.jinja", "hermes"), ("llama3_tools.jinja", "llama3_json"),
    ("mistral_tools.jinja", "mistral"), (None, "hermes")])
def test_the_format_is_picked_from_the_template(template, fmt):
    text = (TEMPLATES / template).read_text() if template else None
    assert tp.format_for_template(text) == fmt


# -- the server -------------------------------------------------------------------------------

def _model(tmp_path_factory, default_model_folder, template: str) -> Path:
    text = None if template == "smollm2" else (TEMPLATES / template).read_text()
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tools"), default_model_folder,
                                text, max_position_embeddings=4096)


# The server on a template with tools and on one without (the SmolLM2 default's, which gets
# the tools described in a system message); every format on its template is below, in process.
@pytest.fixture(scope="module", params=["hermes_tools.jinja", "smollm2"])
def server(request, tmp_path_factory, default_model_folder):
    """A server whose model has this chat template."""
    folder = _model(tmp_path_factory, default_model_folder, request.param)
    with ServerProcess(["--model", str(folder), "--max-total-tokens", "16384"]) as process:
        process.model_folder = folder
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _chat(client, **kwargs):
    return client.chat.completions.create(model="m", messages=kwargs.pop("messages", ASK),
                                          tools=kwargs.pop("tools", TOOLS), **kwargs)


def _schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_calls_are_valid(client):
    for seed in range(8):
        reply = _chat(client, tool_choice="required", temperature=1.0, seed=seed,
                      max_tokens=400)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))


def test_one_call_when_parallel_calls_are_off(client):
    for seed in range(4):
        reply = _chat(client, tool_choice="required", parallel_tool_calls=False,
                      temperature=1.0, seed=seed, max_tokens=400)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_named_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "place_order"}}
    for seed in range(4):
        reply = _chat(client, tool_choice=named, temperature=1.0, seed=seed, max_tokens=400)
        calls = reply.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["place_order"]
        jsonschema.validate(json.loads(calls[0].function.arguments), _schema("place_order"))


def test_streamed_calls_equal_the_whole_reply(client):
    body = dict(tool_choice="required", temperature=1.0, seed=3, max_tokens=400)
    whole = _chat(client, **body).choices[0]
    calls, content, finish, pieces = {}, "", None, 0  # (and each delta's shape checked)
    for chunk in _chat(client, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if entry["name"]:  # the name comes once, first, with the id
                    assert call.function.name is None and call.id is None
                else:
                    assert call.id and call.function.name
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                pieces += 1
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert pieces > 2 * len(calls)  # arguments streamed as written, not one chunk a call
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert content == (whole.message.content or "")


def test_auto_and_none_reply_with_text_or_valid_calls(client):
    for choice_mode in ("auto", "none"):
        for stream in (False, True):
            body = dict(tool_choice=choice_mode, temperature=0, max_tokens=24)
            if not stream:
                choice = _chat(client, **body).choices[0]
                calls = choice.message.tool_calls or []
            else:
                calls = [c for chunk in _chat(client, stream=True, **body)
                         for ch in chunk.choices for c in ch.delta.tool_calls or []]
            if choice_mode == "none":
                assert calls == []
            for call in calls:  # a random model rarely calls; when it does, validly
                jsonschema.validate(json.loads(call.function.arguments),
                                    _schema(call.function.name))


def test_a_budget_that_cuts_a_call_never_returns_call_markup_as_text(client):
    for stream in (False, True):
        body = dict(tool_choice="required", temperature=1.0, seed=1, max_tokens=12)
        if not stream:
            choice = _chat(client, **body).choices[0]
            content, finish = choice.message.content, choice.finish_reason
        else:
            chunks = [c for chunk in _chat(client, stream=True, **body) for c in chunk.choices]
            content = "".join(c.delta.content or "" for c in chunks)
            finish = next(c.finish_reason for c in chunks if c.finish_reason)
        assert finish == "length" and not content  # the cut call is not text


def test_pydantic_style_tools_with_local_refs(client):
    unit = {"type": "function", "function": {"name": "convert", "parameters": {
        "$defs": {"Unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
        "type": "object", "properties": {"value": {"type": "number"},
                                         "to": {"$ref": "#/$defs/Unit"}},
        "required": ["value", "to"]}}}
    for choice in ("required", {"type": "function", "function": {"name": "convert"}}):
        reply = _chat(client, tools=[unit], tool_choice=choice, temperature=1.0, seed=2,
                      max_tokens=200).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        jsonschema.validate(json.loads(reply.message.tool_calls[0].function.arguments),
                            unit["function"]["parameters"])


def test_structural_tag_response_format(client, server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": ",", "at_least_one": True,
        "stop_after_first": False,
        "tags": [{"begin": "<n>", "content": {"type": "json_schema", "json_schema": schema},
                  "end": "</n>"}]}}
    reply = client.chat.completions.create(model="m", messages=ASK, response_format=tag,
                                           temperature=1.0, seed=0, max_tokens=60)
    text = reply.choices[0].message.content
    parts = re.findall(r"<n>(.*?)</n>", text)
    assert parts and text == ",".join(f"<n>{p}</n>" for p in parts) or \
        reply.choices[0].finish_reason == "length"
    for part in parts:
        jsonschema.validate(json.loads(part), schema)
    legacy = {"type": "structural_tag", "triggers": ["<n>"], "structures": [
        {"begin": "<n>", "schema": schema, "end": "</n>"}]}
    body = {"text": "Count: ", "sampling_params": {"structural_tag": json.dumps(legacy),
                                                   "max_new_tokens": 40, "temperature": 1.0}}
    request = urllib.request.Request(server.url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        native = json.loads(response.read())
    for part in re.findall(r"<n>(.*?)</n>", native["text"]):
        jsonschema.validate(json.loads(part), schema)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, response_format={
            "type": "structural_tag", "format": {"type": "tag", "begin": "<a>"}})
    assert caught.value.body["param"] == "response_format"
    assert "structural_tag.format.content" in caught.value.body["message"]


def test_a_two_turn_tool_conversation(client):
    first = _chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=200).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    reply = _chat(client, messages=messages, temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_tool_name_must_be_the_whole_string():
    from radixlm.runtime.protocol.fields import ApiError, Fields
    from radixlm.runtime.protocol.tool_requests import parse_tools

    for name in ("get_weather\n", "get weather", "", "x" * 65):
        with pytest.raises(ApiError) as caught:
            parse_tools(Fields({"tools": [{"type": "function", "function": {"name": name}}]}))
        assert caught.value.param == "tools[0].function.name"


def test_bad_tool_requests_are_400_naming_the_field(client):
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 5}}}}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function",
                       "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}},
            "dependencies": {"a": ["b"]}}}}]}, "tools"),  # (a keyword llguidance refuses)
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            _chat(client, max_tokens=4, **extra)
        assert caught.value.body["param"] == param, caught.value.body


def _assembled(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    """(content, calls, finish reason) of a streamed chat reply, joined as the SDK does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.parametrize("template", ["llama3_tools.jinja", "mistral_tools.jinja"])
def test_the_other_formats_over_the_sdk(template, tmp_path_factory, default_model_folder):
    """llama3_json and mistral replies through the server, whole and streamed, each tool
    choice (hermes is above)."""
    folder = _model(tmp_path_factory, default_model_folder, template)
    with ServerProcess(["--model", str(folder), "--max-total-tokens", "16384"]) as process:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named, "auto"):
            body = dict(tool_choice=choice, temperature=1.0, seed=5,
                        max_tokens=40 if choice == "auto" else 200)
            whole = _chat(client, **body).choices[0]
            calls = whole.message.tool_calls or []
            assert calls or choice == "auto"
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments),
                                    _schema(call.function.name))
            content, streamed, finish = _assembled(_chat(client, stream=True, **body))
            assert streamed == [(c.function.name, json.loads(c.function.arguments))
                                for c in calls]
            assert finish == whole.finish_reason and content == (whole.message.content or "")


# -- the language -----------------------------------------------------------------------------

@rl.function
def weather_agent(s, question):
    s += rl.user(question)
    s += rl.assistant(rl.tool_call("calls", tools=TOOLS, tool_choice="get_weather",
                                   max_tokens=200))
    for call in s["calls"]:
        s += rl.tool(json.dumps({"city": call["arguments"]["city"], "temp_c": 18}),
                     tool_call_id=call["id"])
    s += rl.assistant(rl.gen("answer", max_tokens=8))


@pytest.mark.parametrize("backend_kind", ["engine", "endpoint", "openai"])
def test_tool_call_in_programs_on_every_backend(server, backend_kind):
    if backend_kind == "engine":
        backend = rl.Engine(engine=Engine(str(server.model_folder), max_total_tokens=4096))
    elif backend_kind == "endpoint":
        backend = rl.RuntimeEndpoint(server.url)
    else:
        backend = rl.OpenAI("m", base_url=server.url + "/v1", api_key="none")
    with backend:
        state = weather_agent.run(question="Weather in Paris?", backend=backend, temperature=0)
        assert state.error() is None, state.error()
        calls = state["calls"]
        assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["id"]
        jsonschema.validate(calls[0]["arguments"], _schema("get_weather"))
        roles = [m["role"] for m in state.messages()]
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert state.messages()[1]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert isinstance(state["answer"], str)


@pytest.mark.parametrize("template", ["hermes_tools.jinja", "llama3_tools.jinja",
                                      "mistral_tools.jinja"])
def test_each_format_on_its_template_in_process(template, tmp_path_factory,
                                                default_model_folder):
    """The format picked from each template, its grammar and parser: enforced calls valid on
    seeded samples, and a whole program with the tool result rendered back."""
    folder = _model(tmp_path_factory, default_model_folder, template)

    @rl.function
    def call(s, seed):
        s += rl.user("Do something.")
        s += rl.assistant(rl.tool_call("calls", tools=TOOLS, tool_choice="required",
                                       max_tokens=300, seed=seed))

    with rl.Engine(engine=Engine(str(folder), max_total_tokens=8192)) as backend:
        for state in call.run_batch([{"seed": seed} for seed in range(6)], backend=backend,
                                    temperature=1.0, progress_bar=False):
            assert state.error() is None and state["calls"], state.text()
            for c in state["calls"]:
                jsonschema.validate(c["arguments"], _schema(c["name"]))
        state = weather_agent.run(question="Weather in Paris?", backend=backend, temperature=0)
        assert state.error() is None, state.error()
        assert [m["role"] for m in state.messages()] == ["user", "assistant", "tool",
                                                         "assistant"]
