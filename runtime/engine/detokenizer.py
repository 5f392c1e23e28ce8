"""Incremental detokenization for streaming generation, with stop-string detection.

Two layers, each O(small) per generated token:

1. Token ids -> text. Decoding one token on its own is wrong in two ways: byte-level BPE (and
   SentencePiece byte fallback) splits one multi-byte UTF-8 character over several tokens, so a
   lone token decodes to U+FFFD; and some decoders treat the first token of a sequence
   specially (SentencePiece strips its leading space), so decode(suffix) is not the suffix of
   decode(all). Instead we keep a short window of token ids: a *context* part whose text was
   already emitted, then the *unread* tokens. Each push decodes the window with and without the
   unread tokens and emits only the difference, so the context gives the new tokens the same
   surroundings they have in the full sequence. While the decoded text ends in U+FFFD the last
   character is incomplete and we wait for more tokens.

2. Text -> final text. Stop strings are found with an Aho-Corasick automaton fed each new
   character once. Its state is the longest suffix of the text that is a prefix of some stop
   string: exactly the text that must be held back while streaming, since it may still grow
   into a stop string. Everything before it is final.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from radixlm.runtime.grammar.stop_regex import StopRegexMatcher

__all__ = ["IncrementalDetokenizer"]

# How many prompt tokens to decode as context for the first generated token. One real token is
# enough for the decoders we know of (the SentencePiece leading-space strip only touches the
# first token); a few more cost nothing and cover decoders that look further back.
_PROMPT_CONTEXT_TOKENS = 5
# A valid UTF-8 character is at most 4 bytes, and every non-special token carries at least one
# byte, so a character still incomplete after this many unread tokens never will be: the model
# produced invalid bytes. Emitting them then (as U+FFFD, as a full decode would) keeps the
# window, and so the cost of a push, bounded.
_MAX_UNREAD_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"

# Per tokenizer: ids that decode(..., skip_special_tokens=True) drops. Computed once per
# tokenizer rather than per request; weak keys so that a tokenizer can still be freed.
_SKIPPED_IDS_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skipped_special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that the tokenizer's decode drops when skip_special_tokens=True.

    The Rust backend skips added tokens flagged special; all_special_ids is the fallback for
    tokenizers without that table. Dropping these ids from the decode window up front is
    equivalent to letting decode skip them, and it keeps a run of them (padding, repeated EOS)
    from growing the window or from becoming the window's first token (which would change
    how the next real token decodes, e.g. its leading space).
    """
    try:
        return _SKIPPED_IDS_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added:
        ids = frozenset(i for i, tok in added.items() if getattr(tok, "special", False))
    else:
        ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
    try:
        _SKIPPED_IDS_CACHE[tokenizer] = ids
    except TypeError:  # not weak-referenceable: just don't cache
        pass
    return ids


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed the generated text as it grows.

    Matching is "earliest end wins": generation stops at the first character that completes any
    stop string, as it would if the text arrived one character at a time, so the result does not
    depend on how the text happens to be split into tokens. If several stop strings end at that
    character, the longest (earliest-starting) one is reported. Each character costs amortized
    O(1) whatever the number or length of the stop strings.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        # Node 0 is the root (empty string). For each node: outgoing edges, the failure link
        # (longest proper suffix that is also a node), its depth (string length), and the
        # longest stop string that is a suffix of the node's string (None if none).
        self._goto: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        self._out: list[str | None] = [None]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[node] + 1)
                    self._out.append(None)
                node = nxt
            self._out[node] = stop
        # Breadth-first, so that a node's failure target (shallower) is finished before it.
        queue = list(self._goto[0].values())
        head = 0
        while head < len(queue):
            node = queue[head]
            head += 1
            for ch, child in self._goto[node].items():
                f = self._fail[node]
                while f and ch not in self._goto[f]:
                    f = self._fail[f]
                # f is a proper suffix of node, so its child is shallower than `child`.
                self._fail[child] = self._goto[f].get(ch, 0)
                if self._out[child] is None:
                    self._out[child] = self._out[self._fail[child]]
                queue.append(child)
        self._state = 0

    @property
    def held(self) -> int:
        """Length of the longest suffix of the text fed so far that is a prefix of a stop."""
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; on the first completed stop string return (end, stop), where
        `end` is the index in `text` just past the match. The automaton must not be fed again
        after a match."""
        goto, fail, out = self._goto, self._fail, self._out
        state = self._state
        for i, ch in enumerate(text):
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            stop = out[state]
            if stop is not None:
                self._state = 0
                return i + 1, stop
        self._state = state
        return None


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, emitting only new, complete text.

    Correct for multi-byte UTF-8 characters split across tokens (byte-level BPE emits partial
    bytes; never emit U+FFFD for an incomplete character, wait for the next token), and for
    tokenizers whose decode of a suffix differs from the suffix of the decode (leading-space
    handling): decode a small window of preceding tokens as context and emit only the
    difference (prefix_offset/read_offset technique).

    The last few prompt tokens serve as context for the first generated ones, so a generated
    token that starts with a space keeps it even for decoders that strip the first token's
    leading space. Only generated text is searched for stop strings and returned.

    Stop strings (OpenAI/vLLM semantics): the text is everything before the stop string, which
    is excluded; after a match `stopped_on` is set and further pushes are ignored. While
    streaming, a suffix that could still become a stop string is held back, so the deltas from
    `take_delta` always concatenate to `text`. If stop strings overlap, the one completed first
    (earliest end; at equal ends, the longest) wins. With `keep_stop` (SGLang's no_stop_trim)
    the matched stop string ends the text instead. A `stop_regex` match ends the text with the
    token it completes in (see grammar/stop_regex.py); `stopped_on` is then the pattern.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        spaces_between_special_tokens: bool = True,
        keep_stop: bool = False,
        stop_regex: Sequence[str] = (),
    ) -> None:
        if isinstance(stop, str):  # a bare string is one stop string, not one per character
            stop = (stop,)
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_options = ({} if spaces_between_special_tokens or skip_special_tokens
                                else {"spaces_between_special_tokens": False})
        self._keep_stop = keep_stop  # a matched stop string stays in the text
        self._skipped_ids: frozenset[int] = (
            _skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()
        )

        # Layer 1 state. _window = [context tokens | unread tokens]; _read splits them.
        # _prefix_text caches decode(context) (None: stale). Until the first emission the
        # context is prompt text that was never emitted (see _emit_difference).
        context: list[int] = []
        # Scan back from the end of the prompt for a few tokens that decode will keep; bound the
        # scan so that a prompt ending in many special tokens stays cheap.
        for i in range(len(prompt_ids) - 1, max(-1, len(prompt_ids) - 64), -1):
            token = int(prompt_ids[i])
            if token not in self._skipped_ids:
                context.append(token)
                if len(context) == _PROMPT_CONTEXT_TOKENS:
                    break
        context.reverse()
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text: str | None = None
        self._context_is_prompt = True

        # Layer 2 state. _pending: decoded text not yet final (a possible stop-string start).
        # _final: final text chunks (joined lazily by `text`); _undelivered: final chunks not
        # yet returned by take_delta.
        stops = [s for s in stop if s]  # "" would match everywhere: treat as absent
        self._matcher: _StopMatcher | None = _StopMatcher(stops) if stops else None
        self._regex_matcher: StopRegexMatcher | None = None
        if stop_regex:  # imported here: llguidance loads only for requests that use it
            from radixlm.runtime.grammar.stop_regex import StopRegexMatcher

            self._regex_matcher = StopRegexMatcher(stop_regex)
        self._pending = ""
        self._final: list[str] = []
        self._undelivered: list[str] = []
        self._stopped_on: str | None = None
        self._finished = False

    # ---------------------------------------------------------------- public API

    def push(self, token_id: int) -> None:
        """Append one generated token."""
        if self._stopped_on is not None:
            return  # text after a stop string is discarded
        if self._finished:
            raise RuntimeError("push() after finish()")
        token_id = int(token_id)  # accept numpy / torch scalars
        if token_id in self._skipped_ids:
            return  # decode would drop it anyway
        self._window.append(token_id)
        unread = len(self._window) - self._read
        self._emit_difference(force=unread >= _MAX_UNREAD_TOKENS)

    @property
    def text(self) -> str:
        """All generated text so far that is final (no stop string, no held-back text)."""
        if len(self._final) > 1:
            self._final = ["".join(self._final)]  # join once, reuse on later calls
        return self._final[0] if self._final else ""

    def take_delta(self) -> str:
        """Text that became final since the last call (for streaming)."""
        if not self._undelivered:
            return ""
        delta = "".join(self._undelivered)
        self._undelivered.clear()
        return delta

    @property
    def stopped_on(self) -> str | None:
        """The stop string that matched, else None."""
        return self._stopped_on

    def finish(self) -> None:
        """Generation ended (length/eos/abort): release held-back text.

        An incomplete trailing character is emitted as U+FFFD, as a full decode would show it;
        text after a matched stop string is never released.
        """
        if self._finished:
            return
        self._finished = True
        if self._stopped_on is not None:
            return
        if len(self._window) > self._read:
            self._emit_difference(force=True)
        if self._stopped_on is None and self._pending:
            # Generation is over, so the held-back prefix can no longer become a stop string.
            self._make_final(self._pending)
            self._pending = ""

    # ---------------------------------------------------------------- layer 1: ids -> text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      **self._decode_options)

    def _emit_difference(self, force: bool) -> None:
        """Decode the window; if the unread tokens completed some text, pass it on and make
        them the context for the next tokens. `force` emits even an incomplete character."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._window[: self._read])
        prefix_text = self._prefix_text
        new_text = self._decode(self._window)
        if self._context_is_prompt:
            # The context is prompt text that was never emitted. It can differ from the start
            # of new_text when the prompt ends inside a character that the first generated
            # bytes complete (U+FFFD before, the character after): emit from where they differ.
            start = _common_prefix_len(prefix_text, new_text)
        else:
            # prefix_text was emitted already and cannot be taken back; with the decoders we
            # know of new_text always extends it.
            start = len(prefix_text)
        if not force:
            # Wait while the last character is incomplete, and while the new tokens add no
            # text: they may still combine with what follows, and dropping them from the
            # window now could change how the following tokens decode.
            if new_text.endswith(_REPLACEMENT_CHAR) or len(new_text) <= start:
                return
        self._context_is_prompt = False
        delta = new_text[start:]
        # The unread tokens become the context; the old context is no longer needed.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = None
        if delta:
            self._on_text(delta)

    # ---------------------------------------------------------------- layer 2: stop strings

    def _on_text(self, delta: str) -> None:
        # A stop_regex match keeps the whole piece it completes in (see grammar/stop_regex.py).
        regex_stop = self._regex_matcher.feed(delta) if self._regex_matcher else None
        if self._matcher is None:
            self._make_final(delta)
            if regex_stop is not None:
                self._stop(regex_stop)
            return
        buffer = self._pending + delta
        match = self._matcher.feed(delta)
        if match is not None:
            end, stop = match
            # The match ends inside delta and starts within pending + delta, because pending is
            # precisely the longest suffix that could start a stop string.
            start = len(self._pending) + end - len(stop)
            self._make_final(buffer[:start + len(stop)] if self._keep_stop else buffer[:start])
            self._pending = ""
            self._stop(stop)
            return
        if regex_stop is not None:  # no stop string ended sooner: nothing is held back now
            self._make_final(buffer)
            self._pending = ""
            self._stop(regex_stop)
            return
        keep = self._matcher.held
        cut = len(buffer) - keep
        self._make_final(buffer[:cut])
        self._pending = buffer[cut:]

    def _stop(self, matched: str) -> None:
        self._stopped_on = matched
        self._window = []  # nothing more will be decoded

    def _make_final(self, chunk: str) -> None:
        if chunk:
            self._final.append(chunk)
            self._undelivered.append(chunk)
