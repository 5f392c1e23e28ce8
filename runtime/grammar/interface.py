"""The grammar-engine interface: what the engine, the sampler's masks and speculative decoding
see of structured output, whichever library compiles and matches the grammar.

Two implementations: llguidance (the default: JSON Schema, regex, Lark/EBNF, built lazily by
an Earley parser over a token trie, so compiling takes milliseconds) and outlines-core (regex
and JSON Schema compiled into a token automaton up front, in killable worker processes).

A `GrammarEngine` is built once per engine for one tokenizer. `submit(spec)` never blocks: it
returns a Future of a `CompiledGrammar`, failing with `GrammarCompileError` (the request's
fault: shown to the user as a 400). Every request gets its own `GrammarMatcher` from
`CompiledGrammar.matcher()`. Only the engine thread touches matchers; nothing here locks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np

from radixlm.runtime.grammar.spec import GrammarSpec


class GrammarCompileError(ValueError):
    """A grammar that cannot be compiled or enforced; the message says why and where."""


class GrammarError(RuntimeError):
    """A token the grammar does not allow where it was appended, or a matcher in error."""


class GrammarLimitError(GrammarError):
    """A grammar that grew past the matcher's limits while generating (lexer states, fuel):
    the request's own grammar is at fault, not the engine."""


class GrammarMatcher(ABC):
    """One request's position in a grammar. Masks exclude EOS: whether EOS may be sampled is
    `is_final` combined with the request's own EOS ids and min_new_tokens (the caller's job)."""

    mask_words: int  # uint32 words per mask row: one bit per token id the model can emit

    @property
    @abstractmethod
    def is_final(self) -> bool:
        """The output may end here (EOS allowed)."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: nothing but EOS may follow."""

    @abstractmethod
    def accept(self, token: int) -> None:
        """Advance by one token; GrammarError (and no change) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts)."""

    @abstractmethod
    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed tokens here into a uint32 row of mask_words words."""

    @classmethod
    def fill_masks(cls, matchers: Sequence["GrammarMatcher"],
                   rows: np.ndarray) -> list[Exception | None]:
        """fill_mask of each matcher into its row of `rows` ([len(matchers), mask_words]).
        One matcher's failure is returned in its place and does not stop the others. Engines
        that compute masks in parallel override this."""
        errors: list[Exception | None] = []
        for matcher, row in zip(matchers, rows):
            try:
                matcher.fill_mask(row)
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        return errors

    @abstractmethod
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows in a row from here (no state change)."""

    def masks_along(self, tokens: Sequence[int]) -> tuple[np.ndarray, list[bool]]:
        """Masks and `is_final` at each of the len(tokens) + 1 positions reached by accepting
        `tokens` one by one (all allowed: see valid_prefix); the state is left unchanged."""
        rows = np.zeros((len(tokens) + 1, self.mask_words), dtype=np.uint32)
        finals = []
        accepted = 0
        try:
            for i in range(len(tokens) + 1):
                self.fill_mask(rows[i])
                finals.append(self.is_final)
                if i < len(tokens):
                    self.accept(tokens[i])
                    accepted += 1
        finally:
            self.rollback(accepted)
        return rows, finals

    @abstractmethod
    def forced_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """Jump-forward: tokens the grammar forces next, as the tokenizer would produce them
        after `token_ids` (possibly none). They are not accepted here."""


class CompiledGrammar(ABC):
    """A grammar compiled for one tokenizer, shared by every request that asks for it."""

    # What the compiled grammar does not enforce of what was asked (only when the request
    # allowed it: json_schema_strict=False); returned with each output.
    warnings: tuple[str, ...] = ()

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Estimated memory held (the cache's budget counts it)."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher: ...


class GrammarEngine(ABC):
    @abstractmethod
    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of the CompiledGrammar (GrammarCompileError on failure); never blocks."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...
