"""The bytes each token id stands for, built from a Hugging Face tokenizer.

A grammar constrains *bytes*, so every token must be mapped back to the exact bytes it adds to
the text. Tokenizers store tokens in their own alphabets:

- GPT-2 style byte-level BPE (SmolLM2, Llama 3, Qwen) writes each byte as a printable unicode
  character (space is "Ġ", newline "Ċ"); the map has to be inverted.
- SentencePiece (Llama 2, Mistral) writes a space as "▁" and bytes without a piece of their
  own as "<0xAB>" byte-fallback tokens.
- Added tokens are stored as their literal text in both.

Special tokens (BOS, EOS, chat markers, by the added-token `special` flag) add no text and are
left out: the grammar never allows them. EOS is handled by the engine outside the automaton.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte-to-unicode map, inverted: printable character -> byte.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 (controls,
    space, a few Latin-1 gaps) are shifted to U+0100 onwards in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(0x100 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


@dataclass
class TokenVocabulary:
    """token_bytes[i] is what token i adds to the text, or None when it adds nothing the
    grammar can use (special tokens, ids the tokenizer does not know)."""

    token_bytes: list[bytes | None]
    kind: str  # "byte_level" | "sentencepiece" | "plain"
    # The id outlines-core reports as its EOS (a special token, never in the byte map). Its
    # bit in a mask means "the automaton accepts here"; the engine maps that onto the
    # request's own EOS ids.
    automaton_eos: int
    fingerprint: str = ""
    _sorted: list[bytes] = field(default_factory=list, repr=False)
    _byte_masks: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(self.kind.encode())
        for b in self.token_bytes:
            digest.update(b"\x00" if b is None else len(b).to_bytes(2, "little") + b)
        digest.update(str(self.automaton_eos).encode())
        self.fingerprint = digest.hexdigest()[:16]
        self._sorted = sorted({b for b in self.token_bytes if b})
        # First byte of each token (-1 when it has none), and the token that is exactly one
        # byte: jump-forward walks the automaton byte by byte with these.
        first = np.full(len(self.token_bytes), -1, dtype=np.int16)
        self.single_byte: list[int | None] = [None] * 256
        for i, b in enumerate(self.token_bytes):
            if b:
                first[i] = b[0]
                if len(b) == 1 and self.single_byte[b[0]] is None:
                    self.single_byte[b[0]] = i
        self.first_byte = first

    def first_byte_masks(self, words: int) -> np.ndarray:
        """[256, words] uint32: row b has the bits of the tokens whose first byte is b."""
        cached = self._byte_masks.get(words)
        if cached is None:
            bits = np.zeros((256, words * 32), dtype=np.uint8)
            ids = np.flatnonzero(self.first_byte[: words * 32] >= 0)
            bits[self.first_byte[ids], ids] = 1
            cached = np.packbits(bits, axis=1, bitorder="little").view(np.uint32)
            self._byte_masks[words] = cached
        return cached

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def byte_map(self) -> dict[bytes, list[int]]:
        """bytes -> token ids, the form outlines-core's Vocabulary takes."""
        out: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            if b:
                out.setdefault(b, []).append(i)
        return out

    def has_token_extending(self, prefix: bytes) -> bool:
        """Is there a token that starts with `prefix` and is longer than it?"""
        i = bisect.bisect_right(self._sorted, prefix)  # skips a token equal to prefix
        return i < len(self._sorted) and self._sorted[i].startswith(prefix)

    def bytes_of(self, ids: list[int]) -> bytes | None:
        """Concatenated bytes of ids, or None if one of them has none (a special token)."""
        parts = []
        for i in ids:
            b = self.token_bytes[i] if 0 <= i < len(self.token_bytes) else None
            if b is None:
                return None
            parts.append(b)
        return b"".join(parts)


def build_vocabulary(tokenizer: Any) -> TokenVocabulary:
    """Map every token id of an HF tokenizer (fast or slow) to its bytes."""
    size = len(tokenizer)
    special = _special_ids(tokenizer)
    added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    kind = _tokenizer_kind(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    alphabet = byte_level_alphabet() if kind == "byte_level" else {}
    token_bytes: list[bytes | None] = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            token_bytes.append(None)
        elif i in added:
            token_bytes.append(added[i].encode("utf-8") or None)
        else:
            token_bytes.append(_piece_bytes(piece, kind, alphabet) or None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int) or not 0 <= eos < size or token_bytes[eos] is not None:
        # No usable EOS: any special id will do, or one past the vocabulary.
        eos = min(special) if special else size
    return TokenVocabulary(token_bytes, kind, eos)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
           if getattr(t, "special", False)}
    ids.update(getattr(tokenizer, "all_special_ids", None) or ())
    return ids


def _tokenizer_kind(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        types = _component_types(spec.get("decoder")) | _component_types(spec.get("pre_tokenizer"))
        if "ByteLevel" in types:
            return "byte_level"
        if types & {"ByteFallback", "Metaspace"} or (spec.get("model") or {}).get("byte_fallback"):
            return "sentencepiece"
        if "Replace" in types and _SPIECE_SPACE in json.dumps(spec.get("decoder")):
            return "sentencepiece"
        return "plain"
    if hasattr(tokenizer, "sp_model"):  # a slow SentencePiece tokenizer
        return "sentencepiece"
    vocab = tokenizer.get_vocab()
    if any(_SPIECE_SPACE in piece for piece in vocab):
        return "sentencepiece"
    return "byte_level" if any("\u0120" in piece for piece in vocab) else "plain"


def _component_types(component: Any) -> set[str]:
    """Every "type" inside a tokenizer.json component (Sequence components nest)."""
    if isinstance(component, dict):
        found = {component["type"]} if isinstance(component.get("type"), str) else set()
        for value in component.values():
            found |= _component_types(value)
        return found
    if isinstance(component, list):
        return set().union(*(_component_types(c) for c in component)) if component else set()
    return set()


def _piece_bytes(piece: str, kind: str, alphabet: dict[str, int]) -> bytes:
    if kind == "byte_level":
        try:
            return bytes(alphabet[c] for c in piece)
        except KeyError:  # not in the byte alphabet: a literal piece
            return piece.encode("utf-8")
    if kind == "sentencepiece":
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")
    return piece.encode("utf-8")
