"""The HTTP server on a tiny random Llama (real SmolLM2 tokenizer): native routes, the official
openai client, streaming, 200 concurrent requests against the offline engine, bad input,
auth, body limits and client disconnects. One server for the module, on a free port."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import openai
import pytest

from radixlm.backends.server_process import ServerProcess
from radixlm.runtime import Engine
from radixlm.runtime.engine.tokenization import encode_prompt

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
POOL = ["--max-total-tokens", "16384", "--page-size", "16"]
PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4", "def f(x):\n    return",
           "Les sanglots longs", "你好，世界", "Question: two plus two?\nAnswer:", "A" * 40]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    args = ["--model", str(tiny_chat_model), *POOL, "--api-key", KEY,
            "--max-request-bytes", str(1 << 20)]
    with ServerProcess(args) as proc:
        yield proc


class Reply:
    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.text = body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.text)


class Http:
    """A small synchronous client (standard library only)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers or {}

    def request(self, method: str, path: str, json_body: Any = None, content: Any = None,
                headers: dict[str, str] | None = None) -> Reply:
        data = json.dumps(json_body).encode() if json_body is not None else content
        if isinstance(data, str):
            data = data.encode()
        # urllib would send form encoding; the server takes JSON only (415 otherwise).
        kind = {"Content-Type": "application/json"} if data is not None else {}
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={**kind, **self.headers, **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return Reply(response.status, response.headers, response.read())
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, exc.headers, exc.read())

    def get(self, path: str, headers: dict[str, str] | None = None) -> Reply:
        return self.request("GET", path, headers=headers)

    def post(self, path: str, json: Any = None, content: Any = None,
             headers: dict[str, str] | None = None) -> Reply:
        return self.request("POST", path, json, content, headers)


@pytest.fixture(scope="module")
def http(server):
    return Http(server.url, AUTH)


