"""The server against hostile clients, on a tiny random Llama (real SmolLM2 tokenizer): slow
connections, oversized requests, invalid Unicode, browser-sent POSTs, a stalled engine. Every
case is a clear 4xx (or a closed connection) and the server keeps serving everyone else."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time

import aiohttp
import pytest
from test_server import Http, error_of, sse

from radixlm.backends.server_process import ServerProcess

LIMITS = ["--max-total-tokens", "8192", "--keep-alive-timeout", "2", "--body-timeout", "2",
          "--max-samples-per-request", "64", "--max-running-requests", "4"]


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with ServerProcess(["--model", str(tiny_chat_model), *LIMITS]) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    return Http(server.url)


def still_serving(http: Http) -> None:
    reply = http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 2


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def answered_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the connection or going quiet for `seconds`;
    None if it neither answered nor closed."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return received or None
    return received


# -- slow clients (2) ----------------------------------------------------------------------------

@pytest.mark.parametrize("sent", [b"", b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le"])
def test_a_connection_that_never_completes_its_head_is_closed(server, http, sent):
    with connect(server) as sock:
        sock.sendall(sent)
        assert answered_within(sock, 10) is not None  # --keep-alive-timeout 2
    still_serving(http)


def test_a_body_that_never_arrives_is_a_408(server, http):
    head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"text\": ")
    with connect(server) as sock:
        sock.sendall(head)
        reply = answered_within(sock, 10)  # --body-timeout 2
    assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
    assert b"did not arrive within 2 s" in reply
    still_serving(http)


# -- request size bounds (3, 5, 6) ---------------------------------------------------------------

def test_prompts_times_n_is_bounded_per_request(http):
    body = {"text": ["a", "b", "c", "d", "e", "f", "g", "h"],
            "sampling_params": {"n": 9, "max_new_tokens": 1}}
    error = error_of(http.post("/generate", json=body), 400)
    assert error["code"] == "too_many_samples" and error["param"] == "n"
    assert "72 samples" in error["message"] and "at most 64" in error["message"]
    completions = {"model": "m", "prompt": ["x"] * 16, "n": 8, "max_tokens": 1}
    assert error_of(http.post("/v1/completions", json=completions), 400)["param"] == "n"
    score = {"prefix": "The sky is", "continuations": [" blue"] * 65}
    assert error_of(http.post("/score", json=score), 400)["param"] == "continuations"
    still_serving(http)


def test_text_too_long_for_any_tokenization_is_refused_untokenized(http):
    info = http.get("/get_model_info").json()
    huge = "ab " * (1 << 20)  # 3 MB: more than 8192 tokens of any length here could hold
    error = error_of(http.post("/generate", json={"text": huge}), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    chat = {"model": "m", "messages": [{"role": "user", "content": huge}]}
    assert error_of(http.post("/v1/chat/completions", json=chat), 400)["param"] == "messages"
    assert info["max_model_len"] <= 8192
    still_serving(http)


def test_stop_token_ids_are_bounded(http):
    body = {"text": "hi", "sampling_params": {"stop_token_ids": list(range(257))}}
    error = error_of(http.post("/generate", json=body), 400)
    assert error["param"] == "sampling_params.stop_token_ids" and "at most 256" in error["message"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "stop_token_ids": list(range(300))}
    assert error_of(http.post("/v1/chat/completions", json=chat), 400)["param"] == "stop_token_ids"


def test_a_schema_that_expands_exponentially_costs_the_http_process_nothing(server, http):
    # 1.7 KB of nested single-item arrays: as a regex it doubles per level.
    schema: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(40):
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    before = rss_bytes(server.proc.pid)
    reply = http.post("/generate", json={"text": "x", "sampling_params": {
        "json_schema": json.dumps(schema), "max_new_tokens": 400, "temperature": 0}})
    assert reply.status_code == 200, reply.text
    value = json.loads(reply.json()["text"])
    for _ in range(40):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert isinstance(value, int)
    assert rss_bytes(server.proc.pid) - before < 50 << 20
    still_serving(http)


def test_one_prompt_is_admitted_before_the_rest_of_a_large_batch(http):
    """Fair share: a batch's later prompts wait behind other clients' first ones."""
    done: dict[str, float] = {}

    def send(name: str, body: dict) -> None:
        assert http.post("/generate", json=body).status_code == 200
        done[name] = time.monotonic()

    batch = threading.Thread(target=send, args=("batch", {
        "text": [f"prompt {i}" for i in range(16)],  # four waves of four running
        "sampling_params": {"max_new_tokens": 50, "ignore_eos": True, "temperature": 0}}))
    batch.start()
    deadline = time.monotonic() + 30
    while http.get("/get_server_info").json()["stats"]["num_waiting"] == 0:
        assert time.monotonic() < deadline and batch.is_alive()
        time.sleep(0.01)
    send("single", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    batch.join()
    assert done["single"] < done["batch"]  # FCFS would run all 16 first


def test_the_fields_sglangs_frontend_sends_are_accepted(http):
    """RuntimeEndpoint.generate's sampling_params, as SGLang 0.5's frontend builds them."""
    sampling = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                "max_new_tokens": 4, "min_new_tokens": 0, "n": 1, "stop": [],
                "stop_token_ids": [], "stop_regex": [], "temperature": 0, "top_p": 1.0,
                "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "ignore_eos": True, "regex": None, "json_schema": None}
    reply = http.post("/generate", json={"text": "hi", "sampling_params": sampling})
    assert reply.status_code == 200, reply.text
    seeded = [http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 6, "temperature": 1.0, key: 11}}).json()["output_ids"]
        for key in ("seed", "sampling_seed")]
    assert seeded[0] == seeded[1]
    error = error_of(http.post("/generate", json={"text": "hi", "sampling_params": {
        "custom_params": {"a": 1}}}), 400)
    assert error["param"] == "sampling_params.custom_params" and error["code"] == "not_supported"
    assert error_of(http.post("/generate", json={"text": "hi", "sampling_params": {
        "made_up": 1}}), 400)["param"] == "sampling_params.made_up"


def test_stop_regex_ends_the_output_with_the_matching_token(http):
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = http.post("/generate", json={"text": "hi", "sampling_params": greedy}).json()
    tokens = full["output_ids"]
    # A pattern for the text of the 5th token's first character, after the 4th token.
    head = http.post("/generate", json={"text": "hi", "sampling_params": {
        **greedy, "max_new_tokens": 4}}).json()["text"]
    pattern = re.escape(head[-2:] + full["text"][len(head)])
    out = http.post("/generate", json={"text": "hi", "sampling_params": {
        **greedy, "stop_regex": pattern}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert full["text"].startswith(out["text"]) and re.search(pattern, out["text"])
    assert out["output_ids"] == tokens[:len(out["output_ids"])]
    assert not re.search(pattern, http.post("/generate", json={"text": "hi", "sampling_params": {
        **greedy, "max_new_tokens": len(out["output_ids"]) - 1}}).json()["text"])
    error = error_of(http.post("/generate", json={"text": "hi", "sampling_params": {
        "stop_regex": ["a(?=b)"]}}), 400)
    assert error["param"] == "sampling_params.stop_regex"


def test_sglangs_route_names_and_fork_join_route(http):
    assert http.get("/model_info").json() == http.get("/get_model_info").json()
    assert http.get("/model_info").json()["tokenizer_path"]
    assert set(http.get("/server_info").json()) == set(http.get("/get_server_info").json())
    reply = http.post("/concate_and_append_request", json={"src_rids": ["a", "b"],
                                                            "dst_rid": "c"})
    assert reply.status_code == 200 and reply.json()["success"] is True
    error = error_of(http.post("/concate_and_append_request", json={"src_rids": "a"}), 400)
    assert error["param"] == "src_rids"


def test_logit_bias_on_every_route(http):
    forced = 1234
    native = http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "logit_bias": {str(forced): 100}}}).json()
    assert native["output_ids"] == [forced, forced]
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "logit_bias": {str(forced): 100}}
    completion = http.post("/v1/completions", json=body)
    assert completion.status_code == 200, completion.text
    chat = http.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "logit_bias": {str(forced): 100}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 1
    error = error_of(http.post("/v1/completions", json={**body, "logit_bias": {"5": 500}}), 400)
    assert error["param"] == "logit_bias"
    error = error_of(http.post("/generate", json={"text": "hi", "sampling_params": {
        "logit_bias": {"99999999": 1}}}), 400)
    assert "outside the vocabulary" in error["message"]


# -- client errors that were 500s (8, 12) ------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/generate", '{"text": "hi", "rid": "a\\ud800"}', "rid"),
    ("/generate", '{"text": "hi", "sampling_params": {"regex": "[a-z]\\udc00"}}',
     "sampling_params.regex"),
    ("/v1/chat/completions",
     '{"model": "m", "messages": [{"role": "user", "content": "x\\ud800y"}]}',
     "messages[0].content"),
    ("/abort_request", '{"rid": "\\udfff"}', "rid"),
])
def test_lone_surrogates_are_a_400_naming_the_field(http, path, body, param):
    error = error_of(http.post(path, content=body), 400)
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_deeply_nested_schema_is_a_400_not_a_recursion_error(http):
    schema = '{"type": "array", "items": ' * 900 + "{}" + "}" * 900
    body = {"text": "x", "sampling_params": {"json_schema": schema}}
    error = error_of(http.post("/generate", json=body), 400)
    assert error["param"] == "sampling_params.json_schema", error


def test_a_paired_surrogate_escape_is_fine(http):
    reply = http.post("/generate", content='{"text": "smile \\ud83d\\ude00", '
                                           '"sampling_params": {"max_new_tokens": 1}}')
    assert reply.status_code == 200


def test_a_user_message_without_content_is_a_400(http):
    body = {"model": "m", "messages": [{"role": "user"}]}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages[0].content" and error["code"] == "missing_field"


# -- what a web page could send (9), what the info routes show (10) -----------------------------

@pytest.mark.parametrize("headers", [
    {"Content-Type": "text/plain"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"},
])
def test_post_bodies_must_be_json(http, headers):
    error = error_of(http.post("/generate", content='{"text": "hi"}', headers=headers), 415)
    assert error["code"] == "unsupported_media_type"


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:1"},  # another port of the same host is another origin
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
])
def test_cross_origin_posts_are_refused(http, headers):
    assert error_of(http.post("/flush_cache", content=b"", headers=headers), 403)["code"] == \
        "cross_origin"
    assert error_of(http.post("/generate", json={"text": "hi"}, headers=headers), 403)


def test_same_origin_and_plain_clients_pass(server, http):
    origin = server.url  # what a page served by this very server would send
    reply = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                      headers={"Origin": origin, "Sec-Fetch-Site": "same-origin"})
    assert reply.status_code == 200
    # A bodiless POST without Content-Type, as `curl -X POST $URL/flush_cache` sends it.
    assert http.request("POST", "/flush_cache").status_code == 200


def test_info_routes_show_no_machine_details(server, http):
    for path in ("/get_server_info", "/get_model_info"):
        info = http.get(path).json()
        assert "engine_pid" not in info and "model_folder" not in info


def test_every_request_has_an_access_line_with_its_tokens_or_its_error(server, http):
    rid = "access-log-probe"
    assert http.post("/generate", json={"text": "hi", "rid": rid, "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}}).status_code == 200
    assert http.post("/generate", json={"text": 7}).status_code == 400
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in server.log_text().splitlines() if "radixlm.access:" in line]
        ok = [line for line in lines if f"rid={rid}" in line]
        bad = [line for line in lines if " 400 " in line and "text must be" in line]
        if ok and bad:
            break
        time.sleep(0.1)
    assert ok and "POST /generate 200" in ok[0] and "completion=3" in ok[0], lines[-5:]
    assert bad, lines[-5:]
    assert not any("GET /health " in line for line in lines)  # polled: debug only


# -- /score: the queue and disconnects (7) -------------------------------------------------------

def test_score_is_aborted_when_its_client_leaves(server, http):
    """Four long streams hold every running slot (--max-running-requests 4), so the score's
    continuations wait; when its client leaves, they must leave the queue too."""
    async def run() -> dict:
        async with aiohttp.ClientSession() as session:
            streams = [await session.post(server.url + "/generate", json={
                "text": f"story {i}", "stream": True, "sampling_params": {
                    "max_new_tokens": 1000, "ignore_eos": True}}) for i in range(4)]
            for stream in streams:
                await stream.content.readline()  # running
            score = asyncio.ensure_future(session.post(server.url + "/score", json={
                "prefix": "Once", "continuations": [" and then"] * 32}))
            await asyncio.sleep(0.5)
            queued = http_get_info()
            score.cancel()  # the client leaves while its continuations wait
            deadline = time.monotonic() + 10
            while (info := http_get_info())["stats"]["num_waiting"] and \
                    time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for stream in streams:
                stream.close()
            return {"queued": queued, "after": info}

    def http_get_info() -> dict:
        return http.get("/get_server_info").json()

    seen = asyncio.run(run())
    assert seen["queued"]["stats"]["num_waiting"] == 32
    assert seen["queued"]["queue"]["in_flight"] == 4 + 32  # the score counts for the queue
    assert seen["after"]["stats"]["num_waiting"] == 0
    assert seen["after"]["stats"]["num_running"] > 0  # gone before the streams ended
    # The streams' aborts reach the engine after the HTTP side has let them go: wait for both.
    deadline = time.monotonic() + 30
    while ((info := http_get_info())["queue"]["in_flight"] or info["stats"]["num_running"]) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = info["stats"]
    assert info["queue"]["in_flight"] == 0 and stats["num_running"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    still_serving(http)


# -- memory (11) ---------------------------------------------------------------------------------

def test_memory_returns_after_a_storm_of_large_bad_requests(server, http):
    still_serving(http)
    idle = rss_bytes(server.proc.pid)
    bodies = [json.dumps({"input_ids": list(range(900_000)) + [10**9]}),  # one id out of range
              json.dumps({"text": ["x" * 1000] * 7000})]  # more prompts than allowed

    def storm(body: str) -> None:
        for _ in range(4):
            assert http.post("/generate", content=body).status_code == 400

    for body in bodies:  # ~6 MB each, 8 clients at once
        threads = [threading.Thread(target=storm, args=(body,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    bound = idle * 1.2 + (20 << 20)
    deadline = time.monotonic() + 10  # the trims after large requests run within seconds
    while rss_bytes(server.proc.pid) >= bound and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rss_bytes(server.proc.pid) < bound, (idle >> 20, rss_bytes(server.proc.pid) >> 20)
    still_serving(http)


# -- a stalled engine (4) -----------------------------------------------------------------------

def test_a_stalled_engine_fails_requests_turns_health_503_and_exits_1(tiny_chat_model):
    with ServerProcess(["--model", str(tiny_chat_model), "--max-total-tokens", "4096",
                        "--watchdog-timeout", "3"]) as proc:
        engine = proc.engine_pid()

        async def stream_while_stalling() -> str:
            async with aiohttp.ClientSession() as session:
                async with session.post(proc.url + "/generate", json={
                        "text": "once", "stream": True, "sampling_params": {
                            "max_new_tokens": 1000, "ignore_eos": True}}) as response:
                    await response.content.readline()  # the first token arrived
                    os.kill(engine, signal.SIGSTOP)
                    return (await response.read()).decode()

        try:
            text = asyncio.run(asyncio.wait_for(stream_while_stalling(), 60))
        finally:
            try:
                os.kill(engine, signal.SIGCONT)
            except ProcessLookupError:
                pass
        error = sse(text)[-1]["error"]
        assert error["type"] == "service_unavailable_error"
        assert "no progress" in error["message"]
        assert proc.proc.wait(30) == 1
        assert "the engine made no progress" in proc.log_text()


def test_health_says_when_the_engine_stalled():
    """Between the watchdog firing and the exit, /health answers 503 engine_stalled."""
    from aiohttp import web

    from radixlm.runtime.engine_process.messages import EngineInfo
    from radixlm.runtime.server.app import build_app
    from radixlm.runtime.server.args import ServerConfig
    from radixlm.runtime.server.state import ServerState
    from radixlm.runtime.server.text_codec import TextCodec

    class Stalled:
        alive, stalled, in_flight = False, True, 0

    state = ServerState(config=ServerConfig(), engine=Stalled(), codec=TextCodec(None),
                        model_name="stub", model_path=None)
    state.info = EngineInfo(max_model_len=16, vocab_size=16, architecture="Llama",
                            eos_token_ids=[2], config={})

    async def run() -> tuple[int, dict]:
        runner = web.AppRunner(build_app(state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    return response.status, await response.json()
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == (503, {"status": "engine_stalled"})
