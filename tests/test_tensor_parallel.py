"""Tensor parallelism on CPU with gloo: TP=N greedy output equals TP=1 in fp32, every rank
holds only its shard, and a lost rank fails requests with an error instead of hanging.

Each tensor-parallel engine starts worker processes (a few seconds each on CI's two cores), so
the tests share engines across assertions and keep the launches few.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from radixlm.runtime.distributed import groups
from radixlm.runtime.distributed.groups import TPInfo, active_all_reduce, valid_tp_sizes
from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.models.layers.linear import Linear, LinearShard
from radixlm.runtime.models.quantization.quant_config import QuantConfig
from radixlm.runtime.parallel.sharded import ShardedKernel

from conftest import save_tiny_hf_model
from test_model_families import NEW_FAMILIES

GREEDY = {"max_new_tokens": 10, "temperature": 0}
PROMPTS = [[1, 5, 9, 33, 7], [1] + list(range(100, 140)), [1, 300, 301, 302]]


def _greedy(engine: Engine, prompts: list[list[int]], params: dict = GREEDY) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def _options(**extra) -> dict:
    return dict(dtype="float32", device="cpu", max_total_tokens=4096, tp_timeout=30, **extra)


def test_tp_info_splits_heads_kv_heads_and_vocab():
    assert TPInfo(1, 2).split(8, "heads") == (4, 4)
    with pytest.raises(ValueError, match="divisible by tp_size"):
        TPInfo(0, 2).split(9, "num_attention_heads")
    # Fewer KV heads than ranks: each rank holds one, replicated.
    assert [TPInfo(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TPInfo(r, 2).kv_heads(1) for r in range(2)] == [(0, 1), (0, 1)]
    assert TPInfo(2, 3).kv_heads(3) == (2, 1)
    # 511 tokens over 2 ranks: shards of 256 rows, the last one padded by a row.
    assert [TPInfo(r, 2).vocab_shard(511) for r in range(2)] == [(0, 256), (256, 256)]


def test_lazy_slices_read_only_the_shard(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from radixlm.runtime.models.weights.loading import copy_weight, narrow

    w = torch.arange(24.0).view(4, 6)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert torch.equal(narrow(f.get_slice("w"), 0, 2, 2), w[2:4])
        assert torch.equal(narrow(f.get_slice("w"), 1, 3, 3), w[:, 3:6])
        whole = torch.empty(4, 6)
        copy_weight(whole, f.get_slice("w"))
        assert torch.equal(whole, w)


def test_formats_that_do_not_shard_are_refused_clearly():
    with pytest.raises(ValueError, match="not supported with tp_size > 1"):
        Linear(64, 32, quant=QuantConfig("awq", bits=4, group_size=32),
               shard=LinearShard(in_start=0))


def test_tp_options_are_validated():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp_size"):
            Engine(tp_size=bad)
    with pytest.raises(ValueError, match="tp_timeout"):
        Engine(tp_size=2, tp_timeout=0)
    with pytest.raises(ValueError, match="tp_all_reduce"):
        Engine(tp_size=2, tp_all_reduce="mpi")


@pytest.mark.parametrize("family, overrides, tp_options", [
    # GQA with one KV head (replicated on both ranks), untied head, odd vocabulary.
    ("llama", dict(vocab_size=511, num_key_value_heads=1, tie=False), {}),
    # Tied embeddings, QKV bias; overlap scheduling (token ids broadcast as they are).
    ("qwen2", dict(vocab_size=512, num_key_value_heads=2, tie=True),
     dict(overlap_schedule="on")),
    # Gemma 2 through the CPU kernel: each rank's attention and MLP sums reduced before
    # the norms that follow them; soft caps on the scores and the logits.
    ("llama", dict(vocab_size=512, tie=True, **NEW_FAMILIES["gemma2"]), {}),
])
def test_tp2_greedy_matches_tp1(tmp_path, family, overrides, tp_options):
    overrides = dict(overrides)
    folder = save_tiny_hf_model(tmp_path, family, vocab_size=overrides.pop("vocab_size"),
                                tie=overrides.pop("tie"), **overrides)
    # Plain greedy steps gather each rank's argmax; a penalty or logprobs need the whole
    # logits gathered (min_new_tokens switches a request over after a few steps).
    other = [dict(GREEDY, repetition_penalty=1.3), dict(GREEDY, logprobs=True),
             dict(GREEDY, min_new_tokens=4)]

    def run(engine: Engine) -> tuple[list[list[int]], list[list[int]], list]:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=other)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        return (_greedy(engine, PROMPTS), [o.token_ids for o in outs],
                [entry[1] for entry in outs[1].logprobs])

    with Engine(str(folder), **_options()) as engine:
        expected, expected_other, expected_logprobs = run(engine)
        # On one rank the CPU kernel holds the float weights as tiles (buffers).
        full = sum(t.numel() for name, t in [*engine.core.runner.model.named_parameters(),
                                             *engine.core.runner.model.named_buffers()]
                   if "rotary" not in name)
    with Engine(str(folder), **_options(tp_size=2, **tp_options)) as engine:
        model = engine.core.runner.model
        calls = {"greedy_tokens": 0, "compute_logits": 0}
        for name in calls:
            def counted(hidden, name=name, method=getattr(model, name)):
                calls[name] += 1
                return method(hidden)
            setattr(model, name, counted)
        greedy, tokens, logprobs = run(engine)
        assert greedy == expected and tokens == expected_other
        assert len(logprobs) == 10 and logprobs == pytest.approx(expected_logprobs, abs=1e-4)
        assert calls["greedy_tokens"] >= 9 and calls["compute_logits"] >= 9, calls
        # Rank 0 holds its shard only: well under the whole model.
        shard = sum(p.numel() for p in engine.core.runner.model.model.parameters())
        assert shard < 0.75 * full
        workers = list(engine._tp.workers.values())
        assert len(workers) == 1
        if tp_options:
            assert engine.stats()["overlapped_steps"] > 0
    assert all(p.poll() is not None for p in workers)  # clean shutdown, no orphans


def test_tp2_request_is_the_same_bits_alone_or_in_a_batch(tmp_path):
    """For one TP size a request's tokens and logprobs do not depend on its batch: every
    rank runs the CPU kernel over its shard, and the partial sums are added in rank order.
    Alone on a cold cache against beside others, warm, with chunks cut by a shared budget."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=512)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 45, 23, 60)]
    params = dict(max_new_tokens=12, temperature=0, logprobs=True, top_logprobs_num=3)
    options = dict(_options(tp_size=2, max_num_batched_tokens=32), dtype="bfloat16")
    with Engine(str(folder), **options) as engine:
        assert isinstance(engine.core.runner.cpu_decode, ShardedKernel)
        alone = []
        for prompt in prompts:
            engine.flush_cache()
            alone.extend(engine.generate(input_ids=[prompt], sampling_params=params))
        others = [prompts[1][:30] + [9, 9, 9], [5] * 40, prompts[3][:50]]
        outs = engine.generate(input_ids=others[:2] + prompts + others[2:],
                               sampling_params=params)[2:6]
    assert outs[3].cached_tokens > 0  # the last prompt run alone is still cached
    for one, batched in zip(alone, outs):
        assert batched.token_ids == one.token_ids
        assert batched.logprobs == one.logprobs  # exact floats, top alternatives included


