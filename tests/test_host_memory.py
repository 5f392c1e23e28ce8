"""The CPU kernel's weights in huge pages (runtime/models/quantization/host_memory.py): the
tensors hold what was put in them, sit in mappings advised MADV_HUGEPAGE (small ones shared,
large ones alone), give their memory back when they go, and the switch turns it off."""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path

import pytest
import torch

from radixlm.runtime.models.quantization import host_memory
from radixlm.runtime.models.quantization.cpu_weights import CpuWeights

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux")
                                 or not hasattr(mmap, "MADV_HUGEPAGE"),
                                 reason="MADV_HUGEPAGE is Linux's")


def _mapping_of(tensor: torch.Tensor) -> dict[str, str] | None:
    """The /proc/self/smaps entry (its start, end and fields) of the mapping holding tensor."""
    address = tensor.data_ptr()
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            if entry is not None:
                return entry
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {"start": str(start), "end": str(end)} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


@needs_linux
def test_tensors_hold_their_values_in_advised_mappings_small_ones_sharing_one(monkeypatch):
    monkeypatch.setattr(host_memory, "_arena", None)  # a fresh arena holds all three
    gen = torch.Generator().manual_seed(0)
    small = [torch.randn(40_000 + 7 * i, generator=gen).to(dtype)
             for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.int32))]
    kept = [host_memory.copy_of(t.view(-1, 1)) for t in small]
    for source, copy in zip(small, kept):
        assert copy.dtype == source.dtype and copy.shape == (source.numel(), 1)
        assert copy.is_contiguous() and copy.data_ptr() % 64 == 0
        assert torch.equal(copy.view(-1), source)
    maps = [_mapping_of(t) for t in kept]
    assert all(m is not None and "hg" in m["VmFlags"].split() for m in maps)
    assert len({m["start"] for m in maps}) == 1  # one arena
    if _thp_mode() != "never":
        assert maps[0]["THPeligible"] == "1"
    large = torch.arange(3 << 20, dtype=torch.int32).view(-1, 1024)  # 12 MiB: alone
    big = host_memory.copy_of(large)
    assert torch.equal(big, large) and big.data_ptr() % host_memory.HUGE_PAGE == 0
    assert _mapping_of(big)["start"] != maps[0]["start"]
    parts = [torch.full((300, 128), float(i)) for i in range(3)]
    assert torch.equal(host_memory.cat(parts), torch.cat(parts))


@needs_linux
def test_a_mapping_is_given_back_when_its_last_tensor_goes():
    big = host_memory.empty((4 << 20,), torch.float32)
    big.fill_(1.0)
    start = _mapping_of(big)["start"]
    view = big[10:20]
    del big
    gc.collect()
    assert _mapping_of(view)["start"] == start  # a view keeps it
    address = view.data_ptr()
    del view
    gc.collect()
    entry = _mapping_of(torch.empty(0))
    assert entry is None or entry["start"] != start
    assert not any(int(m.split("-")[0], 16) <= address < int(m.split("-")[1].split()[0], 16)
                   for m in Path("/proc/self/maps").read_text().splitlines())


def test_small_tensors_and_the_switch_keep_ordinary_memory(monkeypatch):
    def no_mapping(nbytes: int) -> None:
        raise AssertionError(f"a mapping of {nbytes} bytes was made")

    monkeypatch.setattr(host_memory, "_mapping", no_mapping)
    monkeypatch.setattr(host_memory, "_arena", None)  # none left by other tests to carve from
    tiny = torch.arange(100, dtype=torch.float32)
    assert host_memory.copy_of(tiny).data_ptr() == tiny.data_ptr()  # already contiguous
    assert host_memory.empty((100,), torch.float32).numel() == 100
    monkeypatch.setenv("RADIXLM_HUGE_PAGES", "0")
    big = torch.arange(1 << 20, dtype=torch.float32)
    assert torch.equal(host_memory.copy_of(big.view(1024, 1024).t()),
                       big.view(1024, 1024).t())
    assert host_memory.empty((1 << 20,), torch.float32).shape == (1 << 20,)


@needs_linux
def test_a_linear_keeps_its_tiles_in_huge_pages_and_computes_the_same():
    if CpuWeights(dense=torch.zeros(16, 32)).kernel is None:
        pytest.skip("the CPU kernel did not build")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(512, 256, generator=gen)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    kept = CpuWeights(dense=weight)
    assert "hg" in _mapping_of(kept.dense)["VmFlags"].split()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RADIXLM_HUGE_PAGES", "0")
        plain = CpuWeights(dense=weight)
    assert torch.equal(kept.dense, plain.dense)
    assert torch.equal(kept(x), plain(x))
