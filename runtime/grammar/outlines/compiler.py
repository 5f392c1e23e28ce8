"""outlines-core compiles off the engine loop: a thread pool, each thread driving one worker
process, and an LRU cache of results keyed by (grammar, tokenizer fingerprint). The worker
both expands a JSON schema into its regex and builds the token index, so neither can take
more than the worker's time and memory limits.

The engine calls `submit(spec)` and polls the returned Future each step; it never waits.
Identical grammars in flight share one Future, and failures are cached too, so resubmitting a
bad grammar fails at once instead of compiling again. The cache is shared by every engine in
the process (the key holds the tokenizer's fingerprint), so a second engine on the same
tokenizer reuses compiled grammars. It is bounded by entries and by memory: the index of a
large JSON schema on a 49k vocabulary can take hundreds of MB.

A compile that runs past the timeout has its worker process killed (a thread could not be
stopped and would keep a core and its memory busy); the next compile on that thread starts a
fresh worker. A worker that exceeds its memory limit dies alone.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixlm.runtime.grammar.interface import GrammarCompileError
from radixlm.runtime.grammar.outlines import compile_worker
from radixlm.runtime.grammar.outlines.matcher import OutlinesGrammar
from radixlm.runtime.grammar.outlines.vocabulary import TokenVocabulary
from radixlm.runtime.grammar.spec import GrammarSpec

# (spec, max_spaces, tokenizer fingerprint, mask width) -> Future of a OutlinesGrammar.
_CACHE: OrderedDict[tuple, Future] = OrderedDict()
_CACHE_LOCK = threading.Lock()


class GrammarCompiler:
    def __init__(self, vocab: TokenVocabulary, mask_words: int, tokenizer: Any = None, *,
                 workers: int = 2,
                 timeout: float = 30.0, cache_size: int = 64, cache_bytes: int = 1 << 30,
                 max_memory_bytes: int = 0, max_spaces: int = 1) -> None:
        self.vocab = vocab
        self.mask_words = mask_words
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.max_memory_bytes = max_memory_bytes
        self.max_spaces = max_spaces
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="radixlm-grammar")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._workers: list[_WorkerProcess] = []
        self._byte_map = vocab.byte_map()
        self.counters = {"grammar_compiles": 0, "grammar_cache_hits": 0,
                         "grammar_compile_errors": 0, "grammar_compile_timeouts": 0,
                         "grammar_compile_seconds": 0.0}

    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of the OutlinesGrammar; it fails with GrammarCompileError."""
        key = (spec, self.max_spaces, self.vocab.fingerprint, self.mask_words)
        with _CACHE_LOCK:
            future = _CACHE.get(key)
            if future is not None and not future.cancelled():
                _CACHE.move_to_end(key)
                self._count("grammar_cache_hits")
                return future
            future = self._pool.submit(self._compile, spec)
            future.radixlm_owner = self  # see close()
            _CACHE[key] = future
        future.add_done_callback(lambda _: self._trim_cache())
        return future

    def _trim_cache(self) -> None:
        """Evict least recently used entries beyond the count or the memory budget. An index
        for a large schema can take hundreds of MB, so memory is the bound that matters."""
        with _CACHE_LOCK:
            sizes = {key: _size(f) for key, f in _CACHE.items()}
            for key, size in sizes.items():  # never fits: don't push others out for it
                if size > self.cache_bytes:
                    del _CACHE[key]
            total = sum(sizes[key] for key in _CACHE)
            for key in list(_CACHE):
                if len(_CACHE) <= self.cache_size and total <= self.cache_bytes:
                    break
                if _CACHE[key].done():  # a compile in flight stays: requests wait on it
                    total -= sizes[key]
                    del _CACHE[key]

    def close(self) -> None:
        """Stop compiling. Unfinished compiles of this engine leave the shared cache, so
        another engine does not inherit their cancellation as a failure."""
        with _CACHE_LOCK:
            for key in [k for k, f in _CACHE.items()
                        if not f.done() and getattr(f, "radixlm_owner", None) is self]:
                del _CACHE[key]
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for worker in self._workers:
                worker.kill()

    # -- in a pool thread ---------------------------------------------------------------------

    def _compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        start = time.perf_counter()
        try:
            index, nbytes, regex = self._worker().compile(spec, self.max_spaces, self.timeout)
        except TimeoutError:
            self._count("grammar_compile_timeouts")
            raise GrammarCompileError(
                f"grammar compile timed out after {self.timeout:g} s "
                "(grammar_compile_timeout)") from None
        except (ValueError, GrammarCompileError) as exc:
            self._count("grammar_compile_errors")
            message = str(exc)
            if not message.startswith(spec.kind):
                message = f"{spec.kind}: {message}"
            raise GrammarCompileError(message) from None
        except Exception as exc:
            self._count("grammar_compile_errors")
            raise GrammarCompileError(f"{spec.kind}: compile failed: {exc}") from None
        elapsed = time.perf_counter() - start
        with self._lock:
            self.counters["grammar_compiles"] += 1
            self.counters["grammar_compile_seconds"] += elapsed
        return OutlinesGrammar(index, self.vocab, self.mask_words, regex, elapsed, nbytes,
                               self.tokenizer)

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def _worker(self) -> "_WorkerProcess":
        worker = getattr(self._local, "worker", None)
        if worker is None or not worker.alive:
            worker = _WorkerProcess(self.vocab.automaton_eos, self._byte_map,
                                    self.max_memory_bytes)
            self._local.worker = worker
            with self._lock:
                self._workers = [w for w in self._workers if w.alive] + [worker]
        return worker


class _WorkerProcess:
    """One compile child process; used by one pool thread at a time."""

    def __init__(self, eos: int, byte_map: dict[bytes, list[int]], memory_limit: int) -> None:
        # As a module, not by its file: a script's own folder would go first on the child's
        # sys.path, its sibling modules importable as top-level names.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", compile_worker.__name__, str(memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True)
        compile_worker.write_frame(self.proc.stdin, ("vocab", eos, byte_map))
        self._read(deadline=time.monotonic() + 120)  # "ready"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, spec: GrammarSpec, max_spaces: int, timeout: float):
        """(index, its estimated memory, the regex it was built from)."""
        compile_worker.write_frame(self.proc.stdin, ("compile", spec.kind, spec.source, max_spaces))
        reply = self._read(deadline=time.monotonic() + timeout)
        if reply[0] == "error":
            raise GrammarCompileError(reply[1])
        # In memory an index takes about twice its serialized size (hash tables).
        return pickle.loads(reply[1]), 2 * len(reply[1]), reply[3]

    def _read(self, deadline: float) -> tuple:
        stream = self.proc.stdout
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(0.0, remaining))
        if not ready:
            self.kill()
            raise TimeoutError
        message = compile_worker.read_frame(stream)
        if message is None:  # the child died: killed by the memory limit, or crashed
            code = self.proc.wait()
            raise GrammarCompileError(f"the compile worker died (exit code {code}); the "
                                      "grammar probably needs more memory than "
                                      "grammar_compile_max_memory_gb allows")
        return message

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def _size(future: Future) -> int:
    """Memory held by a cache entry (0 until compiled, or when it failed)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return 0
    return future.result().nbytes
