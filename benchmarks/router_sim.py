"""Routing at scale, by simulation: the routing policies of `radixlm.runtime.replicas.routing`
over 8 to 256 simulated replicas of an 8B model on H200s.

The trace (seeded) is multi-tenant: each session belongs to a tenant (Zipf popularity) whose
system prompt opens every prompt of the session, and is one of
  chat     2-8 turns; each turn resends the history (earlier prompts and replies) plus a new
           user message, after a think time;
  program  a shared document, then 2-8 forks that arrive together (one branch each), then a
           join whose prompt holds the document and every branch with its output;
  single   one question.
Sessions start as a Poisson process; there are max(--min-sessions, --sessions-per-replica x
replicas) of them (2,000 / 2,560 / 10,240 at 8 / 64 / 256 replicas by default), starting at
--session-rate sessions per second per replica (8: round-robin's replicas then spend about
a third of their time prefilling and its p99 TTFT is near its knee).

Each replica is a continuous-batching engine with a prefix cache of --cache-tokens tokens
(blocks of 64 tokens, LRU, a prompt's first blocks kept longest) and at most --max-running
requests admitted, FCFS. A step takes up to --chunk prefill tokens from the admitted requests,
in order, plus one decode token for every running request. Costs, from the measured single
H200 runs of a Llama-3-8B shape (docs/performance.md):
  prefill   24.5 us per uncached token: 13.96 GFLOP per token at 570 TFLOP/s (measured 550-620
            on full 16K-token steps), plus 1.05 GFLOP per sequence for the head;
  decode    the median step times of `one_batch_h200_2026-11-30_overlap.json`: 4.62, 5.02,
            6.03, 10.00, 17.12 ms at batch 1, 8, 32, 128, 256 (interpolated linearly);
  a mixed step reads the weights once: max(prefill time, d(1)) + d(b) - d(1).
Attention's growth with context, the KV that running requests pin (besides the cache) and the
network are left out. A prompt counts as cached from its admission (requests admitted
together share it); outputs are cached when their request ends.

The router gets each replica's exact load at each arrival, and the prompt as text with one
character per token, so its units are tokens. Its tree holds --cache-tokens per replica.

Reported per replica count and policy: the cache hit rate (prompt tokens not prefilled) and
its bound (one infinite cache shared by every replica), busy time (mean over the run's
length), load imbalance (the busiest replica's busy time over the mean, and the same for
prefill tokens computed), and TTFT p50 / p99 (arrival to the end of the step that computes
the first token, queueing included).

    python benchmarks/router_sim.py                       # 8, 64, 256 replicas; every policy
    python benchmarks/router_sim.py --replicas 64 --policies cache_aware \\
        --option overload_abs=8 --out sim.json
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import heapq
import json
import os
import platform
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from radixlm.runtime.replicas.routing import POLICIES, ReplicaLoad, RouteRequest, make_router

from results_dir import results_dir

PREFILL_S_PER_TOKEN = 13.96e9 / 570e12
PREFILL_S_PER_SEQUENCE = 1.05e9 / 570e12
DECODE_BATCH = (1, 8, 32, 128, 256)
DECODE_STEP_S = (4.62e-3, 5.02e-3, 6.03e-3, 10.00e-3, 17.12e-3)
BLOCK = 64  # tokens per prefix-cache block in the replica model


# ---------------------------------------------------------------------------------- the trace

class Segments:
    """Pieces of prompt text. Each has a length in tokens, a string (one character per token,
    what the router sees) and cache blocks. A piece always follows the same prefix in the
    trace, so its blocks need no chaining to be prefix-unique."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng  # the characters only; lengths come from the caller
        self.text: list[str] = []
        self.blocks: list[list[tuple[int, int]]] = []  # (block key, tokens)

    def new(self, length: int) -> int:
        uid = len(self.text)
        # Two leading characters from the id keep different pieces from sharing a prefix.
        head = chr(0x4E00 + uid % 20_000) + chr(0x4E00 + uid // 20_000 % 20_000)
        start = self.rng.randrange(len(NOISE) - length)
        self.text.append((head + NOISE[start:start + length - 2])[:length])
        self.blocks.append([(uid * 4096 + i, min(BLOCK, length - i * BLOCK))
                            for i in range((length + BLOCK - 1) // BLOCK)])
        return uid


NOISE = "".join(random.Random(0).choices([chr(0x3400 + i) for i in range(6000)], k=1 << 20))


@dataclass
class Request:
    arrival: float
    prompt: list[int]  # segment ids
    out_len: int
    session: str | None
    follow: Session
    out_seg: int = -1
    replica: int = -1
    ttft: float = -1.0


@dataclass
class Session:
    kind: str
    tenant_seg: int
    rng: random.Random
    turns_left: int = 0  # chat
    pending: int = 0  # program: forks not yet done
    forks: list[Request] = field(default_factory=list)
    context: list[int] = field(default_factory=list)


class Trace:
    """Sessions drawn from a generator of their own (seeded by the session's number), so every
    policy replays the same trace whatever order its events come in."""

    def __init__(self, args: argparse.Namespace, replicas: int) -> None:
        self.seed = args.seed
        rng = random.Random(args.seed)
        self.seg = Segments(random.Random(args.seed + 1))
        self.tenants = [self.seg.new(rng.randint(300, 3000)) for _ in range(args.tenants)]
        self.weights = [1 / (k + 1) for k in range(args.tenants)]  # Zipf, s = 1
        self.think_s = args.think_s
        n = max(args.min_sessions, args.sessions_per_replica * replicas)
        rate = args.session_rate * replicas
        t, self.starts = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            self.starts.append(t)

    def start(self, number: int, t: float) -> list[Request]:
        """The first requests of session `number`."""
        rng = random.Random(self.seed * 1_000_003 + number)
        tenant = self.tenants[rng.choices(range(len(self.tenants)), self.weights)[0]]
        kind = rng.choices(("chat", "program", "single"), (0.5, 0.25, 0.25))[0]
        session = Session(kind, tenant, rng)
        if kind == "chat":
            session.turns_left = rng.randint(2, 8) - 1
            user = self.seg.new(rng.randint(20, 300))
            return [Request(t, [tenant, user], rng.randint(50, 500), f"chat{number}", session)]
        if kind == "program":
            session.context = [tenant, self.seg.new(rng.randint(500, 3000))]
            forks = [Request(t, session.context + [self.seg.new(rng.randint(10, 60))],
                             rng.randint(30, 300), None, session) for _ in range(rng.randint(2, 8))]
            session.forks, session.pending = forks, len(forks)
            return forks
        return [Request(t, [tenant, self.seg.new(rng.randint(50, 1500))], rng.randint(20, 400),
                        None, session)]

    def follow_up(self, done: Request, t: float) -> Request | None:
        """The request that `done` finishing makes arrive, if any."""
        s = done.follow
        rng = s.rng
        if s.kind == "chat" and s.turns_left > 0:
            s.turns_left -= 1
            prompt = done.prompt + [done.out_seg, self.seg.new(rng.randint(20, 300))]
            return Request(t + rng.expovariate(1 / self.think_s), prompt, rng.randint(50, 500),
                           done.session, s)
        if s.kind == "program" and s.forks:
            s.pending -= 1
            if s.pending == 0:
                body = [seg for f in s.forks for seg in (f.prompt[-1], f.out_seg)]
                s.forks = []
                return Request(t, s.context + body, rng.randint(50, 300), None, s)
        return None


# ------------------------------------------------------------------------------- the replicas

def decode_step_s(batch: int) -> float:
    """A decode step's time: linear between the measured batch sizes."""
    if batch <= 1:
        return DECODE_STEP_S[0] if batch else 0.0
    i = min(bisect.bisect_left(DECODE_BATCH, batch), len(DECODE_BATCH) - 1)
    b0, b1, s0, s1 = DECODE_BATCH[i - 1], DECODE_BATCH[i], DECODE_STEP_S[i - 1], DECODE_STEP_S[i]
    return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)


class Replica:
    def __init__(self, cache_tokens: int, max_running: int, chunk: int) -> None:
        self.capacity, self.max_running, self.chunk = cache_tokens, max_running, chunk
        self.cache: OrderedDict[int, int] = OrderedDict()  # block key -> tokens, LRU first
        self.cached = 0
        self.waiting: deque[Request] = deque()
        self.prefill: deque[list] = deque()  # [request, uncached tokens left]
        self.running: list[tuple[int, int, Request]] = []  # (finish step, seq, request)
        self.steps = 0  # decode steps taken
        self.busy = self.prompt_tokens = self.hit_tokens = 0.0
        self.version = 0  # bumps when the pending event changes
        self.phase = "idle"  # or "step" (one mixed step) or "jump" (k decode steps)
        self.start = self.dt = 0.0
        self.k = 0
        self.step_done: list[Request] = []  # prefills finishing with the current step

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(running=len(self.running) + len(self.prefill) + len(self.step_done),
                           waiting=len(self.waiting))

    def remember(self, blocks: list[tuple[int, int]]) -> int:
        """Tokens of `blocks` already cached (a leading run); then cache them all, the first
        blocks most recent so they are evicted last."""
        hit = 0
        for key, size in blocks:
            if key not in self.cache:
                break
            hit += size
        for key, size in reversed(blocks):
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                self.cache[key] = size
                self.cached += size
        while self.cached > self.capacity:
            self.cached -= self.cache.popitem(last=False)[1]
        return hit


# ---------------------------------------------------------------------------- the simulation

def simulate(args: argparse.Namespace, replicas: int, policy: str) -> dict:
    wall = time.perf_counter()
    trace = Trace(args, replicas)
    seg = trace.seg
    options = dict(args.option) if policy == "cache_aware" else {}
    if policy == "cache_aware":
        options.setdefault("tree_capacity", args.cache_tokens)
    router = make_router(policy, replicas, **options)
    reps = [Replica(args.cache_tokens, args.max_running, args.chunk) for _ in range(replicas)]
    loads = [rep.load() for rep in reps]  # updated as each replica changes
    seen: set[int] = set()  # every block any replica computed: the hit rate's upper bound
    reachable = 0
    events: list[tuple[float, int, int, object]] = []  # (time, seq, replica or -1, payload)
    seq = 0

    def push(t: float, replica: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, replica, payload))

    def plan(r: int, t: float) -> None:
        nonlocal reachable
        rep = reps[r]
        while rep.waiting and len(rep.running) + len(rep.prefill) < rep.max_running:
            req = rep.waiting.popleft()
            blocks = [b for s in req.prompt for b in seg.blocks[s]]
            length = sum(size for _, size in blocks)
            for key, size in blocks:
                if key not in seen:
                    break
                reachable += size
            seen.update(key for key, _ in blocks)
            hit = min(rep.remember(blocks), length - 1)  # the last token is always computed
            rep.prompt_tokens += length
            rep.hit_tokens += hit
            rep.prefill.append([req, length - hit])
        b = len(rep.running)
        rep.start, rep.version = t, rep.version + 1
        if rep.prefill:
            budget, done, tokens = rep.chunk, [], 0
            for item in rep.prefill:
                take = min(budget, item[1])
                item[1] -= take
                budget -= take
                tokens += take
                if item[1] == 0:
                    done.append(item[0])
                if budget == 0:
                    break
            for _ in done:
                rep.prefill.popleft()
            compute = tokens * PREFILL_S_PER_TOKEN + len(done) * PREFILL_S_PER_SEQUENCE
            floor = DECODE_STEP_S[0]
            rep.dt = max(compute, floor) + (decode_step_s(b) - floor if b else 0.0)
            rep.phase, rep.k, rep.step_done = "step", 1, done
        elif b:
            rep.dt, rep.phase = decode_step_s(b), "jump"
            rep.k = max(1, rep.running[0][0] - rep.steps)
        else:
            rep.phase = "idle"
        if rep.phase != "idle":
            push(t + rep.k * rep.dt, r, rep.version)
        loads[r] = rep.load()

    ttfts: list[float] = []
    finished = 0
    rseq = 0

    def arrive(req: Request, t: float) -> None:
        text = "".join(seg.text[s] for s in req.prompt)
        r = router.choose(RouteRequest(text=text, session=req.session), loads)
        req.replica = r
        rep = reps[r]
        rep.waiting.append(req)
        loads[r] = rep.load()
        if rep.phase == "idle":
            plan(r, t)
        elif rep.phase == "jump":  # stop after the decode step in progress, then admit
            k = int((t - rep.start) / rep.dt) + 1
            if k < rep.k:
                rep.k, rep.version = k, rep.version + 1
                push(rep.start + k * rep.dt, r, rep.version)

    def complete(req: Request, t: float) -> None:
        nonlocal finished
        finished += 1
        router.finished(req.replica, RouteRequest())
        blocks = [b for s in req.prompt + [req.out_seg] for b in seg.blocks[s]]
        reps[req.replica].remember(blocks)
        seen.update(key for key, _ in blocks)
        nxt = trace.follow_up(req, t)
        if nxt is not None:
            push(nxt.arrival, -1, nxt)

    for number, t in enumerate(trace.starts):
        push(t, -1, number)
    while events:
        t, _, r, payload = heapq.heappop(events)
        if r < 0:
            if isinstance(payload, int):
                for req in trace.start(payload, t):
                    arrive(req, t)
            else:
                arrive(payload, t)
            continue
        rep = reps[r]
        if payload != rep.version:
            continue  # replaced by a shorter plan
        rep.busy += t - rep.start
        rep.steps += rep.k
        for req in rep.step_done:
            req.ttft = t - req.arrival
            ttfts.append(req.ttft)
            req.out_seg = seg.new(req.out_len)
            rseq += 1
            heapq.heappush(rep.running, (rep.steps + req.out_len - 1, rseq, req))
        rep.step_done = []
        while rep.running and rep.running[0][0] <= rep.steps:
            complete(heapq.heappop(rep.running)[2], t)
        plan(r, t)

    ttfts.sort()
    busy = [rep.busy for rep in reps]
    prefill = [rep.prompt_tokens - rep.hit_tokens for rep in reps]
    prompt = sum(rep.prompt_tokens for rep in reps)
    hit = sum(rep.hit_tokens for rep in reps)
    row = {"replicas": replicas, "policy": policy, "options": options,
           "sessions": len(trace.starts), "requests": finished,
           "prompt_tokens": int(prompt), "prefill_tokens": int(prompt - hit),
           "hit_rate": hit / prompt,
           "hit_rate_bound": reachable / prompt,  # one infinite cache shared by all
           "busy_max_over_mean": max(busy) / (sum(busy) / replicas),
           "utilization": sum(busy) / replicas / t,
           "prefill_share": (prompt - hit) * PREFILL_S_PER_TOKEN / replicas / t,
           "prefill_max_over_mean": max(prefill) / (sum(prefill) / replicas),
           "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
           "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
           "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts),
           "simulated_s": t, "wall_s": time.perf_counter() - wall}
    if policy == "cache_aware":
        row["decisions"] = dict(router.decisions)
        row["options"] = {name: getattr(router, name) for name in
                          ("overload_abs", "overload_rel", "min_match", "max_sessions")}
        row["options"]["tree_capacity"] = router.tree.capacity
    return row


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"processor": model, "cpus": os.cpu_count(), "python": platform.python_version()}


def option(text: str) -> tuple[str, float | int]:
    name, _, value = text.partition("=")
    return name, float(value) if "." in value else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--option", type=option, action="append", default=[],
                        help="a cache_aware option, NAME=VALUE (repeatable)")
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--min-sessions", type=int, default=2000)
    parser.add_argument("--sessions-per-replica", type=int, default=40)
    parser.add_argument("--session-rate", type=float, default=8.0,
                        help="sessions starting per second per replica")
    parser.add_argument("--think-s", type=float, default=3.0, help="mean chat think time")
    parser.add_argument("--cache-tokens", type=int, default=500_000,
                        help="prefix cache per replica (the 8B H200 pool is ~870K tokens; "
                        "the rest is left to running requests)")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    rows = []
    print(f"{'replicas':>8} {'policy':<12}{'requests':>9}{'hit rate':>9}{'bound':>6}{'busy':>6}"
          f"{'busy max/mean':>14}"
          f"{'prefill max/mean':>17}{'TTFT p50':>10}{'TTFT p99':>10}{'wall':>7}")
    for replicas in args.replicas:
        for policy in args.policies:
            r = simulate(args, replicas, policy)
            rows.append(r)
            print(f"{replicas:>8} {policy:<12}{r['requests']:>9}{r['hit_rate']:>9.1%}"
                  f"{r['hit_rate_bound']:>6.0%}{r['utilization']:>6.0%}"
                  f"{r['busy_max_over_mean']:>14.2f}{r['prefill_max_over_mean']:>17.2f}"
                  f"{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>8.0f}ms{r['wall_s']:>6.1f}s",
                  flush=True)
    record = {"benchmark": "router_sim", "date": datetime.date.today().isoformat(),
              "machine": machine(),
              "cost_model": {"prefill_s_per_token": PREFILL_S_PER_TOKEN,
                             "prefill_s_per_sequence": PREFILL_S_PER_SEQUENCE,
                             "decode_batch": DECODE_BATCH, "decode_step_s": DECODE_STEP_S,
                             "source": "docs/performance.md; one_batch_h200_2026-11-30_"
                                       "overlap.json (Llama-3-8B shape, one H200)"},
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "results": rows}
    out = Path(args.out or results_dir() / f"router_sim_{record['date']}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
