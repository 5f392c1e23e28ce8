"""The server with the real default model, started through the `radixlm serve` console script:
real text through the openai client, a full queue, and SIGTERM (drain, then abort, exit 0).
Also, in process: an exception in one request is a 500 for it alone; the generated flags."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from test_server import Http, running

from radixlm.backends.server_process import ServerProcess
from radixlm.runtime.config.engine_config import EngineConfig

KEY = "lifecycle-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True}


def radixlm_command() -> list[str]:
    script = Path(sys.executable).parent / "radixlm"
    found = str(script) if script.exists() else shutil.which("radixlm")
    assert found, "the radixlm console script is not installed"
    return [found, "serve"]


@pytest.fixture(scope="module")
def server(default_model_folder):
    # Two running requests and one waiting at most; 6 s for in-flight work after SIGTERM.
    args = ["--max-total-tokens", "8192", "--max-running-requests", "2",
            "--max-queued-requests", "1", "--shutdown-timeout", "6", "--api-key", KEY]
    with ServerProcess(args, command=radixlm_command()) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    return Http(server.url, AUTH)


def test_real_text_through_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    assert chat.model == "smollm2-135m-instruct"
    text = client.completions.create(model="x", prompt="The capital of France is",
                                     max_tokens=6, temperature=0).choices[0].text
    assert "Paris" in text
    stopped = client.chat.completions.create(
        model="x", temperature=0, max_tokens=48, stop=["."],
        messages=[{"role": "user", "content": "Describe Paris in two sentences."}])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content and "." not in stopped.choices[0].message.content


def test_response_format_json_schema(server):
    import dataclasses

    from radixlm.runtime.config.sampling_params import SamplingParams

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    kwargs = dict(model="x", temperature=0, max_tokens=48, messages=[
        {"role": "user", "content": "Describe a person as JSON with a name and an age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    if "json_schema" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        with pytest.raises(openai.BadRequestError):  # refused, never silently ignored
            client.chat.completions.create(**kwargs)
        return
    person = json.loads(client.chat.completions.create(**kwargs).choices[0].message.content)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)


async def _stream(session: aiohttp.ClientSession, url: str, params: dict,
                  started: asyncio.Event | None = None) -> dict:
    """Run a native streaming request; its last event."""
    last: dict = {}
    async with session.post(url + "/generate", json={
            "text": "Count slowly:", "stream": True, "sampling_params": params}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                last = json.loads(line[6:])
                if started is not None:
                    started.set()
    return last


def test_full_queue_is_503_with_retry_after(server, http):
    async def run() -> None:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            tasks = [asyncio.create_task(_stream(session, server.url, LONG)) for _ in range(3)]
            deadline = time.monotonic() + 30
            while http.get("/get_server_info").json()["queue"]["in_flight"] < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            async with session.post(server.url + "/v1/completions", json={
                    "prompt": "hi", "max_tokens": 2}) as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["code"] == "queue_full"
            for task in tasks:  # the clients leave; their requests are aborted
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while http.get("/get_server_info").json()["queue"]["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stats = http.get("/get_server_info").json()["stats"]
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_sigterm_finishes_short_work_aborts_long_work_and_exits_0(server, http):
    """Last in the module: it stops the server."""
    engine_pid = server.engine_pid()

    async def run() -> tuple[dict, dict, float]:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            started = [asyncio.Event(), asyncio.Event()]
            short = asyncio.create_task(_stream(session, server.url, {
                "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}, started[0]))
            long = asyncio.create_task(_stream(session, server.url, LONG, started[1]))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            sent = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            # New work is refused: the port is closed (or, on a kept-alive connection, 503).
            with pytest.raises(aiohttp.ClientError):
                async with aiohttp.ClientSession(headers=AUTH) as fresh:
                    async with fresh.post(server.url + "/generate",
                                          json={"text": "hi"}) as response:
                        assert response.status == 503
                        raise aiohttp.ClientError("refused with 503")
            return await short, await long, sent

    short, long, sent = asyncio.run(run())
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    assert long["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.proc.wait(30) == 0
    assert time.monotonic() - sent < 20
    assert not running(engine_pid)


def test_engine_crash_fails_requests_and_stops_the_server(tiny_chat_model):
    """If the engine process dies, in-flight requests fail with a message and the server
    exits with code 1 (for a supervisor to restart it), rather than hanging."""
    with ServerProcess(["--model", str(tiny_chat_model), "--max-total-tokens", "4096"]) as proc:
        engine_pid = proc.engine_pid()

        async def run() -> dict:
            async with aiohttp.ClientSession() as session:
                started = asyncio.Event()
                stream = asyncio.create_task(_stream(session, proc.url, {
                    **LONG, "max_new_tokens": 1000}, started))
                await asyncio.wait_for(started.wait(), 60)
                os.kill(engine_pid, signal.SIGKILL)
                return await asyncio.wait_for(stream, 30)

        last = asyncio.run(run())
        assert last["error"]["type"] == "internal_server_error"
        assert "engine process exited" in last["error"]["message"]
        assert proc.proc.wait(30) == 1


# -- in process -------------------------------------------------------------------------------

class _StubEngine:
    """Answers every request at once with one token; stands in for the engine process."""

    alive = True
    in_flight = 0

    def is_tracked(self, key: str) -> bool:
        return False

    def submit(self, key, input_ids, params, cache_salt, sink, group=None, rank=0,
               tags=None) -> None:
        from radixlm.runtime.engine_process.messages import Chunk

        sink.put_nowait((key, Chunk(index=0, delta="ok", token_ids=[7], logprobs=None,
                                    time=time.monotonic(), finish_reason="length",
                                    prompt_tokens=len(input_ids), text="ok",
                                    completion_tokens=1)))

    def detach(self, key: str) -> None:
        pass


def test_an_exception_in_one_request_is_a_500_for_it_alone(tiny_chat_model):
    from aiohttp import web
    from transformers import AutoTokenizer

    from radixlm.runtime.engine_process.messages import EngineInfo
    from radixlm.runtime.server.app import build_app
    from radixlm.runtime.server.args import ServerConfig
    from radixlm.runtime.server.state import ServerState
    from radixlm.runtime.server.text_codec import TextCodec

    class Exploding(TextCodec):
        async def encode_prompt(self, text: str, param: str) -> list[int]:
            if text == "boom":
                raise RuntimeError("kaboom")
            return await super().encode_prompt(text, param)

    state = ServerState(config=ServerConfig(), engine=_StubEngine(),
                        codec=Exploding(AutoTokenizer.from_pretrained(str(tiny_chat_model))),
                        model_name="stub", model_path=None)
    state.info = EngineInfo(max_model_len=1024, vocab_size=49152, architecture="Llama",
                            eos_token_ids=[2], config={"max_running_requests": 8})

    async def run() -> None:
        runner = web.AppRunner(build_app(state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                async def post(text: str) -> tuple[int, dict]:
                    async with session.post(url + "/generate", json={"text": text}) as r:
                        return r.status, await r.json()

                results = await asyncio.gather(*(post("boom" if i == 3 else f"hello {i}")
                                                 for i in range(8)))
                for i, (status, body) in enumerate(results):
                    if i == 3:
                        assert status == 500
                        # The cause is in the server's log, not in the answer.
                        assert "incident" in body["error"]["message"]
                        assert "kaboom" not in body["error"]["message"]
                        assert body["error"]["type"] == "internal_server_error"
                    else:
                        assert status == 200 and body["text"] == "ok"
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                assert (await post("after"))[0] == 200
        finally:
            await runner.cleanup()
            state.codec.close()

    asyncio.run(run())


def test_engine_flags_are_generated_from_the_config(capsys):
    import dataclasses

    from radixlm.runtime.cli import build_parser, main
    from radixlm.runtime.server.args import engine_options, server_config

    args = build_parser().parse_args([
        "serve", "--model", "m", "--page-size", "32", "--disable-radix-cache",
        "--schedule-policy", "fcfs", "--max-total-tokens", "4096", "--api-key", "k",
        "--max-queued-requests", "5", "--kv-cache-memory-fraction", "0.3"])
    options = engine_options(args)
    config = EngineConfig.from_kwargs(**options)
    assert (config.model, config.page_size, config.disable_radix_cache) == ("m", 32, True)
    assert (config.schedule_policy, config.max_total_tokens) == ("fcfs", 4096)
    assert config.kv_cache_memory_fraction == 0.3
    assert set(options) == {f.name for f in dataclasses.fields(EngineConfig)}
    server = server_config(args)
    assert (server.api_key, server.max_queued_requests) == ("k", 5)
    # A bad engine value fails before anything starts, naming the field.
    assert main(["serve", "--page-size", "0"]) == 2
    assert "page_size" in capsys.readouterr().err
