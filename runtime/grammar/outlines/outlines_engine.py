"""Structured output on outlines-core (`grammar_backend="outlines"`): regex and JSON Schema
compiled up front into a token automaton, in killable worker processes (compiler.py).

JSON schemas are normalised into regexes (json_schema.py) inside the worker too, so a schema
whose regex would be huge costs that worker's time and memory limits, never the engine's.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from radixlm.runtime.grammar.interface import GrammarCompileError, GrammarEngine
from radixlm.runtime.grammar.outlines.compiler import GrammarCompiler
from radixlm.runtime.grammar.outlines.vocabulary import build_vocabulary
from radixlm.runtime.grammar.spec import GrammarSpec


class OutlinesEngine(GrammarEngine):
    def __init__(self, tokenizer: Any, model_vocab_size: int, config: Any) -> None:
        self.vocab = build_vocabulary(tokenizer)
        # One bit per token id the model can emit; ids past the tokenizer's (padding) stay 0.
        mask_words = -(-model_vocab_size // 32)
        self.compiler = GrammarCompiler(
            self.vocab, mask_words, tokenizer,
            workers=config.grammar_compile_workers,
            timeout=config.grammar_compile_timeout,
            cache_size=config.grammar_cache_size,
            cache_bytes=int(config.grammar_cache_memory_gb * (1 << 30)),
            max_memory_bytes=int(config.grammar_compile_max_memory_gb * (1 << 30)),
            max_spaces=config.json_max_whitespace)

    def submit(self, spec: GrammarSpec) -> Future:
        refusal = None
        if spec.kind in ("ebnf", "structural_tag"):
            refusal = (f"{spec.kind}: needs grammar_backend='llguidance' (outlines-core "
                       "compiles regular languages only)")
        elif not spec.strict:
            refusal = "json_schema: json_schema_strict=false needs grammar_backend='llguidance'"
        if refusal is not None:
            future: Future = Future()
            future.set_exception(GrammarCompileError(refusal))
            return future
        return self.compiler.submit(spec)

    def stats(self) -> dict[str, Any]:
        return dict(self.compiler.counters)

    def close(self) -> None:
        self.compiler.close()
