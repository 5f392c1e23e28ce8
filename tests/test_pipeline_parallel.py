"""Pipeline parallelism on CPU with gloo: stages split the layers, each family's stages chained
compute the same bits as the whole model, and an engine over 2 or 3 stage processes (with
tensor parallelism inside a stage, too) gives the same tokens and logprobs as one process,
with batches of different requests in flight in the stages at once.

Each pipelined engine starts worker processes (a few seconds each on CI's two cores), so the
tests share engines across assertions and keep the launches few.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_tensor_parallel import generate_over_http, generation_when_a_rank_dies

from radixlm.runtime.attention import create_backend
from radixlm.runtime.attention.backend import ForwardBatch
from radixlm.runtime.attention.kv_cache import KVCache
from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.distributed.groups import split_layers
from radixlm.runtime.engine.engine import Engine
from radixlm.runtime.models.loader import load_model
from radixlm.runtime.scheduling.kv_manager import TierLoad
from radixlm.runtime.scheduling.pages import ReqToTokenTable
from radixlm.runtime.scheduling.request import Request
from radixlm.runtime.scheduling.scheduler import Scheduler

from conftest import save_tiny_hf_model
from test_model_families import save_family

CPU = torch.device("cpu")


def test_layers_split_into_stages_and_options_are_checked():
    assert split_layers(30, 3) == [(0, 10), (10, 20), (20, 30)]
    # The remainder goes to the last stages: the first also embeds and scores.
    assert split_layers(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert split_layers(4, 1) == [(0, 4)]
    with pytest.raises(ValueError, match="pp_size"):
        split_layers(2, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pp_size"):
            EngineConfig(pp_size=bad)
    for clash, words in ((dict(speculative="ngram"), "speculative"),
                         (dict(lora_modules=("a=/x",)), "lora_modules"),
                         (dict(overlap_schedule="on"), "overlap_schedule"),
                         (dict(disk_cache_dir="/tmp/x"), "disk_cache_dir")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(pp_size=2, **clash)


def _run_stages(stages: list, ids: list[int], chunks: list[int], device: torch.device = CPU,
                dtype: torch.dtype = torch.float32, backend: str = "torch") -> torch.Tensor:
    """One sequence through the stages chunk by chunk, each stage with its own KV cache
    over the same slots; the logits the first stage's head gives for the last stage's
    output."""
    page_size = 4
    table = ReqToTokenTable(1, 256, page_size, device)
    row = table.acquire()
    table.write_pages(row, 0, list(range(63, 0, -2))[: -(-len(ids) // page_size)])
    caches = [KVCache(len(s.config.held_layers), 256, s.config.num_kv_heads, s.config.head_dim,
                      dtype, device, page_size) for s in stages]
    attn = create_backend(backend, scale=stages[0].config.head_dim ** -0.5, device=device,
                          dtype=dtype, head_dim=stages[0].config.head_dim)
    logits, start = [], 0
    for size in chunks:
        end = start + size
        hidden = None
        for stage, cache in zip(stages, caches):
            batch = ForwardBatch(input_ids=torch.tensor(ids[start:end], device=device),
                                 positions=torch.arange(start, end, device=device),
                                 q_lens=[size],
                                 kv_lens=[end], out_slots=table.table[row, start:end],
                                 slot_table=table.table[row:row + 1, :end], kv_cache=cache)
            attn.plan(batch)
            with torch.inference_mode():
                hidden = stage.model(batch, attn, hidden)
        logits.append(stages[0].model.compute_logits(hidden))
        start = end
    return torch.cat(logits)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2-moe", "qwen2-window"])
def test_stages_chained_compute_the_whole_models_bits(tmp_path, family):
    """Each stage builds and loads only its layers (and the first alone the embedding and
    head); chained, they give the whole model's logits bit for bit. The families where a
    layer's index matters: Gemma 3's local and global layers, Qwen2-MoE's dense layer among
    sparse ones, Qwen2's windows from max_window_layers up."""
    if family == "llama":
        folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=511, tie=False,
                                    num_hidden_layers=3)
    else:
        folder = save_family(tmp_path, family, tie=family.startswith("gemma"),
                             num_hidden_layers=3)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [17, 1, 20, 1, 1]
    whole = load_model(str(folder), "auto", torch.float32, CPU)
    expected = _run_stages([whole], ids, chunks)
    for ranges in ([(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]):
        stages = [load_model(str(folder), "auto", torch.float32, CPU, layer_range=r)
                  for r in ranges]
        assert [len(s.model.model.layers) for s in stages] == [b - a for a, b in ranges]
        # Only the first stage holds the vocabulary-sized weights.
        assert all(s.model.model.embed_tokens.weight.numel() == 0 for s in stages[1:])
        assert torch.equal(_run_stages(stages, ids, chunks), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stages_on_cuda_with_the_fused_kernels_compute_the_whole_models_bits(tmp_path):
    """On CUDA the Llama module carries the residual stream through fused add + RMSNorm
    kernels; a stage hands on their sum (rounded as the fused add rounds it), so chained
    stages in bfloat16 give the whole model's logits bit for bit."""
    cuda = torch.device("cuda")
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=511, num_hidden_layers=4,
                                hidden_size=256, intermediate_size=512)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [17, 1, 20, 1, 1]
    whole = load_model(str(folder), "auto", torch.bfloat16, cuda)
    assert whole.model.fused is not None  # the fused path is what this checks
    expected = _run_stages([whole], ids, chunks, cuda, torch.bfloat16, "triton")
    stages = [load_model(str(folder), "auto", torch.bfloat16, cuda, layer_range=r)
              for r in [(0, 1), (1, 3), (3, 4)]]
    assert torch.equal(_run_stages(stages, ids, chunks, cuda, torch.bfloat16, "triton"),
                       expected)


def _outputs(engine: Engine, params: list[dict], **prompts) -> list:
    outs = engine.generate(**prompts, sampling_params=params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(o.token_ids, None if o.logprobs is None else [entry[1] for entry in o.logprobs])
            for o in outs]


def _pages_accounted(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


def test_default_model_stages_give_one_process_bits():
    """The default model on its default path (GGUF blocks, bfloat16, the CPU kernel) over
    2 and 3 stage processes: the same tokens and logprobs, bit for bit, as one process, for
    prompts that share prefixes (cache hits), are prefilled in chunks, and sample with
    seeds; batches of different requests are in the stages at once."""
    texts = ["The capital of France is", "def fib(n):", "Once upon a time, in a land far",
             "The capital of France is a city", "List three colors:", "2 + 2 ="]
    greedy = {"max_new_tokens": 12, "temperature": 0, "logprobs": True}
    seeded = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7}
    params = [greedy, seeded] * 3
    options = dict(chunked_prefill_size=8, max_num_batched_tokens=24, tp_timeout=60)
    with Engine(None, **options) as engine:
        expected = _outputs(engine, params, prompt=texts)
    for pp in (2, 3):
        with Engine(None, pp_size=pp, **options) as engine:
            assert _outputs(engine, params, prompt=texts) == expected
            stats = engine.stats()
            assert stats["pipelined_steps"] > 0  # launched while another was in flight
            _pages_accounted(engine)
            assert len(engine.core.runner.model.model.model.layers) == 30 // pp


def test_tp3_by_pp2_matches_tp3_and_a_lost_stage_fails_requests(tmp_path):
    """Six processes: two stages of three tensor-parallel ranks, float32, an untied head over
    an odd vocabulary (vocab-parallel on stage 0), with penalties and logprobs (every
    rank's logits gathered): the same bits as tensor parallelism alone. Then a rank of the
    last stage is killed mid-generation: the request ends with an error, close() returns."""
    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=511, num_attention_heads=6,
                                num_key_value_heads=3, hidden_size=96, intermediate_size=192,
                                tie=False, num_hidden_layers=3)
    prompts = [[1, 5, 9, 33, 7], [1] + list(range(100, 140)), [1, 300, 301, 302], [1, 2]]
    params = [{"max_new_tokens": 10, "temperature": 0},
              {"max_new_tokens": 10, "temperature": 0, "repetition_penalty": 1.3},
              {"max_new_tokens": 10, "temperature": 0, "logprobs": True},
              {"max_new_tokens": 10, "temperature": 0, "min_new_tokens": 4}]
    options = dict(dtype="float32", device="cpu", max_total_tokens=4096, tp_timeout=30)

    def run(engine: Engine) -> list:
        return _outputs(engine, params, input_ids=prompts)

    with Engine(str(folder), **options) as engine:
        alone = run(engine)
    with Engine(str(folder), tp_size=3, **options) as engine:
        expected = run(engine)
    assert [o[0] for o in expected] == [o[0] for o in alone]
    engine = Engine(str(folder), tp_size=3, pp_size=2, **options)
    try:
        assert run(engine) == expected
        _pages_accounted(engine)
        out = generation_when_a_rank_dies(engine, 5)
        assert out.finish_reason == "abort" and "rank 5" in out.error
    finally:
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 30
    assert not torch.distributed.is_initialized()