@pytest.fixture(scope="module")
def offline(tiny_chat_model):
    with Engine(str(tiny_chat_model), max_total_tokens=16384, page_size=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def stats(http) -> dict:
    return http.get("/get_server_info").json()["stats"]


def wait_idle_and_check_no_leak(http, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(http)
        if s["num_running"] == s["num_waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"]
    assert http.get("/get_server_info").json()["queue"]["in_flight"] == 0
    return s


def sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- info and native generation ---------------------------------------------------------------

def test_health_info_and_models(server, http, offline):
    assert Http(server.url).get("/health").json() == {"status": "ok"}  # no key needed
    info = http.get("/get_model_info").json()
    assert info["architecture"] == "LlamaForCausalLM" and info["vocab_size"] == 49152
    assert info["max_model_len"] == offline.max_model_len and info["has_chat_template"]
    assert info["bos_token"] == offline.tokenizer.bos_token and 2 in info["eos_token_ids"]
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == info["served_model_name"]
    name = info["served_model_name"]
    assert http.get(f"/v1/models/{name}").json() == models["data"][0]
    missing = error_of(http.get("/v1/models/no-such-model"), 404)
    assert missing["code"] == "model_not_found"
    server_info = http.get("/get_server_info").json()
    assert server_info["engine_config"]["max_total_tokens"] == 16384
    assert "api_key" not in server_info["server_config"]
    assert http.get("/health_generate").json() == {"status": "ok"}


def test_generate_matches_offline_engine(http, offline):
    out = http.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    ref = offline.generate(PROMPTS[0], GREEDY)
    assert out["output_ids"] == ref.token_ids and out["text"] == ref.text
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == ref.prompt_tokens and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    # A batch of texts, token ids, and n > 1 each return a list.
    batch = http.post("/generate", json={"text": PROMPTS[:3], "sampling_params": GREEDY,
                                         "rid": ["a", "b", "c"]}).json()
    assert [b["meta_info"]["id"] for b in batch] == ["a", "b", "c"]
    assert [b["output_ids"] for b in batch] == [
        o.token_ids for o in offline.generate(PROMPTS[:3], GREEDY)]
    ids = encode_prompt(offline.tokenizer, PROMPTS[1])
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == batch[1]["output_ids"]
    two = http.post("/generate", json={"text": PROMPTS[2], "sampling_params": {
        **GREEDY, "n": 2}}).json()
    assert len(two) == 2 and two[0]["output_ids"] == two[1]["output_ids"]


def test_stop_reasons_in_sglang_shape(http, offline):
    ref = offline.generate(PROMPTS[3], GREEDY)
    token = ref.token_ids[2]
    out = http.post("/generate", json={"text": PROMPTS[3], "sampling_params": {
        **GREEDY, "stop_token_ids": [token]}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}


def test_generate_logprobs(http, offline):
    body = {"text": PROMPTS[3], "sampling_params": {**GREEDY, "max_new_tokens": 4},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True}
    meta = http.post("/generate", json=body).json()["meta_info"]
    ref = offline.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 4, "logprobs": True,
                                        "top_logprobs_num": 2, "logprob_start_len": 0})
    assert [e[1] for e in meta["output_token_logprobs"]] == ref.token_ids
    for got, want in zip(meta["output_token_logprobs"], ref.logprobs):
        assert got[0] == pytest.approx(want.logprob, abs=1e-4)
        assert got[2] == offline.tokenizer.decode([want.token_id])
    assert [len(t) for t in meta["output_top_logprobs"]] == [2] * 4
    prompt = meta["input_token_logprobs"]
    assert len(prompt) == ref.prompt_tokens and prompt[0][0] is None
    assert prompt[1][0] == pytest.approx(ref.prompt_logprobs[1].logprob, abs=1e-4)


def test_streamed_logprobs_come_once_each(http):
    """SGLang's streaming shape: each event carries the logprobs of its new tokens, and the
    running count as `output_token_logprobs_length` (= completion_tokens)."""
    body = {"text": PROMPTS[3], "sampling_params": {**GREEDY, "max_new_tokens": 6},
            "return_logprob": True, "logprob_start_len": 0}
    whole = http.post("/generate", json=body).json()["meta_info"]
    assert whole["output_token_logprobs_length"] == 6
    events = sse(http.post("/generate", json={**body, "stream": True}).text)
    streamed, sent, prompt_events = [], 0, 0
    for event in events:
        meta = event["meta_info"]
        new = meta["output_token_logprobs"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == sent + len(new)
        prompt_events += "input_token_logprobs" in meta
        streamed += new
        sent += len(new)
    assert streamed == whole["output_token_logprobs"] and prompt_events == 1


def test_native_stream_equals_non_stream(http):
    body = {"text": PROMPTS[5], "sampling_params": {**GREEDY, "max_new_tokens": 12}}
    whole = http.post("/generate", json=body).json()
    events = sse(http.post("/generate", json={**body, "stream": True}).text)
    assert events[-1]["text"] == whole["text"]
    assert events[-1]["output_ids"] == whole["output_ids"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    # Each event holds the whole text so far (SGLang's shape).
    assert all(whole["text"].startswith(e["text"]) for e in events)


def test_abort_request_and_flush_cache(server, http):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            body = {"text": PROMPTS[0], "rid": "to-abort", "stream": True,
                    "sampling_params": {**GREEDY, "max_new_tokens": 800}}
            async with session.post(server.url + "/generate", json=body) as response:
                events = []
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 2:
                            abort = await session.post(server.url + "/abort_request",
                                                       json={"rid": "to-abort"})
                            assert (await abort.json())["aborted"] is True
                return events

    events = asyncio.run(run())
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 800
    wait_idle_and_check_no_leak(http)
    assert http.post("/abort_request", json={"rid": "unknown"}).json()["aborted"] is False
    assert http.post("/flush_cache").json() == {"flushed": True}
    s = stats(http)
    assert s["kv_pages_free"] == s["kv_pages_total"]


# -- program-language routes ------------------------------------------------------------------

def test_pin_release_score_and_chat_template(http, offline):
    prefix = "You are a careful assistant. " * 8  # several pages
    lease = http.post("/pin_prefix", json={"text": prefix, "ttl": 60}).json()["lease_id"]
    assert isinstance(lease, str)
    assert stats(http)["leases"] == 1
    assert http.post("/release_prefix", json={"lease_id": lease}).json() == {"released": True}
    assert http.post("/release_prefix", json={"lease_id": lease}).json() == {"released": False}
    assert stats(http)["leases"] == 0
    short = http.post("/pin_prefix", json={"input_ids": [5, 6, 7]}).json()
    assert short == {"lease_id": None}  # shorter than a page: nothing to pin

    choices = [" yes", " no, never"]
    got = http.post("/score", json={"prefix": prefix, "continuations": choices}).json()
    tok = offline.tokenizer
    want = offline.score(encode_prompt(tok, prefix),
                         [tok.encode(c, add_special_tokens=False) for c in choices])
    assert [len(g) for g in got["logprobs"]] == [len(w) for w in want]
    for g, w in zip(got["logprobs"], want):
        assert g == pytest.approx(w, abs=1e-4)
    by_ids = http.post("/score", json={"prefix_ids": encode_prompt(tok, prefix),
                                       "continuation_ids": [[9, 10]]}).json()
    assert len(by_ids["logprobs"][0]) == 2

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = http.post("/apply_chat_template", json={"messages": messages}).json()["text"]
    assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bare = http.post("/apply_chat_template", json={"messages": messages,
                                                   "add_generation_prompt": False}).json()
    assert text.startswith(bare["text"]) and len(bare["text"]) < len(text)
    wait_idle_and_check_no_leak(http)


# -- the official openai client ---------------------------------------------------------------

def test_openai_chat_completion_and_streaming(client, offline):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=10,
                                          temperature=0)
    ref = offline.chat(messages, {"temperature": 0, "max_new_tokens": 10})
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == ref.prompt_tokens
    assert chat.usage.completion_tokens == ref.completion_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0

    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == ref.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    # The second identical request is served (partly) from the prefix cache.
    again = client.chat.completions.create(model="any", messages=messages, max_tokens=2,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_openai_completion_echo_scores_the_prompt(client, http):
    """echo: the prompt's text and logprobs before the completion's (max_tokens 0: the prompt
    alone, how evaluation harnesses ask for a text's likelihood)."""
    scored = client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=0,
                                       echo=True, logprobs=2, temperature=0)
    choice, logprobs = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == PROMPTS[0] and scored.usage.completion_tokens == 0
    native = http.post("/generate", json={
        "text": PROMPTS[0], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2}).json()["meta_info"]
    assert logprobs.token_logprobs == [lp for lp, _, _ in native["input_token_logprobs"]]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert "".join(logprobs.tokens) == PROMPTS[0]
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i]))
                                    for i in range(len(logprobs.tokens))]
    again = client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=0,
                                      echo=True, logprobs=2, temperature=0)
    assert again.choices[0].logprobs.token_logprobs == logprobs.token_logprobs  # cached prefix

    plain = client.completions.create(model="any", prompt=PROMPTS[4], max_tokens=6,
                                      temperature=0, logprobs=1)
    echoed = client.completions.create(model="any", prompt=PROMPTS[4], max_tokens=6,
                                       temperature=0, logprobs=1, echo=True)
    prompt_tokens = echoed.usage.prompt_tokens
    assert echoed.choices[0].text == PROMPTS[4] + plain.choices[0].text
    assert (echoed.choices[0].logprobs.token_logprobs[prompt_tokens:]
            == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4))
    assert len(echoed.choices[0].logprobs.tokens) == prompt_tokens + 6

    ids = http.post("/generate", json={"text": PROMPTS[1], "sampling_params": {
        "max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}).json()
    prompt_ids = [t for _, t, _ in ids["meta_info"]["input_token_logprobs"]]
    from_ids = client.completions.create(model="any", prompt=prompt_ids, max_tokens=3,
                                         temperature=0, echo=True)
    streamed = [c.choices[0].text for c in client.completions.create(
        model="any", prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, stream=True)
        if c.choices]
    assert streamed[0] == PROMPTS[1]  # the prompt comes first
    assert "".join(streamed) == from_ids.choices[0].text
    assert from_ids.choices[0].text.startswith(PROMPTS[1])


def test_tokenize_and_detokenize(client, http):
    """vLLM's token routes: the ids a generation runs, their texts, and back."""
    reply = http.post("/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()
    native = http.post("/generate", json={"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}).json()
    assert reply["tokens"] == [t for _, t, _ in native["meta_info"]["input_token_logprobs"]]
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] > 0
    assert "".join(reply["token_strs"]) == PROMPTS[0]
    assert http.post("/detokenize", json={"tokens": reply["tokens"]}).json() == {
        "prompt": PROMPTS[0]}
    plain = http.post("/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False})
    assert plain.json()["token_strs"] is None and plain.json()["count"] >= 1

    messages = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    used = client.chat.completions.create(model="any", messages=messages, max_tokens=1)
    assert chat["count"] == used.usage.prompt_tokens
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()
    used = client.chat.completions.create(model="any", messages=messages, max_tokens=1,
                                          tools=tools)
    assert with_tools["count"] == used.usage.prompt_tokens
    open_turn = http.post("/tokenize", json={"messages": messages,
                                             "add_generation_prompt": False}).json()
    assert open_turn["count"] < chat["count"]
    assert open_turn["tokens"] == chat["tokens"][:open_turn["count"]]


def test_openai_completion_n_logprobs_and_stop(client, offline):
    out = client.completions.create(model="any", prompt=PROMPTS[4], max_tokens=6,
                                    temperature=0, logprobs=3)
    ref = offline.generate(PROMPTS[4], {"temperature": 0, "max_new_tokens": 6,
                                        "logprobs": True, "top_logprobs_num": 3})
    choice = out.choices[0]
    assert choice.text == ref.text
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs],
                                                           abs=1e-4)
    assert all(len(t) <= 3 for t in choice.logprobs.top_logprobs)

    two = client.completions.create(model="any", prompt=PROMPTS[4], max_tokens=6, n=2,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens == 12 and two.choices[0].text != two.choices[1].text

    stop = ref.text[3:7]
    stopped = client.completions.create(model="any", prompt=PROMPTS[4], max_tokens=6,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == ref.text[:ref.text.index(stop)]

    chat = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, n=2)
    assert len(chat.choices) == 2
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_openai_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model="any", prompt=PROMPTS[6], max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **kwargs, stream=True) if c.choices)
    assert streamed == whole


# -- concurrency ------------------------------------------------------------------------------

def test_200_concurrent_requests(server, http, offline):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(200)]
    want = offline.generate(prompts, GREEDY)
    health_latencies: list[float] = []

    async def one(session: aiohttp.ClientSession, i: int) -> list[int]:
        if i % 2:
            body = {"text": prompts[i], "sampling_params": GREEDY}
            async with session.post(server.url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["output_ids"]
        body = {"model": "m", "prompt": prompts[i], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stream": i % 4 == 0}
        async with session.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            text = await r.text()
        if body["stream"]:
            text = "".join(e["choices"][0]["text"] for e in sse(text) if e["choices"])
        else:
            text = json.loads(text)["choices"][0]["text"]
        return text  # compared as text: the OpenAI shape has no token ids

    async def watch_health(session: aiohttp.ClientSession, done: asyncio.Event) -> None:
        while not done.is_set():
            start = time.perf_counter()
            async with session.get(server.url + "/health") as r:
                assert r.status == 200
            health_latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)

    async def run() -> list:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(headers=AUTH, connector=connector,
                                         timeout=timeout) as session:
            done = asyncio.Event()
            watcher = asyncio.create_task(watch_health(session, done))
            results = await asyncio.gather(*(one(session, i) for i in range(200)))
            done.set()
            await watcher
            return results

    results = asyncio.run(run())
    for i, got in enumerate(results):
        assert got == (want[i].token_ids if i % 2 else want[i].text), f"request {i}"
    # /health stays fast while 200 requests are in flight (the loop is never blocked).
    assert len(health_latencies) >= 5
    assert statistics.median(health_latencies) < 0.1, health_latencies
    assert max(health_latencies) < 1.0, health_latencies
    wait_idle_and_check_no_leak(http)


# -- bad input --------------------------------------------------------------------------------

def error_of(response: Reply, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}},
     "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 2}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/generate", {"text": "hi", "bogus": 1}, "bogus"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"input_ids": [1, 10**9]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 100000}}, "sampling_params.n"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": -1}}, "sampling_params.seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "top_k": "x"}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                   "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs.chat_template"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, "stream_options"),
    ("/pin_prefix", {"text": "hi", "ttl": -1}, "ttl"),
    ("/score", {"prefix": "hi", "continuations": []}, "continuations"),
    ("/release_prefix", {}, "lease_id"),
])
def test_bad_fields_are_400_naming_the_field(http, path, body, param):
    assert error_of(http.post(path, json=body), 400)["param"] == param


