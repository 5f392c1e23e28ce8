"""The prefix cache's disk tier: KV pages in files under a directory, found again by the prefix
they hold, across restarts and by other processes serving the same model.

A page's file is named by the hash chain of its prefix: h(page i) = blake2b(h(page i-1),
token ids of page i), seeded with the namespace (cache salt), so a name says "the KV of these
exact tokens after exactly this prefix". The directory has one folder per model identity
(`model_key`: the weights' fingerprint, dtype, KV storage type, page size, layout, TP rank):
another model's files are never looked at.

Writes are write-through and off the engine thread: a page the tree takes is copied out of
the KV tensors at once (it may be evicted and reused right after; on a GPU the copy to host
memory runs on a stream of its own, which the writer waits for) and written by a background
thread, to a temporary file renamed into place (readers never see half a file; two processes
writing the same page both write the same bytes). The writer's queue is bounded: when the
disk falls behind, pages are skipped, not waited for. A file carries a header with its length
and a checksum of its payload: a truncated, corrupt or foreign file is skipped with a warning
and removed, never loaded as KV. Files are evicted least recently used past `max_bytes`.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MAGIC = b"RLKVPAGE1\n"
_HEADER = struct.Struct("<10sQ32s")  # magic, payload bytes, blake2b-256 of the payload
_SUFFIX = ".kv"
WRITE_QUEUE_PAGES = 4096  # pages waiting for the writer at most (their copies are in memory)
READ_THREADS = 4


class DiskTier:
    def __init__(self, directory: str | Path, model_key: str, k: torch.Tensor,
                 v: torch.Tensor, page_size: int, max_bytes: int) -> None:
        """`k`, `v`: the KV cache's tensors, [num_layers, num_slots, heads, head_dim]."""
        self.folder = Path(directory) / model_key
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"disk_cache_dir: cannot use {directory}: {exc}") from None
        self.k, self.v = k, v
        self.page_size = page_size
        self.max_bytes = max_bytes
        layers, _, heads, dim = k.shape
        self._page_shape = (layers, page_size, heads, dim)
        self.page_bytes = 2 * layers * page_size * heads * dim * k.element_size()
        # name -> bytes, least recently used first (this process's view; rescanned at start)
        self._files: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0  # their sizes, summed
        self._lock = threading.Lock()
        self._scan()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, WRITE_QUEUE_PAGES))
        self._writer = threading.Thread(target=self._write_loop, name="radixlm-disk-tier",
                                        daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="radixlm-disk-read")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="radixlm-disk-load")
        # On a GPU, pages are copied out on a stream of their own: storing never waits for
        # the compute stream's queued work (the writer thread waits for the copy instead).
        self._stream = torch.cuda.Stream(k.device) if k.is_cuda else None
        self.counters = {"disk_hit_tokens": 0, "disk_load_bytes": 0, "disk_load_seconds": 0.0,
                         "disk_store_bytes": 0, "disk_store_seconds": 0.0,
                         "disk_store_skipped_pages": 0, "disk_bad_files": 0}
        self._warned_full = False

    # ---- names ----

    def chain(self, tokens: Sequence[int], num_pages: int, namespace: Hashable = None,
              known: list[str] | None = None) -> list[str]:
        return page_names(tokens, num_pages, self.page_size, namespace, known)

    def present(self, names: Sequence[str]) -> int:
        """How many of `names`, from the first, have a file (on this disk, by any process)."""
        count = 0
        for name in names:
            if name not in self._files and not self._path(name).exists():
                break
            count += 1
        return count

    # ---- loading ----

    def load_async(self, names: Sequence[str], pages: Sequence[int]) -> Future:
        """`load` in the background: a Future of how many pages were loaded. The pages must
        be the caller's alone until it is done (nothing else reads or writes them)."""
        return self._loader.submit(self._load_in_inference_mode, list(names), list(pages))

    def _load_in_inference_mode(self, names: list[str], pages: list[int]) -> int:
        # The KV tensors may have been made in inference mode (a tensor-parallel worker's):
        # only there may they be written to.
        with torch.inference_mode():
            return self.load(names, pages)

    def load(self, names: Sequence[str], pages: Sequence[int]) -> int:
        """Read the files of `names` into `pages` of the KV cache, in order; stops at the
        first that is missing or bad. Returns how many pages were loaded."""
        start = time.perf_counter()
        loaded = 0
        # Files are read and checked in parallel (both release the GIL), copied in order.
        for name, page, payload in zip(names, pages, self._readers.map(self._read, names)):
            if payload is None:
                break
            kv = torch.frombuffer(payload, dtype=self.k.dtype).view(
                2, *self._page_shape)
            slots = slice(page * self.page_size, (page + 1) * self.page_size)
            self.k[:, slots].copy_(kv[0])
            self.v[:, slots].copy_(kv[1])
            loaded += 1
            with self._lock:
                if name in self._files:
                    self._files.move_to_end(name)
        self.counters["disk_load_bytes"] += loaded * self.page_bytes
        self.counters["disk_load_seconds"] += time.perf_counter() - start
        self.counters["disk_hit_tokens"] += loaded * self.page_size
        return loaded

    def _read(self, name: str) -> memoryview | None:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("disk KV cache: cannot read %s (%s); skipped", path, exc)
            return None
        payload = memoryview(data)[_HEADER.size:]
        if len(data) >= _HEADER.size:
            magic, size, checksum = _HEADER.unpack_from(data)
            if (magic == MAGIC and size == len(payload) == self.page_bytes
                    and hashlib.blake2b(payload, digest_size=32).digest() == checksum):
                try:
                    os.utime(path)  # recently used, for every process's eviction
                except OSError:
                    pass
                return payload
        self.counters["disk_bad_files"] += 1
        log.warning("disk KV cache: %s is truncated, corrupt or not this model's; removed",
                    path)
        self._forget(name)
        return None

    # ---- storing ----

    def store(self, names: Sequence[str], pages: Sequence[int]) -> None:
        """Write these pages (their KV as it is now) unless their files exist; returns at
        once (a background thread writes)."""
        new = [(name, page) for name, page in zip(names, pages) if name not in self._files]
        if not new:
            return
        # One gather for all of them, as bytes: [2, L, n, ps, H, D x element size].
        gathered = gather_pages(self.k, self.v, self.page_size, [page for _, page in new])
        if self._stream is None:
            kv, event = gathered, None  # a copy already: the pages may be reused at once
        else:
            kv = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(self.k.device))
            with torch.cuda.stream(self._stream):
                kv.copy_(gathered, non_blocking=True)
                gathered.record_stream(self._stream)
                event = self._stream.record_event()
        for i, (name, _) in enumerate(new):
            try:
                self._queue.put_nowait((name, kv[:, :, i], event, None))
            except queue.Full:
                self.counters["disk_store_skipped_pages"] += 1

    def store_copies(self, pages: Sequence[tuple[str, torch.Tensor, Callable[[], None]]],
                     copied: Any = None) -> None:
        """Write pages whose KV is already in host memory (a host tier's slots, in a file's
        layout [2, L, ps, H, D]) once `copied` (a CUDA event, or None) has passed, unless
        their files exist; returns at once. Each page's callback runs once its memory is no
        longer read: after its write, or at once when it is not written."""
        for name, kv, done in pages:
            if name in self._files:
                done()
                continue
            try:
                self._queue.put_nowait((name, kv, copied, done))
            except queue.Full:
                self.counters["disk_store_skipped_pages"] += 1
                done()

    def settle(self, future: Future, loaded: int) -> int:
        """The pages of a finished load that can be used: all it loaded (one process)."""
        return loaded

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the pages given to `store` so far are written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.005)

    def close(self) -> None:
        self.flush(timeout=30)
        self._queue.put(None)
        self._writer.join(timeout=5)
        self._loader.shutdown(wait=True)
        self._readers.shutdown(wait=False)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # the writer must survive anything: it is only a cache
                log.exception("disk KV cache: write failed")
            finally:
                self._queue.task_done()

    def _write(self, name: str, kv: torch.Tensor, copied: Any = None,
               done: Callable[[], None] | None = None) -> None:
        """Write one page's KV (`copied`: the CUDA event of its copy to host memory; `done`:
        called once the memory is no longer read)."""
        try:
            self._write_file(name, kv, copied)
        finally:
            if done is not None:
                done()

    def _write_file(self, name: str, kv: torch.Tensor, copied: Any) -> None:
        if copied is not None:
            copied.synchronize()
        start = time.perf_counter()
        # The bytes as they lie (no copy into a bytes object, which would hold the
        # interpreter lock for the whole page); hashing and writing release it.
        payload = kv.contiguous().view(torch.uint8).numpy().reshape(-1)
        header = _HEADER.pack(MAGIC, payload.nbytes,
                              hashlib.blake2b(payload, digest_size=32).digest())
        path = self._path(name)
        temp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        self._make_room(len(header) + payload.nbytes)
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, path)  # atomic: readers see the whole file or none
        except OSError as exc:
            temp.unlink(missing_ok=True)
            self.counters["disk_store_skipped_pages"] += 1
            if not self._warned_full:
                self._warned_full = True
                log.warning("disk KV cache: cannot write to %s (%s); pages are skipped while "
                            "this lasts", self.folder, exc)
            return
        with self._lock:
            if name not in self._files:
                self._files[name] = len(header) + payload.nbytes
                self._bytes += self._files[name]
        self.counters["disk_store_bytes"] += payload.nbytes
        self.counters["disk_store_seconds"] += time.perf_counter() - start

    def _make_room(self, size: int) -> None:
        """Remove the least recently used files until `size` more bytes fit the budget."""
        with self._lock:
            while self._files and self._bytes + size > self.max_bytes:
                name, freed = self._files.popitem(last=False)
                self._bytes -= freed
                self._path(name).unlink(missing_ok=True)

    # ---- the folder ----

    def _path(self, name: str) -> Path:
        return self.folder / (name + _SUFFIX)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._bytes -= self._files.pop(name, 0)
        self._path(name).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Index the files already there, oldest use first; remove leftover temporaries of
        writers that died mid-file."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tmp"):
                try:
                    if time.time() - entry.stat().st_mtime > 60:  # not a live writer's
                        os.unlink(entry.path)
                except OSError:
                    pass
            elif entry.name.endswith(_SUFFIX):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                found.append((stat.st_mtime, entry.name[:-len(_SUFFIX)], stat.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self._bytes += size

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counters, "disk_pages": len(self._files), "disk_bytes": self._bytes,
                    "disk_pages_total": self.max_bytes // self.page_bytes}


def page_index(pages: Sequence[int], device: torch.device) -> torch.Tensor:
    """Page numbers as an index tensor on `device`, copied from pinned memory on a GPU: a copy
    from pageable memory would wait for all the work queued on the stream."""
    index = torch.tensor(list(pages), dtype=torch.int64)
    return index if device.type != "cuda" else index.pin_memory().to(device, non_blocking=True)


def gather_pages(k: torch.Tensor, v: torch.Tensor, page_size: int,
                 pages: Sequence[int]) -> torch.Tensor:
    """Copies of `pages` of the KV tensors ([L, slots, H, D]) as bytes, in one gather on the
    current stream: [2 (k, v), L, len(pages), page_size, H, D x element size]. As bytes, any
    KV storage type gathers (float8 too)."""
    index = page_index(pages, k.device)
    raws = [t.view(torch.uint8) for t in (k, v)]
    return torch.stack([raw.view(raw.shape[0], -1, page_size, *raw.shape[2:])
                        .index_select(1, index) for raw in raws])


def page_names(tokens: Sequence[int], num_pages: int, page_size: int,
               namespace: Hashable = None, known: list[str] | None = None) -> list[str]:
    """The names of the first `num_pages` pages of `tokens`: `known` (the names of its first
    pages, computed before) extended in place."""
    names = known if known is not None else []
    digest = (bytes.fromhex(names[-1]) if names else
              hashlib.blake2b(repr(namespace).encode(), digest_size=16).digest())
    for i in range(len(names), num_pages):
        page = array.array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        digest = hashlib.blake2b(digest + page, digest_size=16).digest()
        names.append(digest.hex())
    return names[:num_pages]


def model_key(model: torch.nn.Module, kv_dtype: torch.dtype, page_size: int,
              numerics: str = "") -> str:
    """The identity of a model's KV: a fingerprint of its weights (names, shapes, dtypes and a
    strided sample of each tensor's values) with the KV layout and `numerics` (what else
    decides the KV's bits: the model's configuration, the device, the compute dtype, the
    attention kernels). Two engines that differ in any of them get different folders: KV
    computed one way is never loaded where recomputing would give other bits."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kv_dtype}|{page_size}|{numerics}".encode())
    for name, tensor in model.state_dict().items():
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
        try:
            flat = tensor.detach().reshape(-1)
            sample = flat[::max(1, flat.numel() // 4096)][:4096].to("cpu").contiguous()
            h.update(sample.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # a tensor kind with no plain bytes: its shape only
            continue
    return h.hexdigest()