def test_tp4_greedy_matches_tp1(tmp_path):
    """Four ranks: one query head each, and the two KV heads replicated over pairs of
    ranks (the shape a 70B model has at TP=8 over its 8 KV heads, scaled down)."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=510, tie=True)
    with Engine(str(folder), **_options()) as engine:
        expected = _greedy(engine, PROMPTS)
    with Engine(str(folder), **_options(tp_size=4)) as engine:
        assert _greedy(engine, PROMPTS) == expected
        workers = list(engine._tp.workers.values())
        assert len(workers) == 3
    assert all(p.poll() is not None for p in workers)


def test_tp2_draft_model_matches_tp1_and_int8_runs(tmp_path):
    """The draft model runs whole on rank 0. int8 linears shard like float ones; each rank
    quantizes its own shard (row-parallel layers get per-shard scales), so int8 at TP=2 is
    close to, not identical with, int8 at TP=1: here it only has to run."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=512)
    with Engine(str(folder), **_options()) as engine:
        expected = _greedy(engine, PROMPTS)
    with Engine(str(folder), **_options(tp_size=2, speculative="draft",
                                        draft_model=str(folder))) as engine:
        assert _greedy(engine, PROMPTS) == expected
        assert engine.stats()["spec_accepted_tokens"] > 0
    with Engine(str(folder), **_options(tp_size=2, quantization="int8")) as engine:
        assert all(len(ids) == GREEDY["max_new_tokens"] for ids in _greedy(engine, PROMPTS))


