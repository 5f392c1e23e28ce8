"""The engine's side of structured output: one object per engine that owns the tokenizer's
byte vocabulary and the compiler, and turns a request's grammar into a matcher."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

from radixlm.runtime.grammar.compiler import GrammarCompiler
from radixlm.runtime.grammar.jump_forward import forced_tokens
from radixlm.runtime.grammar.matcher import GrammarMatcher
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocabulary import build_vocabulary


class GrammarBackend:
    def __init__(self, tokenizer: Any, model_vocab_size: int, config: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab = build_vocabulary(tokenizer)
        # One bit per token id the model can emit; ids past the tokenizer's (padding) stay 0.
        self.mask_words = -(-model_vocab_size // 32)
        self.jump_forward = config.enable_jump_forward
        self.compiler = GrammarCompiler(
            self.vocab, self.mask_words,
            workers=config.grammar_compile_workers,
            timeout=config.grammar_compile_timeout,
            cache_size=config.grammar_cache_size,
            cache_bytes=int(config.grammar_cache_memory_gb * (1 << 30)),
            max_memory_bytes=int(config.grammar_compile_max_memory_gb * (1 << 30)),
            max_spaces=config.json_max_whitespace)

    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of the CompiledGrammar (GrammarCompileError on failure); never blocks."""
        return self.compiler.submit(spec)

    def forced_tokens(self, matcher: GrammarMatcher, token_ids: Sequence[int]) -> list[int]:
        """Jump-forward: tokens the grammar forces next, in canonical tokenization."""
        if not self.jump_forward:
            return []
        return forced_tokens(matcher, token_ids, self.tokenizer)

    def stats(self) -> dict[str, Any]:
        return dict(self.compiler.counters)

    def close(self) -> None:
        self.compiler.close()
