"""Structured output on llguidance (the default grammar engine).

llguidance turns a JSON Schema, a regex or a Lark grammar into a context-free grammar whose
lexer is built lazily over the tokenizer's token trie, so compiling a real-world schema takes
about a millisecond and a mask tens of microseconds. Its parser limits (lexer fuel, Earley
items, lexer states, grammar size) bound the time and memory of both, so compiles run in a
plain thread pool (llguidance releases the GIL while it builds); a compile still unfinished
after `grammar_compile_timeout` fails its requests at that moment, and its thread, which
cannot be stopped, ends within the limits.

Each distinct grammar is compiled once into a template matcher; every request gets a deep copy.
Matchers roll back, which speculative decoding uses to mask draft positions.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch

from radixlm.runtime.grammar import structural_tag
from radixlm.runtime.grammar.interface import (
    CompiledGrammar,
    GrammarCompileError,
    GrammarEngine,
    GrammarError,
    GrammarLimitError,
    GrammarMatcher,
)
from radixlm.runtime.grammar.schema_check import located_keyword, prepare_schema
from radixlm.runtime.grammar.spec import GrammarSpec

# Each lexer state takes about 1-2 kB (llguidance's own estimate).
_BYTES_PER_LEXER_STATE = 2048


class LLGuidanceEngine(GrammarEngine):
    def __init__(self, tokenizer: Any, model_vocab_size: int, config: Any) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        # The tokenizer's ids are the model's; a model whose embedding is padded past the
        # tokenizer gets masks as wide as the model's vocabulary (the extra ids never allowed).
        vocab = max(model_vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.mask_words = -(-model_vocab_size // 32)
        self._llg_words = -(-self.tokenizer.vocab_size // 32)
        self.eos_ids = sorted({*self.tokenizer.eos_tokens, self.tokenizer.eos_token})
        # Structural tags write these as tokens, not text (`<|python_tag|>`, `[TOOL_CALLS]`).
        self.special_tokens = structural_tag.special_tokens(tokenizer)
        # Masks leave EOS out (see GrammarMatcher): AND-ed into every row.
        self.no_eos_row = np.full(self.mask_words, 0xFFFFFFFF, dtype=np.uint32)
        for eos in self.eos_ids:
            if eos < 32 * self.mask_words:
                self.no_eos_row[eos >> 5] &= ~np.uint32(1 << (eos & 31))
        # A batch's masks in parallel; one thread of work is not worth a pool.
        threads = min(8, torch.get_num_threads())  # the cores the forward pass also uses
        self.executor = llguidance.LLExecutor(num_threads=threads) if threads > 1 else None
        max_states = 250_000
        if config.grammar_compile_max_memory_gb > 0:
            max_states = min(max_states, int(config.grammar_compile_max_memory_gb * (1 << 30))
                             // _BYTES_PER_LEXER_STATE)
        self.limits = llguidance.LLParserLimits(max_lexer_states=max(1000, max_states),
                                                verbose_errors=False)
        spaces = config.json_max_whitespace
        # Between JSON tokens: up to `spaces` spaces (or none), as the outlines engine allows.
        self.json_options = ({"whitespace_flexible": False} if spaces == 0 else
                             {"whitespace_pattern": f"[ ]{{0,{spaces}}}"})
        self.cache_size = config.grammar_cache_size
        self.timeout = config.grammar_compile_timeout
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.grammar_compile_workers,
                                        thread_name_prefix="radixlm-grammar")
        self.counters = {"grammar_compiles": 0, "grammar_cache_hits": 0,
                         "grammar_compile_errors": 0, "grammar_compile_timeouts": 0,
                         "grammar_compile_seconds": 0.0}

    def submit(self, spec: GrammarSpec) -> Future:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(spec)
                self.counters["grammar_cache_hits"] += 1
                return future
            future = self._start(spec)
            self._cache[spec] = future
            while len(self._cache) > self.cache_size:
                oldest = next(iter(self._cache))
                if not self._cache[oldest].done():
                    break  # requests wait on it
                del self._cache[oldest]
        return future

    def _start(self, spec: GrammarSpec) -> Future:
        """A Future that the compile completes, or the timeout fails, whichever comes first
        (failures are cached like results: a resubmission fails at once)."""
        outer: Future = Future()

        def time_out() -> None:
            error = GrammarCompileError(f"{spec.kind}: grammar compile timed out after "
                                        f"{self.timeout:g} s (grammar_compile_timeout)")
            if _settle(outer, error=error):
                self._count("grammar_compile_timeouts")

        timer = threading.Timer(self.timeout, time_out)
        timer.daemon = True

        def done(inner: Future) -> None:
            timer.cancel()
            if inner.cancelled():
                _settle(outer, error=GrammarCompileError(f"{spec.kind}: compile cancelled"))
            elif inner.exception() is not None:
                _settle(outer, error=inner.exception())
            else:
                _settle(outer, result=inner.result())

        timer.start()
        self._pool.submit(self._compile, spec).add_done_callback(done)
        return outer

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counters)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- in a pool thread ---------------------------------------------------------------------

    def _compile(self, spec: GrammarSpec) -> "LLGuidanceGrammar":
        start = time.perf_counter()
        try:
            grammar, warnings = self._grammar_text(spec)
            template = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0,
                                           limits=self.limits)
            if template.is_error():
                raise GrammarCompileError(self._explain(spec, template.get_error()))
            warnings += [self._approximated(spec, w) for w in template.get_grammar_warnings()]
        except GrammarCompileError:
            self._count("grammar_compile_errors")
            raise
        except (ValueError, RecursionError) as exc:
            self._count("grammar_compile_errors")
            raise GrammarCompileError(f"{spec.kind}: {exc}") from None
        elapsed = time.perf_counter() - start
        with self._lock:
            self.counters["grammar_compiles"] += 1
            self.counters["grammar_compile_seconds"] += elapsed
        return LLGuidanceGrammar(self, template, len(grammar), warnings)

    def _grammar_text(self, spec: GrammarSpec) -> tuple[str, list[str]]:
        """llguidance's grammar for the spec, and what was left out of it (strict=False)."""
        LLMatcher = self._llg.LLMatcher
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.source), []
        if spec.kind in ("ebnf", "structural_tag"):
            from llguidance.gbnf_to_lark import any_to_lark

            try:
                if spec.kind == "ebnf":
                    return LLMatcher.grammar_from_lark(any_to_lark(spec.source)), []
                return structural_tag.to_lark(spec.source, self.special_tokens,
                                              self.json_options), []
            except GrammarCompileError:
                raise
            except Exception as exc:  # the GBNF converter's and the schema preparer's errors
                raise GrammarCompileError(f"{spec.kind}: {exc}") from None
        if spec.kind == "json_object":
            schema, warnings = {"type": "object"}, []
        else:
            schema, warnings = prepare_schema(json.loads(spec.source), spec.strict)
        # Not strict: keywords llguidance cannot enforce are ignored and overlapping oneOf
        # branches read as anyOf; its warnings say which (reported with the output).
        options = self.json_options if spec.strict else {**self.json_options, "lenient": True,
                                                         "coerce_one_of": True}
        return LLMatcher.grammar_from_json_schema(schema, overrides=options), warnings

    @staticmethod
    def _explain(spec: GrammarSpec, error: str) -> str:
        # llguidance draws the error under the grammar's source: keep the lines that say it.
        lines = [line.strip() for line in error.strip().splitlines()]
        error = "; ".join(line for i, line in enumerate(lines)
                          if line and (i == 0 or line.startswith("error:")))
        error = error.removesuffix(": regex parse error:")
        if spec.kind == "json_schema":
            located = located_keyword(json.loads(spec.source), error)
            if located is not None:
                return (f"json_schema: keyword {located} is not supported (the output could "
                        "not be guaranteed to match it; json_schema_strict=false ignores it)")
        return f"{spec.kind}: {error}"

    @staticmethod
    def _approximated(spec: GrammarSpec, warning: str) -> str:
        located = located_keyword(json.loads(spec.source), warning)
        if located is None:
            return f"{spec.kind}: {warning}"
        return f"json_schema: keyword {located} was not enforced"

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Complete `future` unless it already is; whether this call completed it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True
    except InvalidStateError:
        return False


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, engine: LLGuidanceEngine, template: Any, grammar_chars: int,
                 warnings: list[str]) -> None:
        self.engine = engine
        self.template = template
        self._nbytes = grammar_chars
        self.warnings = tuple(warnings)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self.engine, self.template.deep_copy())


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, engine: LLGuidanceEngine, matcher: Any) -> None:
        self.engine = engine
        self.m = matcher
        self.mask_words = engine.mask_words
        # llguidance writes masks as wide as its own vocabulary; copy when the model's differs.
        self._scratch = (None if engine._llg_words == self.mask_words else
                         np.zeros(engine._llg_words, dtype=np.uint32))

    @property
    def is_final(self) -> bool:
        return self.m.is_accepting()

    @property
    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def accept(self, token: int) -> None:
        if self.m.try_consume_tokens([token]) != 1:
            self._check()
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            self._check()
            raise GrammarError(f"could not roll back {num_tokens} tokens")

    def fill_mask(self, row: np.ndarray) -> None:
        target = row if self._scratch is None else self._scratch
        self.m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        self._check()
        if self._scratch is not None:
            n = min(self.mask_words, self._scratch.size)
            row[:n] = self._scratch[:n]
            row[n:] = 0
        row &= self.engine.no_eos_row

    @classmethod
    def fill_masks(cls, matchers: Sequence[GrammarMatcher],
                   rows: np.ndarray) -> list[Exception | None]:
        """A batch's masks computed in parallel on llguidance's own threads (it releases the
        GIL), when every matcher writes rows of the model's width straight into `rows`."""
        engine = getattr(matchers[0], "engine", None) if matchers else None
        if (len(matchers) < 2 or engine is None or engine.executor is None
                or engine._llg_words != engine.mask_words or not rows.flags.c_contiguous
                or any(not isinstance(m, cls) or m.engine is not engine for m in matchers)):
            return super().fill_masks(matchers, rows)
        engine.executor.unsafe_compute_mask_ptr(
            [(m.m, i) for i, m in enumerate(matchers)], rows.ctypes.data, rows.strides[0],
            len(matchers))
        errors: list[Exception | None] = []
        for matcher in matchers:
            try:
                matcher._check()
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        rows &= engine.no_eos_row
        return errors

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        tokens = list(tokens)
        for i, token in enumerate(tokens):
            if token in self.engine.eos_ids:
                tokens = tokens[:i]  # drafts never run past an end of sequence
                break
        return self.m.validate_tokens(tokens) if tokens else 0

    def forced_tokens(self, token_ids: Sequence[int]) -> list[int]:
        forced = self.m.compute_ff_tokens()
        self._check()
        return list(forced)

    def _check(self) -> None:
        if self.m.is_error():
            raise matcher_error(self.m.get_error())


def matcher_error(error: str) -> GrammarError:
    """llguidance's error in a matcher as ours: GrammarLimitError when the grammar outgrew
    the matcher's limits while generating (the request's grammar is at fault)."""
    error = error.replace("<non-verbose/>", "").strip()
    if any(sign in error.lower() for sign in _LIMIT_SIGNS):
        return GrammarLimitError(f"the grammar grew past the matcher's limits while "
                                 f"generating ({error}); simplify it")
    return GrammarError(error)


# How llguidance's errors read when a grammar exhausts its lexer or parser limits mid-output.
_LIMIT_SIGNS = ("too many", "fuel", "too big", "limit", "exceeded")
