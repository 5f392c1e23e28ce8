"""Structured output in the engine core: the grammar side of grammar-constrained requests.

A request with a grammar (regex / json_schema / ebnf / json_object) is queued at once while
its grammar compiles in the background; the scheduler prefills all but its last prompt token
meanwhile, and each step attaches the grammars that became ready. A grammar that fails to
compile (or times out: the grammar engine enforces grammar_compile_timeout) fails its request
as invalid. Once attached, the tokens a grammar forces are appended without sampling (jump
forward).

`StructuredOutput` owns the grammar side only: it says what happened (a grammar attached, a
request's grammar failed, the tokens forced next) and the core acts on it, appending tokens and
finishing requests. It holds no reference back to the core, so a closed engine is freed as
soon as its last reference goes (a cycle would keep its KV pool alive until a garbage
collection).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from enum import Enum
from typing import Any

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.grammar import create_grammar_engine
from radixlm.runtime.grammar.interface import GrammarCompileError, GrammarLimitError
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.scheduling.request import Request

log = logging.getLogger(__name__)


class Compiled(Enum):
    """What became of a request whose grammar compile finished: what the core does next."""

    READY = "ready"  # its grammar is attached: jump forward, then sample
    COMPLETE = "complete"  # the grammar matches only the empty string: finish ("stop")
    FAILED = "failed"  # the compile failed (recorded on the request): finish ("abort")


class StructuredOutput:
    """Compiles and attaches requests' grammars, says which tokens a grammar forces, and
    records a request's grammar failure. Driven by the engine core's thread, except
    `grammar_engine`, which any thread may call. It never appends a token or finishes a
    request: it tells the core, which does."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int,
                 counters: Counter[str], jump_forward: bool) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.counters = counters  # the core's
        self.jump_forward_enabled = jump_forward
        self._grammar: Any = None  # GrammarEngine, built on first use
        self._grammar_init = threading.Lock()
        self.compiling: list[Request] = []  # queued while their grammar compiles

    def grammar_engine(self) -> Any:
        """The GrammarEngine, built on first use (wrapping the tokenizer takes ~0.5 s).
        Thread-safe: the offline Engine builds it in the caller's thread."""
        with self._grammar_init:
            if self._grammar is None:
                self._grammar = create_grammar_engine(self.config.grammar_backend,
                                                      self.tokenizer, self.vocab_size,
                                                      self.config)
            return self._grammar

    def start(self, request: Request) -> bool:
        """Start compiling a newly queued request's grammar. False: it cannot start (the
        failure is recorded on the request, which the core then finishes)."""
        self.counters["grammar_requests"] += 1
        if self.tokenizer is None:
            self.record_failure(request, "structured output needs a tokenizer; this model "
                                         "has none")
            return False
        request.grammar_future = self.grammar_engine().submit(GrammarSpec.of(request.params))
        self.compiling.append(request)
        return True

    def attach_compiled(self) -> list[tuple[Request, Compiled]]:
        """Give each request whose compile finished its grammar (or record its failure), in
        the order they were queued."""
        attached: list[tuple[Request, Compiled]] = []
        waiting, self.compiling = self.compiling, []
        for request in waiting:
            future = request.grammar_future
            if request.finished:
                continue
            if not future.done():
                self.compiling.append(request)
                continue
            request.grammar_future = None
            try:
                compiled = future.result()
                request.grammar = compiled.matcher()
                request.grammar_warnings = compiled.warnings
                complete = request.grammar.is_terminated
            except GrammarCompileError as exc:  # the request's own grammar is at fault
                self.record_failure(request, str(exc), invalid=True)
                attached.append((request, Compiled.FAILED))
                continue
            except Exception as exc:
                self.record_failure(request, exc)
                attached.append((request, Compiled.FAILED))
                continue
            attached.append((request, Compiled.COMPLETE if complete else Compiled.READY))
        return attached

    def wait_for_a_compile(self, timeout: float) -> None:
        """Block until one compile finishes, or `timeout` seconds."""
        wait_futures([r.grammar_future for r in self.compiling], timeout=timeout,
                     return_when=FIRST_COMPLETED)

    def forced_tokens(self, request: Request) -> list[int] | None:
        """The tokens the grammar forces next, within what the request may still generate, for
        the core to append without sampling (the next step computes them at once); [] when
        jump-forward is off for it. None: the grammar failed (recorded on the request)."""
        if not self.jump_forward_enabled or request.params.wants_logprobs:
            return []  # (forced tokens would have no logprobs)
        try:
            tokens = request.grammar.forced_tokens(request.token_ids)
        except Exception as exc:
            self.record_failure(request, exc)
            return None
        return tokens[: request.remaining_new_tokens]

    def record_failure(self, request: Request, error: str | Exception,
                       invalid: bool = False) -> None:
        """Record on the request that its grammar failed with `error`, for the core to end
        it; `invalid`: its grammar is at fault, not the engine (always so for a grammar that
        outgrew the matcher's limits)."""
        if isinstance(error, Exception):
            if isinstance(error, GrammarLimitError):
                invalid = True
                spec = GrammarSpec.of(request.params)
                error = f"{spec.kind if spec else 'grammar'}: {error}"
            else:
                error = f"grammar error: {error}"
        self.counters["grammar_errors"] += 1
        log.warning("request %s: %s", request.request_id, error)
        request.error = error
        request.error_invalid = invalid

    def close(self) -> None:
        """Stop the grammar compile workers."""
        if self._grammar is not None:
            self._grammar.close()

    def stats(self) -> dict[str, Any]:
        return {
            "grammar_requests": self.counters["grammar_requests"],
            "grammar_errors": self.counters["grammar_errors"],
            "grammar_waiting": len(self.compiling),
            "jump_forward_tokens": self.counters["jump_forward_tokens"],
        }

    def engine_stats(self) -> dict[str, Any]:
        """The grammar engine's own counters (compiles, cache hits), once it is built."""
        return self._grammar.stats() if self._grammar is not None else {}
