"""What the HTTP process and the engine process say to each other over their pipe.

Both sides pickle plain tuples and these small dataclasses; nothing here imports torch, so the
HTTP process stays light. Messages from the engine are sent in batches (a list per send) so a
step that advances 200 requests costs one pipe write, not 200.

HTTP -> engine:
    ("generate", key, input_ids, SamplingParams, cache_salt, rank, tags)
    ("abort", key)
    ("call", call_id, method, kwargs)      pin_prefix, release_prefix, release_program, score,
                                           flush_cache, stats
    ("shutdown",)
engine -> HTTP (each send is a list of, typically all of one step's tokens):
    ("tokens", key, index, delta, token_ids, time, prompt_tokens, cached_tokens)
                                           a Chunk that is not the last and has no logprobs
                                           (most of a stream), as a plain tuple: it unpickles
                                           ten times faster than the dataclass
    ("chunk", key, Chunk)
    ("error", key, EngineError)            the request was refused before it started
    ("reply", call_id, result, EngineError | None)
    ("beat", loop_rounds, has_work)        every second (loop.BEAT_SECONDS)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# (token_id, logprob, top alternatives as [(token_id, logprob), ...] or None)
LogprobEntry = tuple[int, float, "list[tuple[int, float]] | None"]


@dataclass
class Chunk:
    """The new part of one sample's output since its previous chunk."""

    index: int  # which of the request's n samples
    delta: str  # text added since the previous chunk
    token_ids: list[int]  # tokens added since the previous chunk
    logprobs: list[LogprobEntry] | None  # their logprobs, when asked for
    time: float  # time.monotonic() in the engine process when the chunk was made
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Set on the last chunk only:
    text: str = ""  # the whole text (the deltas join to it)
    completion_tokens: int = 0
    matched_stop: str | int | None = None
    error: str | None = None  # why the engine aborted it, if nobody asked it to
    error_invalid: bool = False  # ... and it was the request's fault (its grammar)
    grammar_warnings: tuple[str, ...] = ()  # what its grammar leaves unenforced
    prompt_logprobs: list[LogprobEntry | None] | None = None
    queue_time: float | None = None  # seconds it waited for admission, in the engine
    prefill_time: float | None = None  # seconds from admission to its first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineError:
    """A request or call the engine refused (status 400: bad input) or failed on (500)."""

    status: int
    message: str


@dataclass
class EngineInfo:
    """What the engine process reports once the model is loaded."""

    max_model_len: int
    vocab_size: int
    architecture: str
    eos_token_ids: list[int]
    config: dict[str, Any]
    loras: list[dict[str, Any]] = field(default_factory=list)  # adapters served at start