def test_shapes_that_do_not_shard_fail_at_startup_with_no_workers_left(tmp_path):
    # The default model: 9 heads, 3 KV heads, 1536 MLP columns.
    assert valid_tp_sizes(9, 3, 1536) == [1, 3]
    assert valid_tp_sizes(32, 8, 14336, limit=8) == [1, 2, 4, 8]
    assert valid_tp_sizes(4, 1, 128, limit=4) == [1, 2, 4]  # one KV head, replicated
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=512)  # 4 heads, 2 KV heads
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"4 attention heads.*sizes that do: 1, 2, 4"):
        Engine(str(folder), **_options(tp_size=3))
    assert time.monotonic() - start < 30
    assert not torch.distributed.is_initialized()


def test_default_model_tp3_matches_tp1(default_model_folder):
    """SmolLM2-135M: 9 heads and 3 KV heads, one of each per rank at TP=3."""
    params = {"max_new_tokens": 8, "temperature": 0}
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 253, 2630, 314, 9538, 28]]
    with Engine(str(default_model_folder), **_options()) as engine:
        expected = _greedy(engine, prompts, params)
    with Engine(str(default_model_folder), **_options(tp_size=3)) as engine:
        assert _greedy(engine, prompts, params) == expected
        workers = list(engine._tp.workers.values())
    assert len(workers) == 2 and all(p.poll() is not None for p in workers)


def generation_when_a_rank_dies(engine: Engine, rank: int):
    """The output of a long generation during which `rank`'s worker is killed; fails if the
    generation hangs."""
    results: list = []
    long = {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}
    runner = threading.Thread(target=lambda: results.append(
        engine.generate(input_ids=[1, 2, 3], sampling_params=long)))
    runner.start()
    time.sleep(0.5)
    engine._tp.workers[rank].kill()
    runner.join(timeout=60)
    assert not runner.is_alive(), f"the request hung after rank {rank} died"
    return results[0]


