r"""`stop_regex`: end generation where the output first contains a match of a pattern.

Python's `re` backtracks, and a pattern such as `(a+)+$` over a long output takes exponential
time on the engine thread, stalling every request. So each pattern runs in llguidance's
derivative-based regex engine, which is linear in the text and builds its automaton lazily
under a fuel budget, over a byte "vocabulary" (one token per byte): the matcher for
`(?s:.)*(?:PATTERN)(?s:.)*` is accepting once the text so far contains a match, and stays so,
so a new piece of text can be fed in one call and checked once. A leading `^` ties the match
to the start of the output; a trailing `$` changes nothing (the match ends where the text so
far ends either way).

As with SGLang's `stop_regex`, the output keeps the whole text of the token in which the first
match completes: a pattern such as `Answer: \d+` then ends the output after the first token
of digits, not after the first digit.
"""

from __future__ import annotations

import functools
from typing import Sequence

import llguidance

from radixlm.runtime.grammar.regex_check import check_regex

MAX_STOP_REGEXES = 32
MAX_STOP_REGEX_CHARS = 256  # as SGLang's limits: a stop pattern is short


class _ByteVocabulary:
    """A "tokenizer" whose tokens are the 256 byte values, plus an end token llguidance
    requires."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])


@functools.lru_cache(maxsize=512)
def _template(pattern: str) -> llguidance.LLMatcher:
    """A fresh matcher for `pattern` (compiling takes ~1 ms; copies are cheap)."""
    body = check_regex(pattern, "stop_regex")
    anchored = pattern.startswith(("^", "\\A"))
    contains = f"(?:{body})(?s:.)*"
    grammar = llguidance.grammar_from("regex", contains if anchored else f"(?s:.)*{contains}")
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar)
    if matcher.is_error():
        raise ValueError(f"stop_regex {pattern!r}: {matcher.get_error()}")
    return matcher


def check_stop_regexes(patterns: Sequence[str]) -> None:
    """Raise ValueError naming the field for too many, too long or invalid patterns."""
    if len(patterns) > MAX_STOP_REGEXES:
        raise ValueError(f"stop_regex: at most {MAX_STOP_REGEXES} patterns, got {len(patterns)}")
    for pattern in patterns:
        if not pattern:
            raise ValueError("stop_regex must not contain an empty pattern")
        if len(pattern) > MAX_STOP_REGEX_CHARS:
            raise ValueError(f"stop_regex: a pattern is at most {MAX_STOP_REGEX_CHARS} "
                             f"characters, got {len(pattern)}")
        _template(pattern)


class StopRegexMatcher:
    """Fed the output text piece by piece; says which pattern the text first matches."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self._matchers = [(p, _template(p).deep_copy()) for p in patterns]

    def feed(self, text: str) -> str | None:
        """The pattern the text first matches now that `text` was added, or None. With one
        pattern the piece goes in whole; with several, a character at a time, so the one
        whose match completes first is named."""
        for part in (text,) if len(self._matchers) == 1 else text:
            data = list(part.encode())
            for entry in list(self._matchers):
                pattern, matcher = entry
                if not matcher.consume_tokens(data):
                    self._matchers.remove(entry)  # an anchored pattern that cannot match now
                elif matcher.is_accepting():
                    return pattern
        return None