def test_vllm_and_sglang_structured_output_fields(http):
    chat = {"messages": [{"role": "user", "content": "Pick."}], "max_tokens": 40,
            "temperature": 1.0, "seed": 5}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}

    def text(extra):
        reply = http.post("/v1/chat/completions", json={**chat, **extra})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    assert text({"guided_choice": ["red", "green"]}) in ("red", "green")
    assert re.fullmatch("[ab]{3}", text({"guided_regex": "[ab]{3}"}))
    assert text({"guided_grammar": 'start: "yes" | "no"'}) in ("yes", "no")
    for field in ("guided_json", "json_schema"):
        assert set(json.loads(text({field: schema}))) == {"n"}
    both = error_of(http.post("/v1/chat/completions", json={
        **chat, "guided_regex": "a", "guided_choice": ["b"]}), 400)
    assert "at most one" in both["message"]


def test_response_format_is_passed_on_or_refused_never_ignored(http):
    import dataclasses

    from radixlm.runtime.config.sampling_params import SamplingParams

    supported = "json_schema" in {f.name for f in dataclasses.fields(SamplingParams)}
    chat = {"messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 4}
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"type": "integer"}}}}}):
        response = http.post("/v1/chat/completions", json={**chat, "response_format": fmt})
        if supported:
            assert response.status_code == 200, response.text
        else:
            assert error_of(response, 400)["param"] == "response_format"
    plain = http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}})
    assert plain.status_code == 200