def test_lost_rank_fails_requests_without_hanging(tmp_path):
    """Speculation (n-gram, host-side on rank 0) runs unchanged on TP=2; then a worker is
    killed in the middle of a long generation: the request ends with an error, later ones
    fail at once, and close() returns."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=512)
    with Engine(str(folder), **_options()) as engine:
        expected = _greedy(engine, PROMPTS)
    engine = Engine(str(folder), **_options(tp_size=2, speculative="ngram"))
    try:
        assert _greedy(engine, PROMPTS) == expected
        out = generation_when_a_rank_dies(engine, 1)
        assert out.finish_reason == "abort" and "tensor-parallel" in out.error
        later = engine.generate(input_ids=[1, 2], sampling_params=GREEDY)
        assert later.finish_reason == "abort" and "tensor-parallel" in later.error
    finally:
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 30
    assert not torch.distributed.is_initialized()


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an orphan's zombie may linger
    unreaped in a container whose init does not reap)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_killed_engine_process_leaves_no_workers(tmp_path):
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=512)
    script = (f"import time\nfrom radixlm.runtime.engine.engine import Engine\n"
              f"e = Engine({str(folder)!r}, device='cpu', max_total_tokens=1024, tp_size=2)\n"
              f"print(e._tp.workers[1].pid, flush=True)\ntime.sleep(120)\n")
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(engine.stdout.readline())
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 15
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(worker)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_deterministic_tp2_on_two_gpus_gives_a_request_the_same_bits_in_any_batch(tmp_path):
    """deterministic=True with tp_size=2: each rank's shard runs the batch-invariant kernels
    and the partial sums are added in rank order (the "ordered" all-reduce), so a request's
    tokens and logprobs are the same alone and inside batches of other requests, with the
    decode steps in CUDA graphs. Run on the GPU machine: `pytest -m gpu`."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=511, num_key_value_heads=2)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": True,
              "top_logprobs_num": 5}
    target = [5 + i % 97 for i in range(150)]
    with Engine(str(folder), tp_size=2, device="cuda", dtype="bfloat16", deterministic=True,
                max_total_tokens=8192) as engine:
        assert active_all_reduce() == "ordered"
        alone = engine.generate(input_ids=target, sampling_params=params)
        rng = random.Random(0)
        for size in (3, 17):
            engine.flush_cache()
            batch = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 300))]
                     for _ in range(size)]
            place = rng.randint(0, size)
            batch.insert(place, target)
            out = engine.generate(input_ids=batch, sampling_params=params)[place]
            assert out.token_ids == alone.token_ids
            assert ([(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs]
                    == [(lp.token_id, lp.logprob, lp.top) for lp in alone.logprobs])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_two_gpus_matches_tp1(tmp_path):
    """Ranks on cuda:0 and cuda:1, fp32: with the decode steps in CUDA graphs (symmetric-memory
    all-reduces captured in them), and eagerly (the second engine of the process: NCCL
    all-reduces). Run on the GPU machine: `pytest -m gpu`."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=511, num_key_value_heads=1)
    options = dict(dtype="float32", device="cuda", max_total_tokens=4096)
    with Engine(str(folder), **options) as engine:
        expected = _greedy(engine, PROMPTS)
    with Engine(str(folder), tp_size=2, **options) as engine:
        assert engine.core.runner.cuda_graphs is not None  # every rank replays its graphs
        assert active_all_reduce() == "symmetric"
        assert _greedy(engine, PROMPTS) == expected
        assert engine.stats()["overlapped_steps"] > 0
    with Engine(str(folder), tp_size=2, disable_cuda_graph=True, **options) as engine:
        assert _greedy(engine, PROMPTS) == expected
    with pytest.raises(RuntimeError, match="fresh process"):  # NCCL in graphs: the fence
        Engine(str(folder), tp_size=2, **options)


def test_nccl_in_graphs_after_another_cuda_engine_is_refused(monkeypatch):
    """The fence for the hang in docs/distributed.md: NCCL all-reduces captured in CUDA graphs
    are refused once the process has built a CUDA engine; symmetric memory, eager steps and
    the first CUDA engine of a process are not. CPU engines do not count."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(groups, "_cuda_engine_built", False)
    groups.check_nccl_in_graphs("nccl", True, cpu)
    groups.check_nccl_in_graphs("nccl", True, cuda)  # the process's first CUDA engine
    for mode, graphs in (("symmetric", True), ("nccl", False), ("none", True)):
        groups.check_nccl_in_graphs(mode, graphs, cuda)
    with pytest.raises(RuntimeError, match="fresh process.*disable_cuda_graph=True"):
        groups.check_nccl_in_graphs("nccl", True, cuda)


def generate_over_http(url: str, prompts: list[list[int]], params: dict) -> list[list[int]]:
    """Each prompt's output ids from a server's native /generate route, one at a time."""
    import json
    import urllib.request

    outputs = []
    for prompt in prompts:
        body = {"input_ids": prompt, "sampling_params": params}
        request = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            outputs.append(json.loads(response.read())["output_ids"])
    return outputs


def test_two_nodes_on_the_loopback_match_tp1(tmp_path):
    """The multi-machine recipe of docs/distributed.md, with two "nodes" launched apart on the
    loopback interface: node 0 runs `radixlm serve` (rank 0, RADIXLM_TP_EXTERNAL_WORKERS=1) and
    its local worker (rank 1); node 1 runs ranks 2 and 3 as their own launch, with their own
    LOCAL_RANK. Greedy output over HTTP equals TP=1's."""
    from radixlm.backends.server_process import ServerProcess
    from radixlm.runtime.distributed.groups import free_port

    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=510, tie=True)
    with Engine(str(folder), **_options()) as engine:
        expected = _greedy(engine, PROMPTS)
    every_node = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                  "GLOO_SOCKET_IFNAME": "lo", "RADIXLM_TP_TIMEOUT": "60"}
    worker = [sys.executable, "-m", "radixlm.runtime.parallel.worker"]

    def launch(rank: int, local_rank: int) -> subprocess.Popen:
        env = {**os.environ, **every_node, "WORLD_SIZE": "4", "RANK": str(rank),
               "LOCAL_RANK": str(local_rank)}
        return subprocess.Popen(worker, env=env, stdin=subprocess.DEVNULL)

    node0_worker = launch(1, 1)
    node1 = [launch(2, 0), launch(3, 1)]
    workers = [node0_worker, *node1]
    server = ServerProcess(["--model", str(folder), "--tp", "4", "--dtype", "float32",
                            "--device", "cpu", "--max-total-tokens", "4096"],
                           env={**every_node, "RADIXLM_TP_EXTERNAL_WORKERS": "1"})
    try:
        with server:
            assert generate_over_http(server.url, PROMPTS, GREEDY) == expected
        # The server's shutdown stops every rank, those of the other "node" too.
        for proc in workers:
            assert proc.wait(timeout=30) == 0
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- vocab-parallel argmax -----------------------------------------------------------------------

VOCAB, HIDDEN, RANKS = 500, 8, 3  # shards of 167 ids; the last one padded by a row


