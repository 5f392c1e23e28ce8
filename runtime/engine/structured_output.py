"""Structured output in the engine core: the grammar side of grammar-constrained requests.

A request with a grammar (regex / json_schema / ebnf / json_object) is queued at once while
its grammar compiles in the background; the scheduler prefills all but its last prompt token
meanwhile, and each step attaches the grammars that became ready. A grammar that fails to
compile (or times out: the grammar engine enforces grammar_compile_timeout) fails its request
as invalid. Once attached, the tokens a grammar forces are appended without sampling (jump
forward).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

from radixlm.runtime.config.engine_config import EngineConfig
from radixlm.runtime.grammar import create_grammar_engine
from radixlm.runtime.grammar.interface import GrammarCompileError, GrammarLimitError
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.scheduling.request import Request

log = logging.getLogger(__name__)


class StructuredOutput:
    """Compiles, attaches and advances requests' grammars, and fails the requests whose
    grammar goes wrong. Driven by the engine core's thread, except `grammar_engine`, which
    any thread may call. Requests change only through the core's `append_token` (a generated
    or forced token) and `finish` (the end of a request, with its reason)."""

    def __init__(self, config: EngineConfig, tokenizer: Any, vocab_size: int,
                 counters: Counter[str], jump_forward: bool,
                 append_token: Callable[[Request, int, Any], None],
                 finish: Callable[[Request, str], None]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.counters = counters  # the core's
        self.jump_forward_on = jump_forward
        self._append_token = append_token
        self._finish = finish
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

    def start(self, request: Request) -> None:
        """Start compiling a newly queued request's grammar."""
        self.counters["grammar_requests"] += 1
        if self.tokenizer is None:
            self.fail(request, "structured output needs a tokenizer; this model has none")
            return
        request.grammar_future = self.grammar_engine().submit(GrammarSpec.of(request.params))
        self.compiling.append(request)

    def attach_compiled(self) -> None:
        """Give each request whose compile finished its grammar (or its failure)."""
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
                self.fail(request, str(exc), invalid=True)
                continue
            except Exception as exc:
                self.fail(request, exc)
                continue
            if complete:  # the grammar matches only the empty string
                self._finish(request, "stop")
            else:
                self.jump_forward(request)

    def wait_for_a_compile(self, timeout: float) -> None:
        """Block until one compile finishes, or `timeout` seconds."""
        wait_futures([r.grammar_future for r in self.compiling], timeout=timeout,
                     return_when=FIRST_COMPLETED)

    def jump_forward(self, request: Request) -> None:
        """Append the tokens the grammar forces next; the next step computes them at once."""
        if not self.jump_forward_on or request.params.wants_logprobs:
            return  # (forced tokens would have no logprobs)
        try:
            tokens = request.grammar.forced_tokens(request.token_ids)
        except Exception as exc:
            self.fail(request, exc)
            return
        for token in tokens[: request.remaining_new_tokens]:
            self.counters["jump_forward_tokens"] += 1
            self._append_token(request, token, None)
            if request.finished:
                break

    def fail(self, request: Request, error: str | Exception, invalid: bool = False) -> None:
        """End the request with `error`; `invalid`: its grammar is at fault, not the engine
        (always so for a grammar that outgrew the matcher's limits)."""
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
        self._finish(request, "abort")

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
