"""OpenAI's Responses API (`/v1/responses`) with the official `openai` SDK on a tiny random
model (hermes tool template): text, streamed events, function calls and their outputs over
`previous_response_id`, `text.format` with `responses.parse`, the store, and errors naming the
Responses fields. The output items' order and events are also checked without a server."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from radixlm.backends.server_process import ServerProcess
from radixlm.runtime.server.responses_routes import _Output

from conftest import save_tiny_chat_model

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_folder):
    folder = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-responses"),
                                  default_model_folder,
                                  (TEMPLATES / "hermes_tools.jinja").read_text(),
                                  max_position_embeddings=4096)
    with ServerProcess(["--model", str(folder), "--max-total-tokens", "16384"]) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_text_whole_and_streamed_alike(client):
    body = dict(model="m", instructions="Be brief.", input="Say hello.", temperature=0,
                max_output_tokens=12)
    whole = client.responses.create(**body)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status == "incomplete" and whole.incomplete_details.reason == \
        "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    with client.responses.stream(**body) as stream:
        events = list(stream)
    final = events[-1].response  # (the SDK's get_final_response wants response.completed)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_function_calls_then_their_outputs_continue_the_conversation(client):
    first = client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=1.0,
                                    max_output_tokens=200)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    outputs = [{"type": "function_call_output", "call_id": c.call_id,
                "output": json.dumps({"temp_c": 18})} for c in calls]
    second = client.responses.create(model="m", previous_response_id=first.id, input=outputs,
                                     tools=[WEATHER], temperature=0, max_output_tokens=8)
    assert second.previous_response_id == first.id
    # The earlier conversation renders as before: the prefix cache serves it.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    # The same conversation sent whole (items, no stored state) renders the same prompt.
    again = client.responses.create(
        model="m", store=False, tools=[WEATHER], temperature=0, max_output_tokens=8,
        input=[{"role": "user", "content": "Weather in Paris?"},
               *[c.model_dump(exclude_none=True) for c in calls], *outputs])
    assert again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text


def test_streamed_call_arguments_come_in_fragments(client):
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model="m", input="Weather?", tools=[WEATHER],
                                 tool_choice=named, temperature=1.0, extra_body={"seed": 1},
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(fragments) >= 2 and "".join(fragments) == done.arguments  # as generated
    call = next(item for item in final.output if item.type == "function_call")
    assert call.arguments == done.arguments and call.name == "get_weather"


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    rainy: bool


def test_parse_with_a_json_schema_text_format(client):
    reply = client.responses.parse(model="m", input="Weather in Oslo as JSON.",
                                   text_format=Answer, temperature=1.0, max_output_tokens=200)
    assert isinstance(reply.output_parsed, Answer)


def test_store_retrieve_delete(client):
    kept = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="m", input="Hi", previous_response_id=unkept.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_bad_requests_name_the_responses_field(client):
    cases = [
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(tools=[{"type": "function", "name": "bad name"}]), "tools[0].name"),
        (dict(input=[{"role": "user", "content": "a"}, {"role": "user", "content": 5}]),
         "input[1].content"),
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "f",
                      "arguments": "{oops"}]), "input[0].tool_calls[0].function.arguments"),
        (dict(max_output_tokens=0), "max_output_tokens"),
        (dict(text={"format": {"type": "json_schema", "name": "x", "schema": 5}}),
         "text.format.schema"),
        (dict(background=True), "background"),
        (dict(truncation="auto"), "truncation"),
        (dict(tool_choice={"type": "function", "name": "nope"}, tools=[WEATHER]),
         "tool_choice.name"),
    ]
    for extra, param in cases:
        body = {"model": "m", "input": "Hi", "max_output_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**body)
        assert caught.value.body["param"] == param, (extra, caught.value.body)


def test_output_items_in_the_order_written():
    output = _Output("qwen3", "hermes", ["get_weather"])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = "<think>It rains there.</think>\n\nChecking." + call
    events = []
    for i in range(0, len(text), 4):
        piece = text[i:i + 4]
        events += output.feed(piece, "stop" if i + 4 >= len(text) else None)
    assert [item["type"] for item in output.items] == ["reasoning", "message",
                                                       "function_call"]
    reasoning, message, function_call = output.items
    assert reasoning["content"][0]["text"] == "It rains there."
    assert message["content"][0]["text"] == "Checking."
    assert json.loads(function_call["arguments"]) == {"city": "Oslo"}
    assert all(item["status"] == "completed" for item in output.items)
    opened = [e for kind, e in events if kind == "response.output_item.added"]
    closed = [e for kind, e in events if kind == "response.output_item.done"]
    assert [e["output_index"] for e in opened] == [e["output_index"] for e in closed] == [0, 1,
                                                                                         2]
    assert output.as_messages() == [{"role": "assistant", "content": "Checking.",
                                     "tool_calls": [{"id": function_call["call_id"],
                                                     "type": "function", "function": {
                                                         "name": "get_weather",
                                                         "arguments": function_call[
                                                             "arguments"]}}]}]


def test_the_responses_agent_example_runs(client):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "server" / "responses_agent.py"
    spec = importlib.util.spec_from_file_location("responses_agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    transcript = module.run(client, "m", "Weather in Oslo?", max_turns=2, max_output_tokens=40)
    assert transcript and all(isinstance(line, str) for line in transcript)


def test_a_tool_schema_the_grammar_refuses_is_a_400_naming_tools(client):
    odd = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}},
        "dependencies": {"a": ["b"]}}}  # valid JSON Schema; llguidance does not enforce it
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="m", input="Hi", tools=[odd], tool_choice="required",
                                    max_output_tokens=8, stream=stream)
        assert caught.value.body["param"] == "tools", caught.value.body


def test_instructions_come_first_and_are_not_carried_over(client):
    first = client.responses.create(model="m", instructions="Be brief.", input="Hi. " * 40,
                                    max_output_tokens=4, temperature=0)
    # The agent pattern: the same instructions every turn. The conversation renders as it
    # did, so the cache serves all of the first turn.
    second = client.responses.create(model="m", instructions="Be brief.", input="More",
                                     previous_response_id=first.id, max_output_tokens=4)
    page = 16  # (the cache holds whole pages)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - page
    other = client.responses.create(model="m", instructions="Be very detailed.", input="More",
                                    previous_response_id=first.id, max_output_tokens=4)
    assert other.usage.input_tokens_details.cached_tokens < first.usage.input_tokens
    assert other.instructions == "Be very detailed."
