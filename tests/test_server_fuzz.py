"""The server against random malformed bodies: valid requests of every POST route, each with a
few fields deleted, added or replaced by values of the wrong type or size (and now and then
a body that is not JSON at all), some of them streamed. Every answer must be a 2xx or a 4xx:
a 5xx, a dropped connection or a hang is a bug in the route's validation. Afterwards the
server still answers, and its KV pages are all back (free or cached).

Seeded, so a failure reproduces: the assertion message carries the route and body."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from test_server import Http, wait_idle_and_check_no_leak

from radixlm.backends.server_process import ServerProcess

REQUESTS = 600
HI = [{"role": "user", "content": "hi"}]
FUNCTION = {"name": "f", "parameters": {"type": "object",
                                       "properties": {"a": {"type": "integer"}}}}
STREAMING = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
             "/generate_program")

# A valid body per route (each is answered 200 as it stands: test_valid_bodies_pass).
VALID: dict[str, dict[str, Any]] = {
    "/generate": {"text": "hello", "rid": "fuzz", "return_logprob": True,
                  "top_logprobs_num": 2, "sampling_params": {
                      "max_new_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                      "min_p": 0.1, "stop": ["x"], "json_schema": '{"type": "object"}',
                      "frequency_penalty": 0.1, "repetition_penalty": 1.1,
                      "min_new_tokens": 1, "logit_bias": {"5": 1.0}, "seed": 3}},
    "/v1/completions": {"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0.3,
                        "logprobs": 2, "n": 2, "stop": ["\n"], "seed": 1,
                        "logit_bias": {"10": -100}},
    "/v1/chat/completions": {"model": "m", "messages": HI, "max_tokens": 3, "top_p": 0.8,
                             "tools": [{"type": "function", "function": FUNCTION}],
                             "tool_choice": "auto", "logprobs": True, "top_logprobs": 2,
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "x", "schema": {"type": "object"}}}},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 3,
                      "instructions": "be brief", "tools": [{"type": "function", **FUNCTION}]},
    "/score": {"prefix": "a b", "continuations": [" c", " d"]},
    "/apply_chat_template": {"messages": HI},
    "/pin_prefix": {"text": "hello world"},
    "/release_prefix": {"lease_id": "fuzz"},
    "/release_program": {"program_id": "fuzz"},
    "/abort_request": {"rid": "fuzz"},
    "/tokenize": {"messages": HI, "add_generation_prompt": True, "return_token_strs": True},
    "/detokenize": {"tokens": [19556, 905]},
    "/generate_program": {"text": "Q: hi", "stream": False, "steps": [
        {"before": " A:", "gen": {"sampling_params": {"max_new_tokens": 2}}},
        {"before": " so", "select": {"choices": ["yes", "no"]}}]},
}
# Wrong types, extremes, odd strings and shapes that clients do send.
ODD: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, 2**70, -2**70, 1e308, -1e308, 0.5, 1e-320,
    float("nan"), float("inf"), "", "x", "\u0000", "\ud7ff", "A" * 100_000, "🙂" * 1000,
    [], [1], [[]], ["a", 1, None], [0] * 5000, list(range(-5, 5)), {}, {"a": 1}, {"": None},
    [{"role": "user"}], [{"role": "tool", "content": "x"}],
    [{"role": "assistant", "tool_calls": [{"id": 1}]}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    {"type": "object", "properties": 5}, {"type": "json_schema"}, {"type": "json_object"},
]
NOT_JSON = [b"{", b"null", b"[]", b"\xff\xfe", b'{"a":' * 1000]


def mutated(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """body with 1-3 changes, each at a random depth: a field deleted, added or replaced."""
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        target: Any = body
        while rng.random() < 0.5:
            keys = list(target) if isinstance(target, dict) else range(len(target))
            inner = [k for k in keys if isinstance(target[k], (dict, list)) and target[k]]
            if not inner:
                break
            target = target[rng.choice(inner)]
        odd = copy.deepcopy(rng.choice(ODD))
        if isinstance(target, list):
            target[rng.randrange(len(target))] = odd
        elif target and rng.random() < 0.2:
            del target[rng.choice(list(target))]
        elif rng.random() < 0.15:
            target[rng.choice(["extra", "sampling_params", "messages", "input_ids", "n",
                               "stream", "lora_path", "model", "steps"])] = odd
        elif target:
            target[rng.choice(list(target))] = odd
    return body


@pytest.fixture(scope="module")
def http(tiny_chat_model):
    with ServerProcess(["--model", str(tiny_chat_model), "--max-total-tokens", "4096",
                        "--max-running-requests", "4"]) as proc:
        yield Http(proc.url)


def test_valid_bodies_pass(http):
    for route, body in VALID.items():
        reply = http.post(route, json=body)
        assert reply.status_code == 200, (route, reply.text[:300])


def test_malformed_bodies_get_4xx_and_leave_the_server_whole(http):
    rng = random.Random(20261206)
    answered: dict[int, int] = {}
    for i in range(REQUESTS):
        route = rng.choice(list(VALID))
        body = mutated(VALID[route], rng)
        if route in STREAMING and rng.random() < 0.2:
            body["stream"] = True
        data = (rng.choice(NOT_JSON) if rng.random() < 0.05
                else json.dumps(body, allow_nan=True).encode())
        reply = http.post(route, content=data)
        answered[reply.status_code] = answered.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (i, route, reply.status_code, reply.text[:300],
                                         data[:500])
    assert answered.get(200, 0) > REQUESTS // 20, answered  # the fuzz reaches the engine too
    assert http.get("/health").status_code == 200
    for route, body in VALID.items():  # everyone else is still served
        assert http.post(route, json=body).status_code == 200, route
    wait_idle_and_check_no_leak(http)
