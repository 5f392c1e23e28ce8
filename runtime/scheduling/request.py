"""Per-request state inside the engine, and the `Output` users get back.

A request's tokens are `prompt + output`; `num_computed_tokens` counts how many of them have
KV in the cache. The scheduler only ever moves that counter forward (prefill chunk, decode
step) or resets it (retraction), which is the whole scheduling state machine.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from radixlm.runtime.config.sampling_params import SamplingParams


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    # The `top_logprobs_num` most likely tokens at this position: (token_id, logprob).
    top: list[tuple[int, float]] | None = None


@dataclass
class Output:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while streaming
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # Aligned with the prompt from logprob_start_len on; the very first prompt token has
    # no logprob (None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the n samples this is
    delta: str = ""  # streaming: text added since the previous chunk
    matched_stop: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # why an aborted request was aborted, if not by the user
    # The error is the request's own fault (e.g. a grammar that cannot be compiled), not the
    # engine's: a server answers it with 400, not 500.
    error_invalid: bool = False
    # What the grammar leaves unenforced of what was asked (json_schema_strict=False only).
    grammar_warnings: tuple[str, ...] = ()
    time_to_first_token: float | None = None  # seconds from submission to the first token
    queue_time: float | None = None  # seconds from submission to admission into the batch
    lease_id: str | None = None  # the lease a prefix pin took (Engine.pin_prefix)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    detokenizer: Any  # IncrementalDetokenizer, or None when the model has no tokenizer
    on_output: Callable[[Output], None]  # called from the engine thread
    stream: bool = False
    index: int = 0
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cached_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0  # leading pages owned by the radix cache (see kv_manager)
    cache_node: Any = None  # the radix-cache node this request holds locked
    namespace: Any = None  # KV from another namespace is never reused
    # The LoRA adapter the request runs with (models.lora.adapter.LoRAAdapter; None: the
    # base model). Scheduling only counts distinct ones (max_loras_per_batch).
    lora: Any = None
    tier_names: list[str] = field(default_factory=list)  # its pages' disk-tier names, so far
    tier_checked: bool = False  # the disk tier was looked up for its prefix
    table_row: int | None = None
    admitted: bool = False  # admitted at least once (cached_tokens counts the first time)
    preempted: bool = False  # put back for another program's request ("plas"); waits by level
    # Position among the requests a server received in one HTTP request (its prompts and
    # samples); waiting requests are admitted by rank, then by arrival, so a large batch's
    # later requests let other clients' first ones in. 0 for the offline Engine's batches.
    queue_rank: int = 0
    # The program (an agent, a script of calls) this request belongs to, as its client named
    # it: the per-program statistics key. None for a request on its own.
    program_id: str | None = None
    # The program's attained service along its longest chain of calls when this request
    # arrived (ProgramStats.attained): what "plas" orders it by. Its own service adds to it.
    program_service: int = 0
    # Admission order before anything else but retracted requests: lower first (vLLM's
    # meaning); equal priorities keep the rank and arrival order.
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_invalid: bool = False  # see Output.error_invalid
    grammar_warnings: tuple[str, ...] = ()
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    admitted_time: float | None = None  # first admitted to the running batch
    first_token_time: float | None = None
    max_total_len: int = 0  # prompt + completion may not exceed this (the context length)
    # Set for a prefix pin: when the prompt is computed, its cached pages are leased for
    # this many seconds and the lease id is returned in the output.
    pin_ttl: float | None = None
    lease_id: str | None = None
    # Structured output: the compile in flight (a Future), then the GrammarMatcher that
    # masks each step's logits and follows the generated tokens.
    grammar_future: Any = None
    grammar: Any = None
    # Speculative decoding: this step's draft tokens (computed after token_ids, verified by
    # the step), the draft model's distributions for them ([k, V] on the device, or None for
    # deterministic drafts), and the request's n-gram index.
    draft_tokens: list[int] = field(default_factory=list)
    draft_probs: Any = None
    ngram_index: Any = None
    draft_length: Any = None  # a speculative.AdaptiveK: how many drafts to propose

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        start = self.prompt_logprob_start
        if start is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None] * (self.prompt_len - start)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def held_back_tokens(self) -> int:
        """Tokens the scheduler must not compute yet. While the grammar compiles, the prompt
        prefills except its last token, whose logits would need the grammar's mask."""
        return 1 if self.grammar_future is not None else 0

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens this request may still generate, at most: the length rule
        (SamplingParams.remaining_new_tokens) for its tokens so far; 0 when it is done."""
        return self.params.remaining_new_tokens(self.num_output_tokens, len(self.token_ids),
                                                self.max_total_len)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def prompt_logprob_start(self) -> int | None:
        """First prompt position whose logprob is wanted, or None."""
        start = self.params.logprob_start_len
        return None if start is None else min(start, self.prompt_len)

    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def make_output(self, delta: str = "") -> Output:
        wants = self.params.wants_logprobs
        return Output(
            request_id=self.request_id,
            text=self.text(),
            token_ids=self.output_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=self.num_output_tokens,
            cached_tokens=self.cached_tokens,
            logprobs=list(self.logprobs) if wants else None,
            prompt_logprobs=(list(self.prompt_logprobs)
                             if self.params.logprob_start_len is not None else None),
            index=self.index,
            delta=delta,
            matched_stop=self.matched_stop,
            error=self.error,
            error_invalid=self.error_invalid,
            grammar_warnings=self.grammar_warnings,
            time_to_first_token=(None if self.first_token_time is None
                                 else self.first_token_time - self.arrival_time),
            queue_time=(None if self.admitted_time is None
                        else self.admitted_time - self.arrival_time),
            lease_id=self.lease_id,
        )