class _Pages:
    """A KV manager with room for everything (the scheduler's cut is what is tested)."""

    page_size = 16
    cache = None
    available_pages = 1 << 20
    loading = False

    def grow(self, request, tokens):
        return True

    def attach(self, request):
        return True

    def start_load(self, request, wait_for_room=False):
        return TierLoad.NONE

    def match(self, request):
        return 0


def test_scheduler_cuts_batches_for_the_stages_and_skips_busy_requests():
    scheduler = Scheduler(EngineConfig(schedule_policy="fcfs"), _Pages())
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4), frozenset(), None,
                        lambda out: None) for i in range(7)]
    for request in requests:
        scheduler.add(request)
    first = scheduler.schedule(frozenset(), shares=2)
    assert len(first.requests) == 4  # ceil(7 / 2)
    second = scheduler.schedule(set(first.requests), shares=2)
    assert len(second.requests) == 3 and not set(second.requests) & set(first.requests)
    assert scheduler.schedule(set(requests), shares=2) is None  # everything is in flight
    whole = scheduler.schedule()
    assert len(whole.requests) == 7


def test_a_server_with_a_hand_started_stage_matches_one_process(tmp_path):
    """The multi-machine recipe of docs/distributed.md for a pipeline: `radixlm serve --pp 2`
    as rank 0 with RADIXLM_TP_EXTERNAL_WORKERS=1, and the second stage's rank started by
    hand with RADIXLM_PP_SIZE; greedy output over HTTP equals one process's, and stopping
    the server stops the hand-started rank."""
    import os
    import subprocess
    import sys

    from radixlm.backends.server_process import ServerProcess
    from radixlm.runtime.distributed.groups import free_port

    folder = save_tiny_hf_model(tmp_path, "qwen2", vocab_size=512, tie=True,
                                num_hidden_layers=3)
    prompts = [[1, 5, 9, 33, 7], [1] + list(range(100, 140))]
    greedy = {"max_new_tokens": 10, "temperature": 0}
    with Engine(str(folder), dtype="float32", device="cpu", max_total_tokens=4096) as engine:
        expected = [o.token_ids for o in engine.generate(input_ids=prompts,
                                                         sampling_params=greedy)]
    every = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
             "GLOO_SOCKET_IFNAME": "lo", "RADIXLM_TP_TIMEOUT": "60", "RADIXLM_PP_SIZE": "2"}
    worker = subprocess.Popen(
        [sys.executable, "-m", "radixlm.runtime.parallel.worker"],
        env={**os.environ, **every, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"},
        stdin=subprocess.DEVNULL)
    server = ServerProcess(["--model", str(folder), "--pp", "2", "--dtype", "float32",
                            "--device", "cpu", "--max-total-tokens", "4096"],
                           env={**every, "RADIXLM_TP_EXTERNAL_WORKERS": "1"})
    try:
        with server:
            assert generate_over_http(server.url, prompts, greedy) == expected
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_ranks_placed_by_ray_match_one_process(tmp_path):
    """distributed_executor_backend="ray": rank 1 (the second stage) is a Ray actor on a
    local cluster, watched through the same poll/wait/kill as a process; the output is one
    process's, and closing the engine stops the actor and frees its placement."""
    ray = pytest.importorskip("ray")
    from radixlm.runtime.parallel.ray_workers import RayRank

    folder = save_tiny_hf_model(tmp_path, "llama", vocab_size=511, num_hidden_layers=3)
    prompts = [[1, 5, 9, 33, 7], [1] + list(range(100, 140))]
    greedy = {"max_new_tokens": 10, "temperature": 0}
    options = dict(dtype="float32", device="cpu", max_total_tokens=4096, tp_timeout=60)
    with Engine(str(folder), **options) as engine:
        expected = _outputs(engine, [greedy] * 2, input_ids=prompts)
    started = ray.is_initialized()
    try:
        with Engine(str(folder), pp_size=2, distributed_executor_backend="ray",
                    **options) as engine:
            rank = engine._tp.workers[1]
            assert isinstance(rank, RayRank) and rank.poll() is None
            assert _outputs(engine, [greedy] * 2, input_ids=prompts) == expected
        assert rank.wait(30) == 0
        deadline = time.monotonic() + 20  # Ray frees a removed group's resources shortly after
        while (ray.available_resources().get("CPU") != ray.cluster_resources().get("CPU")
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU")
    finally:
        if not started:
            ray.shutdown()
