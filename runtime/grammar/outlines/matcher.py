"""outlines-core's compiled grammar (shared by every request using it) and a request's
position in it, behind the grammar-engine interface (grammar/interface.py).

The token index maps an automaton state to the tokens allowed there and the state each one
leads to. Per state we cache, lazily and once for all requests:

- the token bitmask (outlines-core writes it straight into memory, ~9 us for a short list,
  ~200 us for a state that allows most of a 49k vocabulary; a cached copy costs ~1 us);
- whether the state is terminal (accepting, nothing but EOS allowed), and the byte the state
  forces, if every allowed token starts with the same one (jump-forward follows those).

Only the engine thread touches these objects after compilation; nothing here locks.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from radixlm.runtime.grammar.interface import CompiledGrammar, GrammarError, GrammarMatcher
from radixlm.runtime.grammar.outlines.jump_forward import forced_tokens
from radixlm.runtime.grammar.outlines.vocabulary import TokenVocabulary

MAX_FORCED_BYTES = 256
# Per grammar: masks of more distinct states than this are not cached (each mask takes
# vocab/8 bytes: 6 kB for a 49k vocabulary, 16 kB for 128k).
MAX_CACHED_MASKS = 1024
# Accepted tokens a matcher can roll back (speculative drafts are shorter).
MAX_ROLLBACK = 64


class StateInfo(NamedTuple):
    final: bool  # EOS may end the output here
    terminal: bool  # final, and no token but EOS is allowed: the output is complete
    forced_byte: int | None  # every continuation starts with this byte ...
    forced_next: int | None  # ... and this is the state after it


class OutlinesGrammar(CompiledGrammar):
    def __init__(self, index: Any, vocab: TokenVocabulary, mask_words: int, regex: str,
                 compile_seconds: float = 0.0, nbytes: int = 0, tokenizer: Any = None) -> None:
        self.index = index
        self.tokenizer = tokenizer  # for jump-forward's canonical tokenization
        self.index_bytes = nbytes  # estimated memory of the index
        self.vocab = vocab
        self.mask_words = mask_words
        self.regex = regex
        self.compile_seconds = compile_seconds
        self._eos = vocab.automaton_eos
        self._masks: dict[int, np.ndarray] = {}
        self._info: dict[int, StateInfo] = {}

    @property
    def nbytes(self) -> int:
        """Estimated memory: the index and the cached masks."""
        return self.index_bytes + 4 * self.mask_words * len(self._masks)

    def matcher(self) -> "OutlinesMatcher":
        return OutlinesMatcher(self)

    def info(self, state: int, guide: Any = None) -> StateInfo:
        """What the state allows. With a guide at `state`, it is read off the state's mask
        (~10 us once the mask exists); without, off the index's token list (up to ~2 ms for
        a state that allows most of the vocabulary). Cached either way."""
        info = self._info.get(state)
        if info is None:
            info = self._info[state] = (self._info_from_mask(state, guide) if guide is not None
                                        else self._info_from_list(state))
        return info

    def _info_from_list(self, state: int) -> StateInfo:
        final = self.index.is_final_state(state)
        allowed = np.asarray(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
        allowed = allowed[(allowed != self._eos) & (allowed < self.vocab.size)]
        if final or not allowed.size:
            return StateInfo(final, final and not allowed.size, None, None)
        first = self.vocab.first_byte[allowed]
        return self._forced(state, int(first[0]), bool((first == first[0]).all()))

    def _info_from_mask(self, state: int, guide: Any) -> StateInfo:
        final = self.index.is_final_state(state)
        mask = self.mask(state, guide)
        words = np.flatnonzero(mask)
        if final or not words.size:
            return StateInfo(final, final and not words.size, None, None)
        word = int(mask[words[0]])
        first_token = 32 * int(words[0]) + (word & -word).bit_length() - 1
        byte = int(self.vocab.first_byte[first_token]) if first_token < self.vocab.size else -1
        if byte < 0:
            return StateInfo(False, False, None, None)
        others = mask & ~self.vocab.first_byte_masks(self.mask_words)[byte]
        return self._forced(state, byte, not others.any())

    def _forced(self, state: int, byte: int, all_start_with_it: bool) -> StateInfo:
        single = self.vocab.single_byte[byte] if byte >= 0 else None
        if single is None or not all_start_with_it:
            return StateInfo(False, False, None, None)
        return StateInfo(False, False, byte, self.index.get_next_state(state, single))

    def forced_bytes(self, state: int, guide: Any = None) -> bytes:
        """The bytes every continuation from `state` starts with (b"" if there is a choice).
        `guide`, if given, is at `state`."""
        out = bytearray()
        info = self.info(state, guide)
        while info.forced_byte is not None and info.forced_next is not None and \
                len(out) < MAX_FORCED_BYTES:
            out.append(info.forced_byte)
            info = self.info(info.forced_next)
        return bytes(out)

    def next_state(self, state: int, token: int) -> int | None:
        return self.index.get_next_state(state, token)

    def allows_extension(self, state: int, prefix: bytes) -> bool:
        """Is a token allowed at `state` that starts with `prefix` and is longer than it?"""
        if not self.vocab.has_token_extending(prefix):
            return False  # the cheap answer for most prefixes
        token_bytes = self.vocab.token_bytes
        for token in self.index.get_allowed_tokens(state) or ():
            b = token_bytes[token] if token < len(token_bytes) else None
            if b is not None and len(b) > len(prefix) and b.startswith(prefix):
                return True
        return False

    def mask(self, state: int, guide: Any = None) -> np.ndarray:
        """The allowed-token bitmask of `state` (uint32 words, bit i of word w is token
        32w + i), without the automaton's EOS bit. `guide`, if given, must be at `state`;
        without one (a state a request has not reached, e.g. after speculative drafts) the
        mask is built from the index's allowed-token list."""
        mask = self._masks.get(state)
        if mask is None:
            mask = np.zeros(self.mask_words, dtype=np.uint32)
            if guide is not None:
                guide.write_mask_into(mask.ctypes.data, mask.size, 4)
            else:
                tokens = np.asarray(self.index.get_allowed_tokens(state) or (), dtype=np.int64)
                tokens = tokens[tokens < self.mask_words * 32]
                np.bitwise_or.at(mask, tokens >> 5,
                                 np.left_shift(np.uint32(1), (tokens & 31).astype(np.uint32)))
            if self._eos < self.mask_words * 32:
                mask[self._eos >> 5] &= ~np.uint32(1 << (self._eos & 31))
            if len(self._masks) < MAX_CACHED_MASKS:
                self._masks[state] = mask
        return mask


