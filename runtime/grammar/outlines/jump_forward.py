"""Jump-forward decoding: when the grammar allows exactly one continuation (`{"name": "`,
`", "age": `), append its tokens without sampling; the next forward pass computes them all
in one step, as an extend.

The tokens must be the ones the tokenizer itself would produce, or the model sees token
sequences it never saw in training. Two boundaries need care:

- the start: the forced text is tokenized together with the last tokens already generated;
  if a token of that tokenization straddles the point where the forced text begins (the last
  generated token would merge with it), nothing is forced this time and the model samples;
- the end: the text after the forced part is still unknown, and a longer token could span the
  end (`": "` could become `": "J` once the value starts with J). Trailing tokens that an
  allowed, longer token could replace are left for the model to sample.
"""

from __future__ import annotations

from typing import Any, Sequence

# Generated tokens tokenized together with the forced text, for the start boundary.
CONTEXT_TOKENS = 2


def forced_tokens(matcher: Any, token_ids: Sequence[int], tokenizer: Any) -> list[int]:
    """Tokens to append now (possibly none), all allowed by the grammar in order; `matcher` is
    an outlines-core OutlinesMatcher."""
    forced = _whole_characters(matcher.forced_bytes())
    if not forced:
        return []
    vocab = matcher.grammar.vocab
    context = _context(token_ids, vocab)
    text = (context + forced).decode("utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    produced = vocab.bytes_of(ids)
    if produced == context + forced:
        boundary = len(context)
    elif produced == b" " + context + forced:  # a SentencePiece dummy-prefix space
        boundary = len(context) + 1
    else:
        return []  # the tokenizer normalised the text: no safe tokens
    # Skip the context's tokens; give up if one of them straddles the boundary.
    position, start = 0, 0
    while position < boundary:
        position += len(vocab.token_bytes[ids[start]])
        start += 1
    if position != boundary:
        return []
    tail = ids[start:]
    # States before each tail token; a tail the automaton rejects is not used.
    states = [matcher.state]
    for token in tail:
        nxt = matcher.grammar.next_state(states[-1], token)
        if nxt is None:
            return []
        states.append(nxt)
    # Back off from the end while an allowed token could extend past the forced text.
    keep = len(tail)
    while keep:
        suffix = vocab.bytes_of(tail[keep - 1:])
        if not matcher.grammar.allows_extension(states[keep - 1], suffix):
            break
        keep -= 1
    return tail[:keep]


def _whole_characters(data: bytes) -> bytes:
    """The longest prefix that is complete UTF-8 (a tokenizer needs text)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            data[:cut].decode("utf-8")
            return data[:cut]
        except UnicodeDecodeError:
            continue
    return b""


def _context(token_ids: Sequence[int], vocab: Any) -> bytes:
    """The bytes of the last few tokens, stopping at a special token, as whole characters."""
    chosen: list[bytes] = []
    for token in reversed(token_ids[-CONTEXT_TOKENS:]):
        b = vocab.token_bytes[token] if 0 <= token < vocab.size else None
        if b is None:
            break
        chosen.append(b)
    while chosen:
        data = b"".join(reversed(chosen))
        try:
            data.decode("utf-8")
            return data
        except UnicodeDecodeError:  # starts inside a multi-byte character: use fewer
            chosen.pop()
    return b""
