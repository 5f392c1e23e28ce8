"""The prefix cache's disk tier: prefixes found again after a restart with the same tokens as
computing them; corrupt, truncated and foreign files skipped (never loaded as KV); a full disk,
a killed writer's leftovers and two writers on one folder harmless; the budget kept; page
accounting intact."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.scheduling.disk_tier import DiskTier, model_key
from radixlm.runtime.scheduling.host_tier import HostTier

from conftest import save_tiny_chat_model

DOC = "A radix tree shares the prefixes of the sequences it holds. " * 12
PROMPTS = [DOC + "Q: what does it share?", DOC + "Q: why?"]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


def assert_pages_add_up(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]


def run(model: Path, folder: Path | None, prompts=PROMPTS, **options):
    """(token ids of each output, the engine's stats) of a fresh engine."""
    extra = {} if folder is None else {"disk_cache_dir": str(folder), **options}
    with Engine(str(model), max_total_tokens=4096, **extra) as engine:
        outs = engine.generate(prompts, GREEDY)
        assert_pages_add_up(engine)
        return [o.token_ids for o in outs], [o.cached_tokens for o in outs], engine.stats()


def files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.kv"))


def test_a_restarted_engine_loads_its_prefixes_with_the_same_tokens(tiny_chat_model,
                                                                    tmp_path):
    reference, _, _ = run(tiny_chat_model, None)
    first, _, stats = run(tiny_chat_model, tmp_path, PROMPTS[:1])
    assert first == reference[:1] and stats["disk_store_bytes"] > 0
    assert stats["disk_hit_tokens"] == 0 and files(tmp_path)
    again, cached, stats = run(tiny_chat_model, tmp_path)
    assert again == reference  # loaded KV gives the tokens computed KV gives
    assert stats["disk_hit_tokens"] > 0 and cached[0] >= stats["disk_hit_tokens"]
    assert stats["disk_bad_files"] == 0


def test_bad_files_are_skipped_never_loaded(tiny_chat_model, tmp_path, caplog):
    reference, _, _ = run(tiny_chat_model, tmp_path, PROMPTS[:1])
    kept = files(tmp_path)
    for i, path in enumerate(kept):  # whichever comes first in the prefix is bad
        data = bytearray(path.read_bytes())
        if i % 3 == 0:
            data = data[:100]  # truncated
        elif i % 3 == 1:
            data[-1] ^= 0xFF  # one bit of KV flipped
        else:
            data = bytearray(b"not a page at all")
        path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.scheduling.disk_tier"):
        again, _, stats = run(tiny_chat_model, tmp_path, PROMPTS[:1])
    assert again == reference
    assert stats["disk_hit_tokens"] == 0 and stats["disk_bad_files"] >= 1
    assert "corrupt" in caplog.text
    again, _, stats = run(tiny_chat_model, tmp_path, PROMPTS[:1])  # bad pages rewritten
    assert again == reference and stats["disk_hit_tokens"] > 0


def test_another_models_files_are_never_looked_at(tiny_chat_model, tmp_path,
                                                  tmp_path_factory, default_model_folder):
    run(tiny_chat_model, tmp_path, PROMPTS[:1])
    other = save_tiny_chat_model(tmp_path_factory.mktemp("other"), default_model_folder)
    torch.manual_seed(7)  # same architecture and tokenizer, other weights
    from safetensors.torch import load_file, save_file

    weights = next(other.glob("*.safetensors"))
    tensors = {k: torch.randn_like(v) if v.is_floating_point() else v
               for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    _, _, stats = run(other, tmp_path, PROMPTS[:1])
    assert stats["disk_hit_tokens"] == 0 and len(list(tmp_path.iterdir())) == 2


def _tier(folder: Path, max_bytes: int = 1 << 30, slots: int = 64) -> DiskTier:
    k = torch.randn(2, slots, 2, 4)
    v = torch.randn(2, slots, 2, 4)
    return DiskTier(folder, "m", k, v, page_size=4, max_bytes=max_bytes)


def test_a_full_disk_skips_pages_and_warns(tmp_path, monkeypatch, caplog):
    tier = _tier(tmp_path)
    names = tier.chain(list(range(16)), 4)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.scheduling.disk_tier"):
        tier.store(names, [0, 1, 2, 3])
        tier.flush()
    assert tier.stats()["disk_store_skipped_pages"] == 4 and "No space" in caplog.text
    monkeypatch.undo()
    assert tier.present(names) == 0 and not list(tmp_path.glob("m/*"))
    tier.close()


def test_the_disk_below_host_memory_writes_from_the_host_slots(tmp_path, monkeypatch):
    """Under a host tier, the disk writes each page from its host slot; a slot the writer
    has not written yet is not reused (a page that finds no slot goes to the disk from the
    KV cache), and every file holds its page's KV."""
    disk = _tier(tmp_path)
    page_bytes = 2 * disk.k[:, :4].numel() * disk.k.element_size()
    host = HostTier(disk.k, disk.v, 4, max_bytes=2 * page_bytes, below=disk)
    names = host.chain(list(range(32)), 8)
    gate = threading.Event()
    write = DiskTier._write_file

    def held(self, *args):
        gate.wait(10)
        write(self, *args)
    monkeypatch.setattr(DiskTier, "_write_file", held)
    host.store(names[:2], [0, 1])
    host.store(names[2:3], [2])  # both slots wait for the writer: the disk takes it alone
    assert host.present(names) == 2 and host.stats()["host_pages"] == 2
    expected = {name: (disk.k[:, page * 4:(page + 1) * 4].clone(),
                       disk.v[:, page * 4:(page + 1) * 4].clone())
                for name, page in zip(names[:3], range(3))}
    disk.k[:, :12] = 0  # the pages are reused by the device: the host slots still hold them
    disk.v[:, :12] = 0
    gate.set()
    host.flush()
    host.store(names[3:4], [3])  # a slot is free to reuse now
    assert host.stats()["host_pages"] == 2 and names[3] in host._slots
    host.flush()
    reader = _tier(tmp_path)
    assert reader.present(names[:3]) == 3
    for i, name in enumerate(names[:3]):
        assert reader.load([name], [i]) == 1
        k, v = expected[name]  # the KV as it was when stored
        assert torch.equal(reader.k[:, i * 4:(i + 1) * 4], k)
        assert torch.equal(reader.v[:, i * 4:(i + 1) * 4], v)
    host.close()
    reader.close()


def test_budget_leftovers_and_two_writers(tmp_path):
    page_file = 2 * 2 * 4 * 2 * 4 * 4 + 50  # K and V of 2 layers, 4 slots; the header
    tier = _tier(tmp_path, max_bytes=3 * page_file)
    names = tier.chain(list(range(64)), 16)
    tier.store(names[:8], list(range(8)))
    tier.flush()
    assert len(files(tmp_path)) <= 3 and tier.stats()["disk_bytes"] <= tier.max_bytes
    assert tier.present(names[5:8]) == 3  # the most recent kept
    tier.close()
    # A writer killed mid-file leaves a temporary: never read, removed once old.
    leftover = tmp_path / "m" / ".dead.123.tmp"
    leftover.write_bytes(b"half a page")
    os.utime(leftover, (0, 0))
    # Two processes on one folder: the same pages written at once, every file whole.
    a, b = _tier(tmp_path), _tier(tmp_path)
    assert not leftover.exists()
    b.k.copy_(a.k)
    b.v.copy_(a.v)
    names = a.chain(list(range(100, 164)), 16)  # (not the pages written above)
    threads = [threading.Thread(target=t.store, args=(names, list(range(16)))) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.flush()
    b.flush()
    reader = _tier(tmp_path)
    assert reader.present(names) == 16
    assert reader.load(names, list(range(16))) == 16
    assert torch.equal(reader.k, a.k) and torch.equal(reader.v, a.v)
    for t in (a, b, reader):
        t.close()


def test_the_model_key_names_the_weights_and_the_kv_layout():
    model = torch.nn.Linear(8, 8)
    key = model_key(model, torch.bfloat16, 16)
    assert key == model_key(model, torch.bfloat16, 16)
    assert key != model_key(model, torch.float8_e4m3fn, 16)
    assert key != model_key(model, torch.bfloat16, 32)
    with torch.no_grad():
        model.weight[3, 5] += 1  # one weight (in the sample) changed
    assert key != model_key(model, torch.bfloat16, 16)


def test_options_that_cannot_go_with_a_disk_tier_are_refused(tmp_path):
    from radixlm.runtime.config.engine_config import EngineConfig

    for bad, match in (({"disable_radix_cache": True}, "disable_radix_cache"),
                       ({"disk_cache_gb": 0}, "disk_cache_gb")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(disk_cache_dir=str(tmp_path), **bad)
    for bad, match in (({"host_cache_gb": -1}, "host_cache_gb"),
                       ({"host_cache_gb": float("nan")}, "host_cache_gb"),
                       ({"host_cache_gb": 1, "disable_radix_cache": True}, "disable_radix_cache"),
                       ({"host_cache_gb": 1, "pp_size": 2}, "pp_size")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


def test_pins_and_a_small_pool_work_over_the_tier(tiny_chat_model, tmp_path):
    reference, _, _ = run(tiny_chat_model, tmp_path, PROMPTS[:1])
    with Engine(str(tiny_chat_model), max_total_tokens=4096,
                disk_cache_dir=str(tmp_path)) as engine:
        lease = engine.pin_prefix(DOC)  # a pin's prefix is loaded, not computed
        assert lease is not None and engine.stats()["disk_hit_tokens"] > 0
        engine.release_prefix(lease)
        assert_pages_add_up(engine)
    # A pool barely larger than the request: the loaded pages and the rest share it.
    with Engine(str(tiny_chat_model), max_total_tokens=256, disk_cache_dir=str(tmp_path),
                max_running_requests=1) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs][:1] == reference
        assert engine.stats()["disk_hit_tokens"] > 0
        assert_pages_add_up(engine)


@pytest.mark.parametrize("disk", [False, True])
def test_the_host_tier_gives_the_tokens_a_larger_pool_gives(tiny_chat_model, tmp_path, disk):
    """A pool barely larger than one request, so each prompt evicts the other's prefix: with
    a host tier the evicted pages come back from host memory (above the disk, when there is
    one), and the greedy tokens are those of an engine that computes everything."""
    prompts = [DOC + "Q: what does it share?", "Another document entirely. " * 40 + "Q: and?"]
    reference, _, _ = run(tiny_chat_model, None, prompts * 2)
    extra = {"disk_cache_dir": str(tmp_path)} if disk else {}
    with Engine(str(tiny_chat_model), max_total_tokens=256, max_running_requests=1,
                host_cache_gb=0.01, **extra) as engine:
        outs = [engine.generate(prompt, GREEDY) for prompt in prompts * 2]
        stats = engine.stats()
        assert [o.token_ids for o in outs] == reference
        assert stats["host_hit_tokens"] > 0 and stats["host_store_bytes"] > 0
        assert outs[2].cached_tokens >= stats["host_hit_tokens"] // 2
        assert stats.get("disk_hit_tokens", 0) == 0  # host memory had them all
        assert_pages_add_up(engine)


def test_revisited_documents_come_wholly_from_the_host_tier(tiny_chat_model):
    """Three documents asked again all at once through a pool that holds about one of them
    beside the others' decoding: each waits for room and loads its whole document (none is
    loaded in part and computed for the rest), and the tokens are those of computing."""
    docs = [f"Document {i}: " + f"fact {i} is about topic {i}. " * 30 for i in range(3)]
    first = [doc + "Q: what?" for doc in docs]
    again = [doc + "Q: and why?" for doc in docs]
    reference, _, _ = run(tiny_chat_model, None, first + again)
    with Engine(str(tiny_chat_model), max_total_tokens=512, host_cache_gb=0.01) as engine:
        outs = engine.generate(first, GREEDY) + engine.generate(again, GREEDY)
        assert [o.token_ids for o in outs] == reference
        page = engine.stats()["page_size"]
        doc_tokens = [len(engine.tokenizer.encode(doc)) for doc in docs]
        for out, tokens in zip(outs[3:], doc_tokens):
            assert out.cached_tokens >= tokens // page * page - page, (out.cached_tokens, tokens)
        assert engine.stats()["host_hit_tokens"] > 0
        assert_pages_add_up(engine)


def test_pages_loaded_from_disk_are_kept_in_host_memory(tiny_chat_model, tmp_path):
    """After a restart the document's pages come from the disk, and go to host memory too:
    when the pool evicts them again, the next load comes from host memory."""
    other = "Another document entirely. " * 40 + "Q: and?"
    reference, _, _ = run(tiny_chat_model, None, [PROMPTS[0], other, PROMPTS[0]])
    run(tiny_chat_model, tmp_path, PROMPTS[:1])  # writes the document to the disk
    with Engine(str(tiny_chat_model), max_total_tokens=256, max_running_requests=1,
                disk_cache_dir=str(tmp_path), host_cache_gb=0.01) as engine:
        outs = [engine.generate(prompt, GREEDY) for prompt in (PROMPTS[0], other)]
        from_disk = engine.stats()["disk_hit_tokens"]
        assert from_disk > 0 and engine.stats()["host_hit_tokens"] == 0
        outs.append(engine.generate(PROMPTS[0], GREEDY))
        stats = engine.stats()
        assert stats["disk_hit_tokens"] == from_disk and stats["host_hit_tokens"] > 0
        assert [o.token_ids for o in outs] == reference
        assert_pages_add_up(engine)


def test_tensor_parallel_ranks_keep_their_shares_in_tiers_of_their_own(tiny_chat_model,
                                                                      tmp_path):
    """tp_size=2: each rank writes its shard of every page to its own folder, and loads it
    back after a restart (from the disk, and from host memory after an eviction); a page one
    rank lacks is computed by all. The tokens are those of the same ranks without tiers."""
    other = "Another document entirely. " * 40 + "Q: and?"
    prompts = [PROMPTS[0], other, PROMPTS[0], PROMPTS[1]]
    options = dict(tp_size=2, max_total_tokens=256, max_running_requests=1)
    with Engine(str(tiny_chat_model), **options) as engine:
        reference = [engine.generate(p, GREEDY).token_ids for p in prompts]
    with Engine(str(tiny_chat_model), disk_cache_dir=str(tmp_path), **options) as engine:
        engine.generate(PROMPTS[0], GREEDY)
    assert len([f for f in tmp_path.iterdir() if f.is_dir()]) == 2  # a folder per rank
    with Engine(str(tiny_chat_model), disk_cache_dir=str(tmp_path), host_cache_gb=0.01,
                **options) as engine:
        outs = [engine.generate(p, GREEDY) for p in prompts]
        stats = engine.stats()
        assert [o.token_ids for o in outs] == reference
        assert stats["disk_hit_tokens"] > 0 and stats["host_hit_tokens"] > 0
        assert outs[0].cached_tokens > 0 and outs[2].cached_tokens > 0
        assert_pages_add_up(engine)
        rank0 = engine.core.tier.local.below.folder
    # Rank 1's files gone: rank 0's pages are not used either, and the tokens stay.
    shutil.rmtree(next(f for f in tmp_path.iterdir() if f.is_dir() and f != rank0))
    with Engine(str(tiny_chat_model), disk_cache_dir=str(tmp_path), **options) as engine:
        out = engine.generate(PROMPTS[0], GREEDY)
        assert out.token_ids == reference[0] and out.cached_tokens == 0
        assert_pages_add_up(engine)


def _expected_page(prefix: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The 'KV' a page holds in the simulation below: a function of its whole prefix."""
    seed = hash(prefix) % (1 << 31)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tiers", ["disk", "host", "host over disk"])
@pytest.mark.parametrize("seed", range(3))
def test_kv_manager_over_the_tier_against_a_model(tmp_path, seed, tiers):
    check_tiers_against_a_model(tmp_path, seed, tiers, "cpu")


def check_tiers_against_a_model(tmp_path: Path, seed: int, tiers: str, device: str) -> None:
    """Random requests over a small pool (evictions), restarts (a new tree and tier on the
    same folder; host memory starts empty) where there is a disk: every page in the tree
    always holds the KV of its prefix, whether computed or loaded, and free + cached pages add
    up. The host tier is smaller than the data (its slots are reused)."""
    import random

    from radixlm.runtime.config.sampling_params import SamplingParams
    from radixlm.runtime.scheduling.kv_manager import KVManager, TierLoad
    from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
    from radixlm.runtime.scheduling.radix_cache import RadixCache
    from radixlm.runtime.scheduling.request import Request

    rng = random.Random(seed)
    ps, num_pages, layers = 4, 24 if tiers == "disk" else 12, 2
    k = torch.zeros(layers, num_pages * ps, 1, 2, device=device)
    v = torch.zeros_like(k)
    shape = (layers, ps, 1, 2)
    stems = [[rng.randrange(50) for _ in range(rng.choice((8, 12, 20)))] for _ in range(4)]

    def fresh() -> tuple[KVManager, DiskTier | HostTier]:
        allocator = PageAllocator(num_pages, ps)
        tier = (DiskTier(tmp_path, "sim", k, v, ps, max_bytes=1 << 30)
                if tiers != "host" else None)
        if tiers != "disk":
            page_bytes = 2 * k[:, :ps].numel() * k.element_size()
            tier = HostTier(k, v, ps, max_bytes=12 * page_bytes, below=tier)
        table = ReqToTokenTable(4, num_pages * ps, ps, torch.device("cpu"))
        return KVManager(allocator, table, RadixCache(ps, allocator), tier), tier

    kv, tier = fresh()
    loaded_before = 0
    for step in range(40):
        if rng.random() < 0.15 and tiers != "host":  # a restart: the disk stays
            tier.close()
            kv, tier = fresh()
        tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        request = Request(f"r{step}", tokens, SamplingParams(max_new_tokens=1), frozenset(),
                          None, lambda out: None)
        if kv.start_load(request) is TierLoad.LOADING:  # as the scheduler: wait, then attach
            assert (kv.allocator.num_free + kv.cache.total_pages + kv.loading_pages
                    == num_pages)
            while kv.loading:
                kv.wait_for_a_load(1.0)
                kv.finish_loads()
        assert kv.attach(request)
        assert kv.grow(request, len(tokens))
        for i in range(request.num_tree_pages, len(tokens) // ps):  # "compute" the rest
            page = request.pages[i]
            kv_page = _expected_page(tuple(tokens[:(i + 1) * ps]), shape)
            k[:, page * ps:(page + 1) * ps] = kv_page.to(device)
            v[:, page * ps:(page + 1) * ps] = -kv_page.to(device)
        request.num_computed_tokens = len(tokens)
        kv.release(request)
        tier.flush()
        for _, prefix, node in kv.cache.walk():  # every cached page holds its prefix's KV
            start = len(prefix) - len(node.key)
            for j, page in enumerate(node.value):
                expected = _expected_page(tuple(prefix[:start + (j + 1) * ps]), shape)
                assert torch.equal(k[:, page * ps:(page + 1) * ps].cpu(), expected)
                assert torch.equal(v[:, page * ps:(page + 1) * ps].cpu(), -expected)
        assert kv.allocator.num_free + kv.cache.total_pages == num_pages
        stats = tier.stats()
        loaded_before = max(loaded_before,
                            stats.get("disk_hit_tokens", 0) + stats.get("host_hit_tokens", 0))
    tier.close()
    assert loaded_before > 0  # the runs did load from the tier


def test_a_prefix_waits_for_room_rather_than_loading_in_part(tmp_path):
    """While running requests hold the pages a tier's prefix needs, the waiting request is
    told NO_ROOM and nothing is allocated (a partial load would leave the rest of its prefix
    to be computed again); once they give the pages back, the whole prefix loads. With no
    one to wait for, what fits loads."""
    from radixlm.runtime.config.sampling_params import SamplingParams
    from radixlm.runtime.scheduling.kv_manager import KVManager, TierLoad
    from radixlm.runtime.scheduling.pages import PageAllocator, ReqToTokenTable
    from radixlm.runtime.scheduling.radix_cache import RadixCache
    from radixlm.runtime.scheduling.request import Request

    ps, num_pages = 4, 12
    k = torch.randn(2, num_pages * ps, 1, 2)
    v = torch.randn_like(k)
    page_bytes = 2 * k[:, :ps].numel() * k.element_size()
    tier = HostTier(k, v, ps, max_bytes=num_pages * page_bytes)
    allocator = PageAllocator(num_pages, ps)
    kv = KVManager(allocator, ReqToTokenTable(4, num_pages * ps, ps, torch.device("cpu")),
                   RadixCache(ps, allocator), tier)

    def request(name: str, tokens: list[int]) -> Request:
        return Request(name, tokens, SamplingParams(max_new_tokens=1), frozenset(), None,
                       lambda out: None)

    def run_to_cache(r: Request) -> None:  # "compute" it all, then cache it
        assert kv.attach(r) and kv.grow(r, len(r.token_ids))
        r.num_computed_tokens = len(r.token_ids)
        kv.release(r)

    document = list(range(100, 132))  # 8 pages
    run_to_cache(request("first", document))
    tier.flush()
    kv.cache.evict(kv.cache.total_pages)  # only the host tier holds the document now
    running = request("running", list(range(500, 524)))  # holds 6 of the 12 pages
    assert kv.attach(running) and kv.grow(running, 24)

    asking = request("asking", document + [7, 8, 9, 10])
    assert kv.start_load(asking, wait_for_room=True) is TierLoad.NO_ROOM
    assert kv.loading_pages == 0 and allocator.num_free == num_pages - 6
    partial = request("partial", document + [1, 2])  # nobody to wait for: what fits loads
    assert kv.start_load(partial) is TierLoad.LOADING and kv.loading_pages == 6
    while kv.loading:
        kv.wait_for_a_load(1.0)
        kv.finish_loads()
    kv.cache.evict(kv.cache.total_pages)

    running.num_computed_tokens = 0
    kv.release(running)  # its pages come back
    assert kv.start_load(asking, wait_for_room=True) is TierLoad.LOADING
    assert kv.loading_pages == 8
    while kv.loading:
        kv.wait_for_a_load(1.0)
        kv.finish_loads()
    assert kv.attach(asking) and asking.num_computed_tokens == len(document)
    kv.release(asking)
    assert allocator.num_free + kv.cache.total_pages == num_pages
    tier.close()
