"""Host memory for the weights our CPU kernel streams: transparent huge pages, and the heap a
load freed given back.

A decode step reads every weight once. On 4 KiB pages that is a TLB miss every 4 KiB (a
two-level page walk under a hypervisor), and the hardware prefetchers start over at every
page boundary; on 2 MiB pages both happen 512 times less often. The weights' tensors are
therefore carved out of anonymous mappings advised MADV_HUGEPAGE before anything touches
them, so that Linux backs them with huge pages wherever transparent huge pages are
"always" or "madvise" (the usual default). Elsewhere (THP "never", other systems) the same
calls give ordinary memory, and `RADIXLM_HUGE_PAGES=0` turns this off.

Tensors of up to a quarter of an arena share one mapping (an arena), so that the many
linears of a small model (0.5-4 MB each) sit in huge pages too; larger ones get a mapping
each. An arena is never reused: only a tensor's final owner allocates here (a temporary would
pin its bytes until every neighbour is freed), and an arena's memory returns to the system
when the last tensor in it goes.

A load makes and frees several times the model's bytes (a GGUF file's blocks decoded into
planes, the planes tiled, the tiles copied here). glibc keeps what was freed for its next
allocations and the process's resident memory stays at its peak; `return_freed_heap` gives
it back (where the C library has `malloc_trim`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
ARENA_BYTES = 32 << 20
MIN_BYTES = 64 << 10  # smaller tensors (norms, a small layer's scales) stay ordinary memory
_ALIGN = 64  # every tensor starts on a cache line

# A load's temporaries (decoded blocks, planes before tiling) are freed into the C heap, where
# the tiles kept here never reuse them: every this many bytes of new mappings the heap's free
# pages go back, which bounds a load's peak to about the model plus this much.
TRIM_BYTES = 256 << 20

_lock = threading.Lock()
_arena: torch.Tensor | None = None  # uint8, the current arena's unused tail
_mapped_since_trim = 0


def enabled() -> bool:
    return (os.environ.get("RADIXLM_HUGE_PAGES", "1") != "0"
            and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS"))


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor, in huge pages where it is large enough and the system
    allows them."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    memory = _carve(nbytes) if nbytes >= MIN_BYTES and enabled() else None
    if memory is None:
        return torch.empty(shape, dtype=dtype)
    return memory.view(dtype).view(shape)


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, in huge pages as `empty` gives them (the tensor
    itself when it is too small for them)."""
    if tensor.numel() * tensor.element_size() < MIN_BYTES or not enabled():
        return tensor.contiguous()
    out = empty(tensor.shape, tensor.dtype)
    out.copy_(tensor)
    return out


def cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat of CPU tensors along their first dimension, into memory as `empty` gives
    it."""
    if len(tensors) == 1:
        return copy_of(tensors[0])
    first = tensors[0]
    out = empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.dtype)
    return torch.cat(tensors, out=out)


def _carve(nbytes: int) -> torch.Tensor | None:
    """nbytes of uint8 in huge-page memory, or None where a mapping cannot be made."""
    global _arena
    rounded = -(-nbytes // _ALIGN) * _ALIGN
    with _lock:
        if rounded > ARENA_BYTES // 4:
            memory = _mapping(rounded)
            return None if memory is None else memory[:nbytes]
        if _arena is None or _arena.numel() < rounded:
            _arena = _mapping(ARENA_BYTES)
            if _arena is None:
                return None
        memory, _arena = _arena[:nbytes], _arena[rounded:]
        return memory


def _mapping(nbytes: int) -> torch.Tensor | None:
    """A fresh private anonymous mapping advised MADV_HUGEPAGE, as uint8 starting on a huge
    page boundary (over-allocated by one huge page; the untouched slack costs no memory)."""
    global _mapped_since_trim
    _mapped_since_trim += nbytes
    if _mapped_since_trim >= TRIM_BYTES:
        _mapped_since_trim = 0
        return_freed_heap()
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def return_freed_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op
    elsewhere)."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (None where it cannot be found)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
