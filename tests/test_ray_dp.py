"""Data parallelism on Ray: `radixlm serve --dp 2` on a local Ray cluster, two tiny-model
replicas behind one endpoint. Outputs equal a single engine's, requests sharing a prefix land
where it is cached, and a replica killed mid-run fails (or reruns) its requests without
hanging and is replaced.

One server for the module (its start, a Ray cluster and two engines, is the slow part); the
replicas run one request at a time, so a killed replica has requests waiting too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

from radixlm.backends.server_process import ServerProcess  # noqa: E402
from radixlm.runtime.engine.engine import Engine  # noqa: E402

GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [[1, 5, 9, 33, 7], [1] + list(range(100, 140)), [1, 300, 301, 302], [1, 42],
           [1, 7, 7, 7, 7, 7], [1, 900, 901]]


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    args = ["--model", str(tiny_chat_model), "--max-total-tokens", "4096", "--dp", "2",
            "--router", "cache_aware", "--max-running-requests", "1"]
    with ServerProcess(args, startup_timeout=180) as proc:
        yield proc
        code = proc.stop()
        # SIGTERM: replicas stopped, Ray left, a clean exit
        assert code == 0, f"exit {code}; the server's log ends:\n{proc.log_text()[-6000:]}"


def _post(server: ServerProcess, path: str, body: dict, timeout: float = 60) -> tuple[int, str]:
    request = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _generate(server: ServerProcess, ids: list[int], params: dict = GREEDY) -> dict:
    status, body = _post(server, "/generate", {"input_ids": ids, "sampling_params": params})
    assert status == 200, body
    return json.loads(body)


def _replica_stats(server: ServerProcess) -> list[dict]:
    with urllib.request.urlopen(server.url + "/get_server_info", timeout=30) as response:
        return json.loads(response.read())["stats"]["replicas"]


def test_dp1_imports_no_ray():
    code = ("import sys, radixlm.runtime.server.launch, radixlm.runtime.cli\n"
            "assert 'ray' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_replicas_match_a_single_engine(server, tiny_chat_model):
    status, body = _post(server, "/generate", {"input_ids": PROMPTS, "sampling_params": GREEDY})
    assert status == 200, body
    got = [r["output_ids"] for r in json.loads(body)]
    with Engine(str(tiny_chat_model), max_total_tokens=4096) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert got == [o.token_ids for o in outs]
    # Distinct short prompts spread over both replicas.
    assert all(r["requests_finished"] > 0 for r in _replica_stats(server))


def test_requests_sharing_a_prefix_land_where_it_is_cached(server):
    before = {r["replica"]: r["prefill_tokens_computed"] for r in _replica_stats(server)}
    prefix_len = 160
    for group in range(3):
        prefix = [1] + [1000 + 97 * group + i for i in range(prefix_len - 1)]
        for member in range(3):
            out = _generate(server, prefix + [50 + member, 60 + member])
            if member:
                # The router followed the first member; its pages were cached there.
                assert out["meta_info"]["cached_tokens"] >= prefix_len - 16
    after = {r["replica"]: r["prefill_tokens_computed"] for r in _replica_stats(server)}
    computed = sum(after.values()) - sum(before.values())
    # Each prefix computed once (as on one engine), plus the suffixes.
    assert computed <= 3 * (prefix_len + 2) + 6 * 18


def test_killed_replica_fails_or_reruns_its_requests_and_is_replaced(server):
    pids = {int(i): int(p) for i, p in
            re.findall(r"engine replica (\d) ready: pid (\d+)", server.log_text())}
    assert set(pids) == {0, 1}
    long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    results: dict[int, tuple[int, str]] = {}

    def run(i: int) -> None:
        body = {"input_ids": [1, 11 + i, 3], "sampling_params": long, "stream": i == 0}
        results[i] = _post(server, "/generate", body, timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # each replica runs one request; the others wait
    killed = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    failed = 0
    for i, (status, body) in results.items():
        if i == 0:  # streamed: complete, or ended by an error event naming the replica
            assert status == 200
            assert body.rstrip().endswith("data: [DONE]")
            failed += "engine replica" in body
        else:  # not streamed: nothing had left the server, so it ran again if it had to
            assert status == 200, body
            # Exactly its own tokens: a rerun drops what the lost replica had made.
            assert len(json.loads(body)["output_ids"]) == long["max_new_tokens"]
    assert failed <= 1  # only a stream under way on the killed replica
    assert "resubmitted after replica 0 was lost" in server.log_text()
    deadline = killed + 60
    while "engine replica 0 replaced" not in server.log_text():
        assert time.monotonic() < deadline, server.log_text()[-3000:]
        time.sleep(0.2)
    replaced = [r for r in _replica_stats(server) if r["replica"] == 0]
    assert replaced and replaced[0]["restarts"] == 1
    for prompt in PROMPTS:  # both replicas serve again
        _generate(server, prompt)
    assert all(r["requests_finished"] > 0 for r in _replica_stats(server))


def test_tensor_parallel_replicas_match_a_single_engine(tmp_path):
    """--tp 2 --dp 2: each replica is a TP=2 engine (its worker a process of its own)."""
    from conftest import save_tiny_hf_model

    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=512)
    with Engine(str(folder), max_total_tokens=4096) as engine:
        expected = [o.token_ids for o in engine.generate(input_ids=PROMPTS[:4],
                                                         sampling_params=GREEDY)]
    args = ["--model", str(folder), "--max-total-tokens", "4096", "--dp", "2", "--tp", "2",
            "--router", "round_robin"]
    with ServerProcess(args, startup_timeout=180) as server:
        got = [_generate(server, ids)["output_ids"] for ids in PROMPTS[:4]]
        assert [r["requests_finished"] for r in _replica_stats(server)] == [2, 2]
    assert got == expected


def test_dp_flags_are_checked_before_anything_starts(capsys):
    from radixlm.runtime.cli import main

    assert main(["serve", "--dp", "0"]) == 2
    assert "dp_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--dp", "2", "--router", "random"])
    assert "--router" in capsys.readouterr().err
