"""Programs on a radixlm server: rl.RuntimeEndpoint (native routes) and rl.OpenAI (the
OpenAI-compatible routes), against a real `radixlm serve` on the default model."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import radixlm as rl
from radixlm.runtime import Engine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(default_model_folder):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.runtime.server", "--model",
                             str(default_model_folder), "--host", "127.0.0.1", "--port",
                             str(port), "--max-total-tokens", "8192"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


@rl.function
def quiz(s, question):
    s += rl.system("You are a concise assistant.")
    s += rl.user(question)
    s += rl.assistant(rl.gen("answer", max_tokens=12))


@rl.function
def pick(s, review):
    s += rl.user("Is this review positive or negative? " + review)
    s += rl.assistant("The review is " + rl.select("label", choices=["positive", "negative"]))


def test_runtime_endpoint_matches_the_local_engine(server_url, default_model_folder):
    remote = rl.RuntimeEndpoint(server_url)
    with Engine(str(default_model_folder)) as eng:
        local = rl.Engine(engine=eng)
        got = quiz.run(question="What is the capital of France?", backend=remote,
                       temperature=0)
        want = quiz.run(question="What is the capital of France?", backend=local,
                        temperature=0)
        assert got.error() is None and got.text() == want.text()
        review = "I loved it, a wonderful film!"
        remote_pick = pick.run(review=review, backend=remote)
        local_pick = pick.run(review=review, backend=local)
        assert remote_pick["label"] == local_pick["label"]
        assert remote_pick.get_meta_info("label")["scores"] == pytest.approx(
            local_pick.get_meta_info("label")["scores"], abs=1e-3)


def test_runtime_endpoint_streams_forks_and_releases_leases(server_url):
    remote = rl.RuntimeEndpoint(server_url)

    @rl.function
    def branches(s):
        s += "A list of colours: red, green, blue. " * 10
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Colour {i}:" + rl.gen("c", max_tokens=3)
        s.join(forks)

    state = branches.run(backend=remote, temperature=0)
    assert state.error() is None and len(state["c"]) == 3
    assert remote.stats()["leases"] == 0

    streamed = quiz.run(question="Name a fruit.", backend=remote, temperature=0, stream=True)
    pieces = list(streamed.text_iter("answer"))
    plain = quiz.run(question="Name a fruit.", backend=remote, temperature=0)
    assert "".join(pieces) == plain["answer"] and len(pieces) > 1


def test_openai_backend_chat_completion_and_select(server_url):
    backend = rl.OpenAI("default", base_url=server_url + "/v1", api_key="unused")
    with urllib.request.urlopen(server_url + "/v1/models") as response:
        backend.model = json.load(response)["data"][0]["id"]
    state = quiz.run(question="What is the capital of France?", backend=backend,
                     temperature=0)
    assert state.error() is None and "Paris" in state["answer"]

    @rl.function
    def complete(s):
        s += "The capital of Italy is" + rl.gen("city", max_tokens=4, stop=["."])

    assert "Rome" in complete.run(backend=backend, temperature=0)["city"]
    streamed = complete.run(backend=backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter("city")) == streamed["city"]

    # A gen in the middle of an assistant message cannot be a chat completion.
    @rl.function
    def partial(s):
        s += rl.user("Hi") + rl.assistant("Hello, " + rl.gen("rest", max_tokens=4))

    assert "start an assistant message" in str(partial.run(backend=backend).error())
    # select scores each choice through /v1/completions with echo and logprobs: the same
    # pick, from the same logprobs, as the native route's.
    @rl.function
    def sentiment(s, review):
        s += f"Review: {review}\nSentiment:" + rl.select(
            "label", choices=[" positive", " negative", " mixed"])

    remote = rl.RuntimeEndpoint(server_url)
    for review in ("Great!", "Terrible, would not buy again.", "Fine, I guess."):
        over_openai = sentiment.run(review=review, backend=backend)
        native = sentiment.run(review=review, backend=remote)
        assert over_openai.error() is None and over_openai["label"] == native["label"]
    assert pick.run(review="Great!", backend=backend)["label"] in ("positive", "negative")


def test_segments_over_http_give_what_calls_give(server_url):
    """The segment route's answers are the per-call routes' (tests/test_segments.py has the
    programs, and the same check in process)."""
    from test_segments import chat, typed, uncached

    timing = {"id", "e2e_latency"}
    remote = rl.RuntimeEndpoint(server_url)
    per_call = rl.RuntimeEndpoint(server_url, segments=False)
    assert remote.supports_segments and not per_call.supports_segments
    for program in (chat, typed):
        want = program.run(backend=per_call, temperature=0)
        got = program.run(backend=remote, temperature=0)
        assert got.error() is None and got.text() == want.text()
        for name in want._interp.meta:
            strip = lambda meta: {k: v for k, v in uncached(meta).items()  # noqa: E731
                                  if k not in timing}
            assert strip(got.get_meta_info(name)) == strip(want.get_meta_info(name)), name

    @rl.function
    def bad(s):
        s += "A: " + rl.gen("a", max_tokens=3) + "\nB: " + rl.gen("b", regex="(")
        s += "\nC: " + rl.gen("c", max_tokens=3)

    want, got = bad.run(backend=per_call, temperature=0), bad.run(backend=remote, temperature=0)
    assert got["a"] == want["a"] and "regex" in str(got.error()) and "regex" in str(want.error())
    stats = remote.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_segment_route_names_the_bad_field(server_url):
    def post(body):
        request = urllib.request.Request(server_url + "/generate_program",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())["error"]["param"]
        raise AssertionError("accepted")

    gen = {"before": "x", "gen": {"sampling_params": {"max_new_tokens": 2}}}
    assert post({"text": "a", "steps": []}) == (400, "steps")
    assert post({"text": "a", "steps": [gen] * 65}) == (400, "steps")
    assert post({"steps": [{"before": "x", "gen": {"text": "y"}}]}) == (400, "steps[0].gen.text")
    assert post({"steps": [gen, {"select": {"choices": ["a"], "choices_method": "mine"}}]}) \
        == (400, "steps[1].select.choices_method")
    assert post({"steps": [gen, {"before": "x"}]}) == (400, "steps[1]")


def test_a_streamed_segment_keeps_every_logprob(server_url):
    """Streamed over HTTP, a segment's gens carry the same logprobs as streamed calls."""

    @rl.function
    def two(s):
        s += "Colors: red," + rl.gen("a", max_tokens=6, return_logprob=True, stop=",")
        s += ", and" + rl.gen("b", max_tokens=6, return_logprob=True)

    want = two.run(backend=rl.RuntimeEndpoint(server_url, segments=False), temperature=0,
                   stream=True)
    got = two.run(backend=rl.RuntimeEndpoint(server_url), temperature=0, stream=True)
    assert "".join(got.text_iter()) == "".join(want.text_iter())
    for name in ("a", "b"):
        key = "output_token_logprobs"
        assert got.get_meta_info(name)[key] == want.get_meta_info(name)[key]


