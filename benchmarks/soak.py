"""Soak: minutes of mixed traffic against a launched radixlm server, hostile clients included.

Two phases of equal length with the same good traffic (a fixed number of clients sending
native, OpenAI, chat, streamed and JSON-schema requests back to back): first alone (the
baseline), then next to hostile clients that disconnect mid-stream, send malformed, oversized,
cross-origin or non-JSON requests, attack the chat template (their own Jinja: a nested loop
that never ends, a 400 MB string; apply_chat_template's own parameters) and the tool schemas
(40,000 tools, an 8,000-item draft-04 `enum`, `parameters` nested 200 deep), and open
connections that never finish their head.

Reported per phase: good requests completed and lost (an exception, a timeout, a non-200 or
an invalid result), 5xx answers to anyone, p50/p99 latency of the good requests, and the
statuses the hostile requests got; over the whole run the resident memory of the HTTP and
engine processes, sampled every second, and the KV pages left over at the end (free + cached
must equal the total). Writes JSON, and a PNG of memory over time when matplotlib is there.

    python benchmarks/soak.py --minutes 2            # the embedded model on this machine
    python benchmarks/soak.py --server-args "--model M --max-total-tokens 65536"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from results_dir import results_dir

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_HEADERS = {"Content-Type": "application/json"}


def bad_requests() -> list[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) a hostile or broken client might send; each deserves a 4xx."""
    j = JSON_HEADERS
    nested = {"type": "integer"}
    for _ in range(40):
        nested = {"type": "array", "items": nested, "minItems": 1, "maxItems": 1}
    return [
        ("/generate", b'{"text": "hi", ', j),
        ("/generate", b'{"text": 5}', j),
        ("/generate", b'{"text": "hi", "rid": "\\ud800"}', j),
        ("/generate", json.dumps({"text": ["x"] * 64, "sampling_params": {"n": 64}}).encode(), j),
        ("/generate", b'{"text": "hi"}', {"Content-Type": "text/plain"}),
        ("/flush_cache", b"", {"Origin": "http://evil.example"}),
        ("/generate", json.dumps({"input_ids": list(range(500_000)) + [10**9]}).encode(), j),
        ("/generate", b"[" * 100_000 + b"]" * 100_000, j),
        ("/generate", json.dumps({"text": "hi", "sampling_params": {"regex": "(unclosed"}})
         .encode(), j),
        ("/generate", json.dumps({"text": "x", "sampling_params": {
            "json_schema": json.dumps(nested), "max_new_tokens": 4}}).encode(), j),
        ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": "user"}]})
         .encode(), j),
        ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "stop_token_ids":
                                        list(range(1000))}).encode(), j),
        ("/score", json.dumps({"prefix": "a", "continuations": ["b"] * 5000}).encode(), j),
        *template_attacks(), *tool_attacks(),
    ]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def template_attacks() -> list[tuple[str, bytes, dict[str, str]]]:
    """A client's own chat template (refused unless the server trusts client templates; then
    bounded in time and memory) and apply_chat_template's parameters as template variables."""
    loop = ("{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}"
            "{% endfor %}")
    return [("/v1/chat/completions", _chat(chat_template_kwargs={"chat_template": t}),
             JSON_HEADERS) for t in (loop, "{{ 'A' * 400000000 }}")] + [
        ("/v1/chat/completions", _chat(chat_template_kwargs={name: True}), JSON_HEADERS)
        for name in ("tokenize", "return_dict", "continue_final_message")]