class OutlinesMatcher(GrammarMatcher):
    """One request's position in a grammar: an automaton state."""

    def __init__(self, grammar: OutlinesGrammar) -> None:
        from outlines_core import Guide

        self.grammar = grammar
        self.mask_words = grammar.mask_words
        self.guide = Guide(grammar.index, MAX_ROLLBACK)
        self.state = self.guide.get_state()

    @property
    def info(self) -> StateInfo:
        return self.grammar.info(self.state, self.guide)

    @property
    def is_final(self) -> bool:
        return self.info.final

    @property
    def is_terminated(self) -> bool:
        return self.info.terminal

    def accept(self, token: int) -> None:
        if self.grammar.next_state(self.state, token) is None:
            raise GrammarError(f"token {token} is not allowed by the grammar here")
        self.guide.advance(token, return_tokens=False)
        self.state = self.guide.get_state()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.guide.rollback_state(num_tokens)
            self.state = self.guide.get_state()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        state = self.state
        for i, token in enumerate(tokens):
            if token == self.grammar.vocab.automaton_eos:
                return i  # drafts never run past an end of sequence
            state = self.grammar.next_state(state, token)
            if state is None:
                return i
        return len(tokens)

    def masks_along(self, tokens: Sequence[int]) -> tuple[np.ndarray, list[bool]]:
        # Off the index's cached per-state masks, without moving the guide.
        states = [self.state]
        for token in tokens:
            states.append(self.grammar.next_state(states[-1], token))
        rows = np.stack([self.grammar.mask(s, self.guide if i == 0 else None)
                         for i, s in enumerate(states)])
        return rows, [self.grammar.info(s).final for s in states]

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed tokens (EOS excluded) into a uint32 row of mask_words words."""
        row[:] = self.grammar.mask(self.state, self.guide)

    def forced_bytes(self) -> bytes:
        return self.grammar.forced_bytes(self.state, self.guide)

    def forced_tokens(self, token_ids: Sequence[int]) -> list[int]:
        return forced_tokens(self, token_ids, self.grammar.tokenizer)