def test_async_programs_over_http(server_url):
    """arun on the server backends (aiohttp, no thread per program) gives what run gives."""
    from test_lang_async import plan_trip

    remote = rl.RuntimeEndpoint(server_url)
    openai = rl.OpenAI("default", base_url=server_url + "/v1", api_key="unused")
    openai.model = remote.get_model_name()

    async def main():
        trip = await plan_trip.arun(city="Rome", backend=remote, temperature=0)
        quizzes = await quiz.arun_batch([{"question": "Name a fruit."}] * 2, backend=openai,
                                        temperature=0, progress_bar=False)
        streamed = await quiz.arun(question="Name a fruit.", backend=remote, temperature=0,
                                   stream=True)
        pieces = [p async for p in streamed.text_async_iter("answer")]
        return trip, quizzes, streamed, pieces

    trip, quizzes, streamed, pieces = asyncio.run(main())
    want = plan_trip.run(city="Rome", backend=remote, temperature=0)
    assert trip.error() is None and trip.text() == want.text()
    fruit = quiz.run(question="Name a fruit.", backend=openai, temperature=0)
    assert [q["answer"] for q in quizzes] == [fruit["answer"]] * 2
    assert "".join(pieces) == streamed["answer"] and len(pieces) > 1
    # The OpenAI API has no end of a program: its runs' pins stay until they expire, or until
    # the client says so; our backends' runs released theirs when they ended.
    for state, pinned in ((quizzes[0], True), (fruit, True), (trip, False), (streamed, False)):
        request = urllib.request.Request(server_url + "/release_program", json.dumps(
            {"program_id": state.program_id}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            assert json.load(response) == {"released": pinned}


def test_speculative_api_execution_on_the_openai_backend(server_url):
    """num_api_spec_tokens: the gens of a program without roles share /v1/completions calls
    (tests/test_speculation.py has the rules)."""

    def notes(s, topic):
        s += f"Short notes about {topic}, one line each.\n"
        for i in range(4):
            s += f"Note {i + 1}:" + rl.gen(f"note{i}", max_tokens=8, stop="\n") + "\n"

    remote = rl.RuntimeEndpoint(server_url)
    backend = rl.OpenAI(remote.get_model_name(), base_url=server_url + "/v1", api_key="x")

    def finished() -> int:
        return remote.stats()["requests_finished"]

    before = finished()
    want = rl.function(notes).run(topic="rivers", backend=backend, temperature=0)
    per_call = finished() - before
    before = finished()
    got = rl.function(num_api_spec_tokens=64)(notes).run(topic="rivers", backend=backend,
                                                         temperature=0)
    speculated = finished() - before
    assert want.error() is None and got.error() is None and per_call == 4
    assert got["note0"] == want["note0"]  # the first gen is its own call's text
    metas = [got.get_meta_info(f"note{i}") for i in range(4)]
    assert metas[0]["speculated"] is False and metas[0]["prompt_tokens"] > 0
    assert speculated == 4 - sum(m["speculated"] for m in metas)
    # A program in chat roles keeps one call per gen.
    state = rl.function(num_api_spec_tokens=64)(quiz.fn).run(
        question="Name a fruit.", backend=backend, temperature=0)
    assert state.error() is None and state["answer"]


def test_speculation_writes_a_chat_message_with_text_between_gens(server_url):
    """With num_api_spec_tokens, gens in the middle of an assistant message (which a chat API
    cannot continue) are one chat call whose reply is matched against the program's text."""

    def character(s, system, ask):  # SGLang's example for it
        if system:
            s += rl.system("You are a helpful assistant.")
        s += rl.user("Construct a character within the following format:")
        s += rl.assistant("Name: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n")
        s += rl.user(ask)
        s += rl.assistant("Name:" + rl.gen("name", stop="\n") + "\nBirthday:"
                          + rl.gen("birthday", stop="\n") + "\nJob:" + rl.gen("job", stop="\n"))

    remote = rl.RuntimeEndpoint(server_url)
    backend = rl.OpenAI(remote.get_model_name(), base_url=server_url + "/v1", api_key="x")
    follows = "Please generate another character: Name, Birthday and Job.\n"
    assert "start an assistant message" in str(rl.function(character).run(
        system=False, ask=follows, backend=backend, temperature=0).error())
    speculating = rl.function(num_api_spec_tokens=64)(character)
    before = remote.stats()["requests_finished"]
    state = speculating.run(system=False, ask=follows, backend=backend, temperature=0)
    assert state.error() is None and remote.stats()["requests_finished"] - before == 1
    name, birthday, job = state["name"], state["birthday"], state["job"]
    assert all(value.strip() for value in (name, birthday, job))
    assert state.messages()[-1]["content"] == f"Name:{name}\nBirthday:{birthday}\nJob:{job}"
    # A reply that does not follow the program's text (no model starts its reply with this
    # made-up field name, whichever way the CPU rounds): a clear error naming the reply.

    def odd_fields(s):
        s += rl.user(follows)
        s += rl.assistant("Qzx-Vorn:" + rl.gen("a", stop="\n") + "\nBirthday:"
                          + rl.gen("b", stop="\n"))

    error = rl.function(num_api_spec_tokens=64)(odd_fields).run(
        backend=backend, temperature=0).error()
    assert "does not follow the program's text" in str(error)


def test_program_ids_reach_the_server(server_url):
    """Every backend sends the run's program id (a header, or the native field); the server's
    statistics count the program's calls; a bad id or priority is a 400 naming the field."""
    from test_program_identity import two_calls

    remote = rl.RuntimeEndpoint(server_url)
    openai = rl.OpenAI(remote.get_model_name(), base_url=server_url + "/v1", api_key="x")
    state = two_calls.run(backend=remote, temperature=0)  # a segment: /generate_program
    fruit = quiz.run(question="Name a fruit.", backend=openai, temperature=0)
    programs = remote.stats()["programs"]
    assert programs[state.program_id]["calls"] == 4  # two gens and the select's two choices
    assert programs[fruit.program_id]["calls"] == 1

    def post(path, body, headers=None):
        request = urllib.request.Request(server_url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    status, _ = post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1},
                                   "program_id": "agent-7", "priority": -3})
    assert status == 200 and remote.stats()["programs"]["agent-7"]["calls"] == 1
    status, body = post("/generate", {"text": "Hi", "program_id": "x" * 200})
    assert status == 400 and body["error"]["param"] == "program_id"
    status, body = post("/v1/completions", {"model": "m", "prompt": "Hi", "priority": "high"})
    assert status == 400 and body["error"]["param"] == "priority"
    status, body = post("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1},
                        {"X-Program-Id": ""})
    assert status == 400 and body["error"]["param"] == "X-Program-Id"
