"""Data parallelism on Ray: `radixlm serve --dp 2` on a local Ray cluster, two tiny-model
replicas behind one endpoint. Outputs equal a single engine's, requests sharing a prefix land
where it is cached, and a replica killed mid-run fails (or reruns) its requests without
hanging and is replaced.

One server for the module (its start, a Ray cluster and two engines, is the slow part); the
replicas run one request at a time, so a killed replica has requests waiting too.
"""

from __future__ import annotations

import argparse
import ipaddress
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


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux: read from /proc)."""
    found, todo = [], [pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(child) for child in f.read().split()]
        except OSError:  # exited meanwhile
            pass
    return found


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """The TCP addresses and ports these processes listen on (Linux: read from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        inodes |= {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                host, port = fields[1].split(":")
                raw = bytes.fromhex(host)  # 32-bit words, each in the machine's byte order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(raw)
                if address.version == 6 and address.ipv4_mapped:
                    address = address.ipv4_mapped
                found.append((str(address), int(port, 16)))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
def test_ray_listens_on_loopback_only(server):
    """The server was given --host 127.0.0.1: its local Ray cluster (control store, node
    manager, object manager, workers, metrics) listens on loopback alone too."""
    listening = _listening(_process_tree(server.proc.pid))
    assert len(listening) > 3, listening  # the HTTP server, Ray's servers, the replicas
    public = [(a, p) for a, p in listening if not ipaddress.ip_address(a).is_loopback]
    assert not public, f"listening beyond loopback: {public}"
    assert "on the Ray cluster at 127.0.0.1:" in server.log_text()


def test_ray_init_arguments(monkeypatch):
    """What connect() asks of ray.init: the node's address, no dashboard, and while a loopback
    node starts, Ray's switch that keeps it on loopback."""
    import ray
    from ray._private import ray_constants

    from radixlm.runtime.replicas import ray_actors

    calls = []

    def init(**kwargs):
        calls.append((kwargs, ray_constants.ENABLE_RAY_CLUSTER,
                      os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")))

    class Context:
        gcs_address = "here:1"

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    switch = ray_constants.ENABLE_RAY_CLUSTER
    assert ray_actors.connect(None, 4) == "here:1"  # a local cluster: loopback
    ray_actors.connect(None, 4, "10.1.2.3")  # told otherwise
    ray_actors.connect("10.0.0.1:6379")  # joining a cluster: Ray's pick
    ray_actors.connect("10.0.0.1:6379", None, "localhost")
    (local, *during), (other, *plain), (joined, *_), (joined_here, *during_here) = calls
    assert local["_node_ip_address"] == "127.0.0.1" and local["num_cpus"] == 4
    assert local["include_dashboard"] is False
    assert during == [False, "0"] and during_here == [False, "0"]
    assert other["_node_ip_address"] == "10.1.2.3" and plain == [switch, None]
    assert "_node_ip_address" not in joined and joined["address"] == "10.0.0.1:6379"
    assert joined_here["_node_ip_address"] == "localhost"
    # Put back after each start.
    assert ray_constants.ENABLE_RAY_CLUSTER == switch
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    with pytest.raises(ValueError, match="0.0.0.0"):
        ray_actors.connect(None, 4, "0.0.0.0")


def test_replica_set_passes_its_ray_host(monkeypatch):
    import asyncio

    from radixlm.runtime.replicas import ray_actors
    from radixlm.runtime.replicas.replica_set import ReplicaSet
    from radixlm.runtime.server.args import add_serve_args

    seen = []

    def connect(address, num_cpus, host=None):
        seen.append((address, host))
        raise ConnectionError("no cluster here")

    monkeypatch.setattr(ray_actors, "connect", connect)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for host in (None, "10.1.2.3"):
        with pytest.raises(ConnectionError):
            asyncio.run(ReplicaSet({}, dp_size=2, ray_host=host).start())
    assert seen == [(None, None), (None, "10.1.2.3")]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--dp", "2", "--ray-host", "10.1.2.3"]).ray_host == "10.1.2.3"
    assert parser.parse_args([]).ray_host is None


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