def test_grammars_on_native_and_openai_routes(http, client):
    yes_no = 'root ::= "yes" | "no"'  # GBNF; Lark syntax works too
    body = {"text": "Answer:", "sampling_params": {"ebnf": yes_no, "temperature": 0}}
    reply = http.post("/generate", json=body)
    assert reply.status_code == 200 and reply.json()["text"] in ("yes", "no")
    out = client.completions.create(model="m", prompt="Answer:", max_tokens=8,
                                    extra_body={"ebnf": 'start: "maybe" | "sure"'})
    assert out.choices[0].text in ("maybe", "sure")
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Pick"}], max_tokens=8,
        extra_body={"regex": "(red|blue)"})
    assert chat.choices[0].message.content in ("red", "blue")


@pytest.mark.parametrize("stream", [False, True])
def test_grammars_that_cannot_compile_are_400_naming_the_field(http, stream):
    bad_grammars = [({"regex": "(unclosed"}, "regex"),
                    ({"ebnf": "start: (unclosed"}, "ebnf"),
                    ({"json_schema": {"type": "object", "properties": {
                        "a": {"not": {"type": "string"}}}}}, "json_schema")]
    for fields, param in bad_grammars:
        body = {"text": "x", "stream": stream, "sampling_params": {**fields, "max_new_tokens": 4}}
        error = error_of(http.post("/generate", json=body), 400)
        assert error["param"] == param and error["message"].startswith(param)
        assert error["code"] == "invalid_grammar"
    error = error_of(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "format": "uri-template"}}}}), 400)
    assert "uri-template" in error["message"]
    wait_idle_and_check_no_leak(http)


