"""A made-up byte-level BPE tokenizer of any vocabulary size, for models with random weights
and no tokenizer of their own (the `load_format="dummy"` shapes, e.g. llama-3-8b, on a machine
that cannot download the real one). A server benchmark needs one: without a tokenizer the
server streams no text, so detokenization, a real cost per token, would go unmeasured.

Its shape is Llama 3's: byte-level pieces (so any id decodes, as random weights will pick any),
`vocab_size - 256` regular tokens, then 256 special ones starting with <|begin_of_text|> and
<|end_of_text|>. The regular tokens are the 256 bytes and then strings grown one character at
a time from earlier ones (each one merge of an existing token and a character), 1 to 16
characters long, mostly letters after a space as in text. Decoding one costs what decoding a
real byte-level BPE token costs; the vocabulary is deterministic.

    folder = synthetic_tokenizer(128256)     # cached in the temporary directory
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS = 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (the byte-level alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _vocabulary(regular: int, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    alphabet = _bytes_to_unicode()
    vocab = {ch: i for i, ch in enumerate(alphabet[b] for b in range(256))}
    letters = [alphabet[b] for b in b"abcdefghijklmnopqrstuvwxyz"]
    common = letters * 8 + [alphabet[b] for b in b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,'-"]
    space = alphabet[ord(" ")]
    pool = [space + ch for ch in letters] + letters
    rng = random.Random(seed)
    merges: list[tuple[str, str]] = []
    for ch in letters:  # the two-character stems: " a" ... " z"
        merges.append((space, ch))
        vocab[space + ch] = len(vocab)
    while len(vocab) < regular:
        # Short stems are picked far more often than long ones: ~5 characters on average.
        left = pool[int(len(pool) * rng.random() ** 3)]
        right = rng.choice(common)
        token = left + right
        if token in vocab or len(token) > 16:
            continue
        vocab[token] = len(vocab)
        merges.append((left, right))
        pool.append(token)
    return vocab, merges


def synthetic_tokenizer(vocab_size: int, folder: Path | None = None) -> Path:
    """A folder holding the tokenizer (built once per size, then reused)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 1024:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    folder = folder or Path(tempfile.gettempdir()) / f"radixlm-synthetic-tokenizer-{vocab_size}"
    if (folder / "tokenizer.json").is_file():
        return folder
    regular = vocab_size - SPECIAL_TOKENS
    vocab, merges = _vocabulary(regular)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(SPECIAL_TOKENS - 2)]
    tok.add_special_tokens(specials)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0],
                                      eos_token=specials[1])
    building = Path(tempfile.mkdtemp(prefix=folder.name, dir=folder.parent))
    wrapped.save_pretrained(str(building))
    (building / "synthetic.json").write_text(json.dumps({"vocab_size": vocab_size}) + "\n")
    try:
        building.rename(folder)  # whole or not at all, should two runs build it at once
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
    return folder
