"""The server against clients that attack what runs code on their behalf: the chat template (a
Jinja program) and tool schemas (JSON Schema meta-validation). Every attack is a quick 400
naming the field, and /health and everyone else's requests keep being answered meanwhile."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_server import Http, error_of

from radixlm.backends.server_process import ServerProcess

TEMPLATE_PARAM = "chat_template_kwargs.chat_template"
NESTED_LOOP = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
               "{% endfor %}")
HUGE_STRING = "{{ 'A' * 400000000 }}"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with ServerProcess(["--model", str(tiny_chat_model), "--max-total-tokens", "8192",
                        "--max-running-requests", "4"]) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    return Http(server.url)


def chat(**fields) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": HI, **fields}


def still_serving(http: Http) -> None:
    reply = http.post("/v1/chat/completions", json=chat())
    assert reply.status_code == 200, reply.text
    reply = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200, reply.text


def post_while_probing_health(http: Http, body: dict) -> tuple[object, float]:
    """POST `body` to the chat route while /health is asked every 0.1 s (2 s timeout each);
    the reply and the slowest /health answer (inf: one never came)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(
        reply=http.post("/v1/chat/completions", json=body)))
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        try:
            with urllib.request.urlopen(http.url + "/health", timeout=2) as r:
                assert r.status == 200
        except (urllib.error.URLError, TimeoutError):
            slowest = float("inf")
            break
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.1)
    thread.join()
    return result["reply"], slowest


def tool(name: str, parameters: dict | None = None) -> dict:
    fn: dict = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


# -- the chat template ---------------------------------------------------------------------------

def test_a_clients_chat_template_is_refused(http):
    body = chat(chat_template_kwargs={"chat_template": "{{ 'mine' }}"})
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == TEMPLATE_PARAM
    assert "--trust-request-chat-template" in error["message"]


@pytest.mark.timeout(60)
def test_a_nested_loop_template_does_not_freeze_the_server(http):
    body = chat(chat_template_kwargs={"chat_template": NESTED_LOOP})
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == \
        TEMPLATE_PARAM
    still_serving(http)


def _apply_chat_template_parameters() -> set[str]:
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return {p.name for p in params.values() if p.name != "self"
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"chat_template"}


@pytest.mark.parametrize("name", sorted(_apply_chat_template_parameters()))
def test_apply_chat_template_parameters_are_not_template_variables(http, name):
    value = {"tokenizer_kwargs": {}, "max_length": 4, "return_tensors": "np",
             "documents": [], "tools": [], "conversation": []}.get(name, True)
    body = chat(chat_template_kwargs={name: value})
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "chat_template_kwargs" and name in error["message"], error


def test_template_variables_still_reach_the_template(http):
    reply = http.post("/v1/chat/completions", json=chat(chat_template_kwargs={
        "enable_thinking": False}))
    assert reply.status_code == 200, reply.text


@pytest.mark.timeout(60)
def test_an_operators_template_with_a_syntax_error_fails_at_startup(tiny_chat_model):
    command = [sys.executable, "-m", "radixlm.runtime.server", "--model", str(tiny_chat_model),
               "--port", "0", "--chat-template", "{% if %}hello"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("the server started with a template that does not compile")
    assert done.returncode == 2, done.stderr
    assert "--chat-template is not a valid Jinja template: line 1" in done.stderr


@pytest.mark.timeout(120)
def test_a_trusted_or_model_template_is_bounded_in_time_memory_and_output(tiny_chat_model):
    """With --trust-request-chat-template (or a hostile model template) the template runs, in
    a worker process that is killed past its time; the HTTP process does not grow."""
    from transformers import AutoTokenizer

    from radixlm.runtime.protocol.fields import ApiError
    from radixlm.runtime.server.text_codec import TextCodec

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    expected = tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    codec = TextCodec(tokenizer, 1024, render_timeout=1.0)

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    async def run() -> None:
        assert await codec.render_chat(HI) == expected  # started, and renders as transformers
        before = rss()
        for template, code in ((NESTED_LOOP, "chat_template_timeout"),
                               (HUGE_STRING, None),
                               ("{% for x in range(100000) %}{{ 'xxxxxxxxxx' }}{% endfor %}",
                                "context_length_exceeded"),
                               ("{% if %}", "invalid_chat_template")):
            start = time.monotonic()
            with pytest.raises(ApiError) as caught:
                await codec.render_chat(HI, template=template)
            assert caught.value.status == 400 and caught.value.param == TEMPLATE_PARAM
            assert code is None or caught.value.code == code, caught.value.message
            assert time.monotonic() - start < 30
            # Meanwhile and after, the server's own template renders as before.
            assert await codec.render_chat(HI) == expected
        assert rss() - before < 50 << 20

    try:
        asyncio.run(asyncio.wait_for(run(), 100))
    finally:
        codec.close()


# -- tool schemas ----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_too_many_tools_are_refused_before_any_is_checked(http):
    many = [tool(f"f{i}", {"type": "object", "properties": {"a": {"type": "string"}}})
            for i in range(40_000)]
    reply, slowest = post_while_probing_health(http, chat(tools=many))
    assert "at most 128 tools" in error_of(reply, 400)["message"]
    assert slowest < 2.0


def test_tools_over_the_size_bound_are_refused(http):
    tools = [tool(f"f{i}", {"type": "object", "description": "x" * 20_000}) for i in range(60)]
    error = error_of(http.post("/v1/chat/completions", json=chat(tools=tools)), 400)
    assert error["param"] == "tools" and "characters of JSON" in error["message"]


@pytest.mark.timeout(60)
def test_a_slow_to_check_tool_schema_leaves_the_loop_free(http):
    slow = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
            "properties": {"x": {"enum": [{"k": i} for i in range(8000)]}}}
    reply, slowest = post_while_probing_health(http, chat(tools=[tool("slow", slow)]))
    error = error_of(reply, 400)
    assert error["param"] == "tools", error
    assert slowest < 2.0
    still_serving(http)


def test_deeply_nested_tool_parameters_are_a_400_like_response_format(http):
    nested: dict = {"type": "object"}
    for _ in range(200):
        nested = {"type": "object", "properties": {"a": nested}}
    error = error_of(http.post("/v1/chat/completions", json=chat(tools=[tool("deep", nested)])),
                     400)
    assert error["param"] == "tools[0].function.parameters", error
    assert "deeper than 64" in error["message"]
    # The same rule as response_format's schemas.
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                        "schema": nested}})
    assert "deeper than 64" in error_of(http.post("/v1/chat/completions", json=body),
                                        400)["message"]


def test_an_invalid_tool_schema_is_still_a_400_naming_it(http):
    tools = [tool("ok"), tool("bad", {"type": "object", "properties": {"a": {"type": 5}}})]
    error = error_of(http.post("/v1/chat/completions", json=chat(tools=tools)), 400)
    assert error["param"] == "tools[1].function.parameters", error
    assert "valid JSON Schema" in error["message"]
    assert json.dumps(error)  # a plain JSON answer