def test_strict_false_approximates_and_reports_what_it_left_out(http, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 3}}}}
    body = {"text": "x", "sampling_params": {"json_schema": schema, "json_schema_strict": False,
                                             "max_new_tokens": 8}}
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert any("'not' at /properties/a" in w for w in meta["grammar_warnings"])
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}}
    reply = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "response_format": fmt})
    assert reply.status_code == 200, reply.text
    assert "'not' at /properties/a" in reply.json()["choices"][0]["grammar_warnings"][0]
    fmt["json_schema"]["strict"] = True
    error = error_of(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
        "response_format": fmt}), 400)
    assert error["code"] == "invalid_grammar"


def test_the_sdk_fields_clients_send_routinely_are_accepted(client):
    """Fields the OpenAI SDK and agent frameworks send that change nothing here are checked
    and ignored; one that would change the output is refused by name."""
    messages = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(
        model="m", messages=messages, max_tokens=2, store=False, metadata={"run": "7"},
        service_tier="auto", reasoning_effort="low", user="u1",
        prediction={"type": "content", "content": "Hello"}, modalities=["text"],
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"})
    assert out.choices[0].message.content is not None
    text = client.completions.create(model="m", prompt="Hi", max_tokens=2, user="u1",
                                     extra_body={"store": True, "service_tier": "auto"})
    assert text.choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match="modalities"):
        client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                       modalities=["text", "audio"])
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.chat.completions.create(model="m", messages=messages, max_tokens=2,
                                       metadata={"k": 1})