def tool_attacks() -> list[tuple[str, bytes, dict[str, str]]]:
    """Tool lists too many, too large, too deep, or slow to check (draft-04's `uniqueItems`
    on a large `enum` is quadratic)."""
    def tool(name: str, parameters: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    nested: dict = {"type": "object"}
    for _ in range(200):
        nested = {"type": "object", "properties": {"a": nested}}
    slow = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
            "properties": {"x": {"enum": [{"k": i} for i in range(8000)]}}}
    many = [tool(f"f{i}", {"type": "object", "properties": {"a": {"type": "string"}}})
            for i in range(40_000)]
    return [("/v1/chat/completions", _chat(tools=t), JSON_HEADERS)
            for t in (many, [tool("slow", slow)], [tool("deep", nested)])]


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.rng = random.Random(args.seed)
        self.bad = bad_requests()
        self.stats: dict[str, Any] = {}

    def reset(self, phase: str) -> None:
        self.stats[phase] = {"good_done": 0, "good_lost": 0, "latencies": [], "five_xx": 0,
                             "hostile": collections.Counter(), "lost_examples": []}

    async def good(self, session: aiohttp.ClientSession, phase: str, until: float) -> None:
        s = self.stats[phase]
        while time.monotonic() < until:
            kind = self.rng.choice(("native", "stream", "chat", "schema"))
            start = time.monotonic()
            try:
                ok = await asyncio.wait_for(self._one_good(session, kind), self.args.timeout)
            except Exception as exc:  # a lost request: the point of the benchmark
                ok = f"{type(exc).__name__}: {exc}"
            if ok is True:
                s["good_done"] += 1
                s["latencies"].append(time.monotonic() - start)
            else:
                s["good_lost"] += 1
                if len(s["lost_examples"]) < 5:
                    s["lost_examples"].append(f"{kind}: {ok}")

    async def _one_good(self, session: aiohttp.ClientSession, kind: str) -> bool | str:
        tokens = self.rng.randint(4, self.args.max_tokens)
        if kind == "native":
            body = {"text": f"Tell me about {self.rng.random():.3f}",
                    "sampling_params": {"max_new_tokens": tokens, "temperature": 0.7}}
            async with session.post(self.url + "/generate", json=body) as r:
                data = await r.json()
                return r.status == 200 and data["meta_info"]["completion_tokens"] > 0 or \
                    f"{r.status} {data}"
        if kind == "stream":
            body = {"model": "m", "prompt": "Once upon a time", "max_tokens": tokens,
                    "stream": True}
            async with session.post(self.url + "/v1/completions", json=body) as r:
                text = (await r.read()).decode()
                return r.status == 200 and text.rstrip().endswith("data: [DONE]") and \
                    '"error"' not in text or f"{r.status} {text[-200:]}"
        if kind == "chat":
            body = {"model": "m", "max_tokens": tokens,
                    "messages": [{"role": "user", "content": "Say hello."}]}
            async with session.post(self.url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
                return r.status == 200 and bool(data["choices"]) or f"{r.status} {data}"
        import jsonschema

        body = {"text": "A person as JSON:", "sampling_params": {
            "json_schema": json.dumps(SCHEMA), "max_new_tokens": 64, "temperature": 0.7}}
        async with session.post(self.url + "/generate", json=body) as r:
            data = await r.json()
            if r.status != 200:
                return f"{r.status} {data}"
            if data["meta_info"]["finish_reason"]["type"] == "stop":
                jsonschema.validate(json.loads(data["text"]), SCHEMA)
            return True

    async def hostile(self, session: aiohttp.ClientSession, phase: str, until: float) -> None:
        s = self.stats[phase]
        while time.monotonic() < until:
            kind = self.rng.choice(("disconnect", "bad", "bad", "slow"))
            try:
                if kind == "disconnect":
                    await self._disconnect(session)
                    s["hostile"]["disconnect"] += 1
                elif kind == "slow":
                    await self._slow()
                    s["hostile"]["slow"] += 1
                else:
                    path, body, headers = self.rng.choice(self.bad)
                    async with session.post(self.url + path, data=body, headers=headers) as r:
                        await r.read()
                        s["hostile"][str(r.status)] += 1
                        s["five_xx"] += r.status >= 500
            except Exception as exc:
                s["hostile"][f"client {type(exc).__name__}"] += 1

    async def _disconnect(self, session: aiohttp.ClientSession) -> None:
        body = {"text": "Write a long story.", "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}

        async def read() -> None:
            async with session.post(self.url + "/generate", json=body) as r:
                async for _ in r.content:
                    pass
        try:  # leave mid-stream
            await asyncio.wait_for(read(), self.rng.uniform(0.05, 0.5))
        except asyncio.TimeoutError:
            pass

    async def _slow(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le")
        await writer.drain()
        try:  # the server closes it after --keep-alive-timeout
            await asyncio.wait_for(reader.read(), self.args.slow_hold)
        except asyncio.TimeoutError:
            pass
        writer.close()


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return 0.0


async def sample_memory(pids: dict[str, int], samples: list[dict[str, float]],
                        start: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append({"t": time.monotonic() - start,
                        **{name: rss_mb(pid) for name, pid in pids.items()}})
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def run(url: str, pids: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    soak = Soak(url, args)
    samples: list[dict[str, float]] = []
    stop = asyncio.Event()
    start = time.monotonic()
    sampler = asyncio.ensure_future(sample_memory(pids, samples, start, stop))
    phases = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for phase, hostile in (("clean", 0), ("hostile", args.hostile_clients)):
            soak.reset(phase)
            began = time.monotonic()
            until = began + args.minutes * 30
            tasks = [soak.good(session, phase, until) for _ in range(args.good_clients)]
            tasks += [soak.hostile(session, phase, until) for _ in range(hostile)]
            await asyncio.gather(*tasks)
            phases[phase] = (began - start, time.monotonic() - start)
        async with session.get(url + "/get_server_info") as r:
            info = await r.json()
    stop.set()
    await sampler
    return {"phases": phases, "stats": soak.stats, "memory": samples, "info": info}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase, s in result["stats"].items():
        lat = sorted(s["latencies"])
        out[phase] = {
            "good_done": s["good_done"], "good_lost": s["good_lost"], "five_xx": s["five_xx"],
            "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "hostile": dict(s["hostile"]), "lost_examples": s["lost_examples"]}
    memory = result["memory"]
    for name in ("http", "engine"):
        values = [m[name] for m in memory if m[name]]
        out[f"{name}_rss_mb"] = {"start": values[0], "peak": max(values), "end": values[-1]}
    stats = result["info"]["stats"]
    out["kv_pages_leaked"] = (stats["kv_pages_total"] - stats["kv_pages_free"]
                              - stats["kv_pages_cached"])
    out["in_flight_at_end"] = result["info"]["queue"]["in_flight"]
    return out


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    memory = result["memory"]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    for name, label in (("http", "HTTP process"), ("engine", "engine process")):
        ax.plot([m["t"] for m in memory], [m[name] for m in memory], label=label)
    begin, _ = result["phases"]["hostile"]
    ax.axvline(begin, color="grey", linestyle="--", linewidth=1)
    ax.text(begin, ax.get_ylim()[1] * 0.97, " hostile clients join", va="top", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("resident memory (MB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="both phases together")
    parser.add_argument("--server-args", default="--max-total-tokens 32768 --keep-alive-timeout 5")
    parser.add_argument("--good-clients", type=int, default=4)
    parser.add_argument("--hostile-clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slow-hold", type=float, default=10.0,
                        help="seconds a slow client holds its half-sent connection at most")
    parser.add_argument("--timeout", type=float, default=120.0, help="per good request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    from radixlm.backends.server_process import ServerProcess

    with ServerProcess(shlex.split(args.server_args)) as server:
        pids = {"http": server.proc.pid, "engine": server.engine_pid()}
        result = asyncio.run(run(server.url, pids, args))
        code = server.stop()
    summary = summarize(result)
    summary["exit_code"] = code
    print(f"\n{args.minutes:g} min, {args.good_clients} good clients, "
          f"{args.hostile_clients} hostile ones in the second half")
    print(f"{'phase':8} {'good done':>9} {'lost':>5} {'5xx':>4} {'p50 s':>7} {'p99 s':>7}  "
          "hostile requests by answer")
    for phase in ("clean", "hostile"):
        r = summary[phase]
        print(f"{phase:8} {r['good_done']:9d} {r['good_lost']:5d} {r['five_xx']:4d} "
              f"{r['p50_s'] or 0:7.3f} {r['p99_s'] or 0:7.3f}  {r['hostile']}")
    for name in ("http", "engine"):
        m = summary[f"{name}_rss_mb"]
        print(f"{name} RSS MB: start {m['start']:.0f}, peak {m['peak']:.0f}, end {m['end']:.0f}")
    print(f"KV pages leaked: {summary['kv_pages_leaked']}, in flight at the end: "
          f"{summary['in_flight_at_end']}, server exit code {code}")
    date = datetime.date.today().isoformat()
    out = Path(args.out or results_dir() / f"soak_cpu_{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "soak", "date": date,
              "machine": {"processor": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count(), "python": platform.python_version()},
              "config": vars(args), "summary": summary,
              "memory": result["memory"], "phases": result["phases"]}
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if plot(result, png):
        print(f"wrote {png}")
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()
