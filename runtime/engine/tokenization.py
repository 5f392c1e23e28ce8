"""How prompt text becomes token ids, in one place: the offline engine, the server and the
program language all tokenize through here, so the same text always gives the same ids."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Encode a prompt, adding the tokenizer's special tokens (e.g. BOS) unless the text
    already starts with the BOS token's text, as a rendered chat template does."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (isinstance(bos, str) and bos and text.startswith(bos))
    return tokenizer.encode(text, add_special_tokens=add_special)