def test_malformed_json_nan_and_non_objects_are_400(http):
    for raw in (b"{not json", b"[1, 2]", b'{"text": "hi", "sampling_params": '
                b'{"temperature": NaN}}', b'{"text": "hi", "sampling_params": '
                b'{"temperature": 1e999}}', b"\xff\xfe", b"[" * 100000 + b"]" * 100000):
        error = error_of(http.post("/generate", content=raw), 400)
        assert error["type"] == "invalid_request_error"


def test_context_overflow_is_400(http, offline):
    limit = offline.max_model_len
    error = error_of(http.post("/v1/completions", json={
        "prompt": "hello", "max_tokens": limit}), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    error = error_of(http.post("/generate", json={"input_ids": [5] * limit}), 400)
    assert error["param"] == "input_ids"
    long_chat = [{"role": "user", "content": "word " * limit}]
    error = error_of(http.post("/v1/chat/completions", json={"messages": long_chat}), 400)
    assert error["param"] == "messages"
    # A minimum that cannot fit is refused by name on every route, never cut.
    chat = [{"role": "user", "content": "hi"}]
    error = error_of(http.post("/v1/chat/completions", json={
        "messages": chat, "min_tokens": limit}), 400)
    assert error["param"] == "min_tokens" and error["code"] == "context_length_exceeded"
    error = error_of(http.post("/generate", json={"input_ids": [5] * (limit - 8),
                                                  "sampling_params": {"min_new_tokens": 9}}),
                     400)
    assert error["param"] == "sampling_params.min_new_tokens"
    # Without max_tokens the completion just gets what room is left.
    ok = http.post("/generate", json={"input_ids": [5] * (limit - 3),
                                      "sampling_params": {"ignore_eos": True}})
    assert ok.json()["meta_info"]["completion_tokens"] == 3


def test_big_tokenization_does_not_stall_the_server(server, http):
    """Eight 80k-character prompts (just under what 1024 tokens of this vocabulary could
    hold, so they are tokenized) take a while; /health must not wait for them. A 900 kB
    prompt is refused before tokenization."""
    error = error_of(http.post("/generate", json={
        "text": "The quick brown fox jumps over the lazy dog. " * 20000}), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    text = "The quick brown fox jumps over the lazy dog. " * 1800

    async def run() -> tuple[list[int], list[float]]:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            big = asyncio.gather(*(session.post(server.url + "/generate", json={"text": text})
                                   for _ in range(8)))
            latencies = []
            while not big.done():
                start = time.perf_counter()
                async with session.get(server.url + "/health") as r:
                    assert r.status == 200
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.01)
            return [r.status for r in await big], latencies

    statuses, latencies = asyncio.run(run())
    assert statuses == [400] * 8  # beyond the context, found once tokenized
    assert len(latencies) >= 3 and max(latencies) < 0.25, latencies


def test_body_over_the_limit_is_413(http):
    big = json.dumps({"text": "x" * (2 << 20)})
    error = error_of(http.post("/generate", content=big), 413)
    assert "limit" in error["message"]


def test_api_key_is_required_except_for_health(server):
    anonymous = Http(server.url)
    assert anonymous.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = anonymous.post("/generate", json={"text": "hi"}, headers=headers)
        assert error_of(r, 401)["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert anonymous.get("/metrics", headers=headers).status_code == 401
    bad_client = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_unknown_route_is_404_in_the_same_shape(http):
    assert error_of(http.get("/nope"), 404)["code"] == "not_found"
    # An OpenAI client whose base_url lacks /v1 is told so.
    assert "/v1/chat/completions" in error_of(http.post("/chat/completions", json={}),
                                              404)["message"]
    assert error_of(http.get("/generate"), 405)["code"] == "method_not_allowed"


# -- disconnects ------------------------------------------------------------------------------

def test_client_disconnect_aborts_and_frees_kv(server, http):
    long = {**GREEDY, "max_new_tokens": 900}
    before = stats(http)["generated_tokens"]

    async def run() -> None:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            # Mid-stream: read two events, then drop the connection.
            response = await session.post(server.url + "/generate", json={
                "text": PROMPTS[0], "stream": True, "sampling_params": long})
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data: {")
                if seen == 2:
                    break
            response.close()
            # Mid-request (no stream): give up while the engine works on it.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(session.post(server.url + "/v1/completions", json={
                    "prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": True}), 0.5)

    asyncio.run(run())
    s = wait_idle_and_check_no_leak(http)
    assert s["generated_tokens"] - before < 2 * 900  # both stopped early