def _head_and_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """An output head whose maxima tie across and within shards, and hidden rows to score:
    row 0's maximum at ids 10, 200 and 499 (three shards), row 1's at 201 and 350, row 2's at
    167 and 334 (each the first id of a shard), and row 3 with every logit negative, below the
    zero that an unmasked padding row would score."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    weight[:, 0] = weight[:, 0].abs() + 1
    rows = torch.zeros(4, HIDDEN)
    for row, ids in enumerate(([10, 200, 499], [201, 350], [167, 334])):
        direction = torch.zeros(HIDDEN)
        direction[0], direction[row + 1] = 1.0, 3.0
        rows[row] = direction
        weight[ids] = 40 * direction
    rows[3, 0] = -10.0
    return weight, rows


def _soft_cap(logits: torch.Tensor) -> torch.Tensor:
    return torch.tanh(logits / 5) * 5  # saturates: near-maxima become exact ties


def _greedy_rank(rank: int, port: int, out: str, dtype: torch.dtype) -> None:
    from radixlm.runtime.distributed.groups import destroy_group, init_group
    from radixlm.runtime.models.layers.embedding import VocabEmbedding

    tp = init_group(rank, RANKS, "gloo", 60, {"MASTER_ADDR": "127.0.0.1",
                                                "MASTER_PORT": str(port),
                                                "GLOO_SOCKET_IFNAME": "lo"})
    try:
        weight, rows = _head_and_rows()
        head = VocabEmbedding(VOCAB, HIDDEN, dtype, tp)
        head.weight_loader(head.weight, weight)
        rows = rows.to(dtype)
        tokens = [head.greedy(rows), head.greedy(rows, _soft_cap)]
        if rank == 0:
            torch.save(tokens, out)
    finally:
        destroy_group()


def _ordered_rank(rank: int, port: int, out: str) -> None:
    from radixlm.runtime.distributed.groups import (
        all_reduce,
        destroy_group,
        init_group,
        setup_all_reduce,
    )

    init_group(rank, RANKS, "gloo", 60, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                         "GLOO_SOCKET_IFNAME": "lo"})
    try:
        assert setup_all_reduce("ordered", 0, torch.bfloat16, torch.device("cpu")) == "ordered"
        rows = _partials()[rank]
        whole = all_reduce(rows.clone())
        alone = [all_reduce(rows[i:i + 1].clone()) for i in (0, 5, 37)]
        if rank == 0:
            torch.save([whole, alone], out)
    finally:
        destroy_group()


def _partials() -> torch.Tensor:
    """Every rank's partial sums [ranks, 40, 64], bfloat16, of mixed magnitudes."""
    gen = torch.Generator().manual_seed(3)
    scale = torch.logspace(-3, 3, 64)
    return (torch.randn(RANKS, 40, 64, generator=gen) * scale).bfloat16()


def test_ordered_all_reduce_adds_the_ranks_in_order_whatever_the_rows():
    """Deterministic mode's all-reduce (setup_all_reduce "ordered", the one CUDA tensor
    parallelism takes with deterministic=True): every rank's partials gathered and added in
    rank order in float32, rounded once; a row's sum is the same alone as among 40."""
    from radixlm.runtime.distributed.groups import free_port

    parts = _partials()
    want = parts[0].float()
    for part in parts[1:]:
        want += part
    want = want.bfloat16()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "sums.pt")
        torch.multiprocessing.spawn(_ordered_rank, args=(free_port(), out), nprocs=RANKS)
        whole, alone = torch.load(out)
    assert torch.equal(whole, want)
    for index, row in zip((0, 5, 37), alone):
        assert torch.equal(row[0], whole[index])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_greedy_is_the_argmax_of_the_gathered_logits(tmp_path, dtype):
    """Each rank's (max, index) pairs give torch.argmax's pick over the whole vocabulary of
    the float32 logits: the first of tied maxima across and within shards, never a padding
    id, and the same after an elementwise cap that creates ties. In bfloat16 the plain argmax
    reads the head's own output, the capped one its float32 widening."""
    from radixlm.runtime.distributed.groups import free_port
    from radixlm.runtime.models.layers.embedding import VocabEmbedding

    weight, rows = _head_and_rows()
    logits = (rows.to(dtype) @ weight.to(dtype).t()).float()
    expected = [logits.argmax(-1), _soft_cap(logits).argmax(-1)]
    assert expected[0][:3].tolist() == [10, 201, 167]
    assert (logits[3] < 0).all() and (_soft_cap(logits) == 5).sum() > 3
    single = VocabEmbedding(VOCAB, HIDDEN, dtype)
    single.weight_loader(single.weight, weight)
    assert [single.greedy(rows.to(dtype)).tolist(),
            single.greedy(rows.to(dtype), _soft_cap).tolist()] == [e.tolist() for e in expected]

    out = str(tmp_path / "tokens.pt")
    torch.multiprocessing.spawn(_greedy_rank, args=(free_port(), out, dtype), nprocs=RANKS)
    assert [t.tolist() for t in torch.load(out)] == [e.tolist() for e in expected]