def test_metrics(http, server):
    text = http.get("/metrics").text
    for name in ("radixlm_requests_total", "radixlm_prompt_tokens_total",
                 "radixlm_generation_tokens_total", "radixlm_cached_tokens_total",
                 "radixlm_time_to_first_token_seconds_bucket",
                 "radixlm_inter_token_latency_seconds_bucket", "radixlm_num_waiting_requests",
                 "radixlm_kv_cache_usage_ratio", "radixlm_prefix_cache_hit_rate",
                 "radixlm_request_queue_time_seconds_bucket",
                 "radixlm_request_prefill_time_seconds_bucket",
                 "radixlm_request_decode_time_seconds_bucket", "radixlm_num_preemptions_total",
                 "radixlm_samples_finished_total", "radixlm_grammar_compile_seconds_total",
                 "radixlm_spec_decode_acceptance_rate", "radixlm_engine_steps_total",
                 "radixlm_engine_graph_steps_total"):
        assert name in text, name
    model = http.get("/get_model_info").json()["served_model_name"]
    assert (f'radixlm_requests_total{{model_name="{model}",route="/generate",status="200"}}'
            in text)
    assert 'status="400"' in text and 'status="401"' in text
    assert "_created" not in text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all(f'model_name="{model}"' in line for line in samples)
    decode = next(line for line in samples
                  if line.startswith("radixlm_request_decode_time_seconds_count"))
    assert float(decode.split()[-1]) > 100
    steps = next(line for line in samples if line.startswith("radixlm_engine_steps_total"))
    assert float(steps.split()[-1]) > 100
    ttft_count = next(line for line in text.splitlines()
                      if line.startswith("radixlm_time_to_first_token_seconds_count"))
    assert float(ttft_count.split()[-1]) > 200


def test_engine_process_dies_with_the_server(server, http):
    """Last in the module: SIGKILL the HTTP process; the engine process must not outlive it."""
    engine_pid = server.engine_pid()
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running(engine_pid):
        time.sleep(0.1)
    assert not running(engine_pid), f"engine process {engine_pid} outlived the server"


def running(pid: int) -> bool:
    """Alive and not a zombie (an exited child nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
