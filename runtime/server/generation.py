"""One HTTP generation request in flight: its prompts submitted to the engine, the chunks of
their samples gathered as they come, metrics recorded, and everything aborted in the engine
if the request ends early (the client went away, a handler failed, the server is draining).

    async with HttpGeneration(state, prompts, params, keys) as gen:
        async for sample, chunk in gen.chunks():   # new tokens, as the engine makes them
            ...
        # gen.samples: every sample, finished, in (prompt, index) order
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.engine_process.client import Rerun
from radixlm.runtime.engine_process.messages import Chunk, EngineError, LogprobEntry
from radixlm.runtime.grammar.spec import GRAMMAR_FIELDS
from radixlm.runtime.protocol.fields import ApiError
from radixlm.runtime.server import access_log
from radixlm.runtime.server.state import ServerState


@dataclass
class Sample:
    """One of the n samples of one prompt, accumulated from its chunks."""

    prompt_index: int
    index: int
    request_id: str  # the engine's id: the key, or "key#index" when n > 1
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_invalid: bool = False
    grammar_warnings: tuple[str, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[LogprobEntry | None] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, chunk: Chunk) -> None:
        self.text += chunk.delta
        self.token_ids += chunk.token_ids
        if chunk.logprobs:
            self.logprobs += chunk.logprobs
        self.prompt_tokens = chunk.prompt_tokens
        self.cached_tokens = chunk.cached_tokens
        if chunk.finished:
            # The engine's final text is authoritative (the deltas join to it by contract).
            self.text = chunk.text
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop
            self.error = chunk.error
            self.error_invalid = chunk.error_invalid
            self.grammar_warnings = chunk.grammar_warnings
            self.completion_tokens = chunk.completion_tokens
            self.prompt_logprobs = chunk.prompt_logprobs


class _Sink(asyncio.Queue):
    """A generation's sink. `rerunnable`: its consumer sends nothing before the end (no
    stream), so a request may still be run again from the start after it produced tokens."""

    rerunnable = False


class HttpGeneration:
    def __init__(self, state: ServerState, prompts: list[list[int]],
                 params: list[SamplingParams], keys: list[str],
                 cache_salt: str | None = None, group: str | None = None,
                 tags: dict[str, Any] | None = None,
                 loras: list[str | None] | None = None) -> None:
        self.state = state
        self.tags = tags or {}  # program_id, priority: Engine.submit_stream's keywords
        self.loras = loras or [None] * len(prompts)  # each prompt's LoRA adapter, by name
        self.prompts = prompts
        self.params = params
        self.keys = keys
        self.cache_salt = cache_salt
        self.group = group
        self.arrival = time.monotonic()
        check_samples(state, sum(p.n for p in params), f"{len(prompts)} prompt(s) times n")
        record = access_log.current()
        if record is not None:
            record.generations.append(self)
        self.samples: list[Sample] = []
        self._by_id: dict[tuple[str, int], Sample] = {}
        for i, (key, p) in enumerate(zip(keys, params)):
            for index in range(p.n):
                sample = Sample(i, index, key if p.n == 1 else f"{key}#{index}")
                self.samples.append(sample)
                self._by_id[(key, index)] = sample
        # Samples per key whose last chunk has not come: the keys to abort on an early exit.
        self._pending = {key: p.n for key, p in zip(keys, params)}
        self._sink: _Sink = _Sink()

    async def __aenter__(self) -> "HttpGeneration":
        self._admit()
        engine = self.state.engine
        rank = 0  # of this request's samples, for fair admission (Request.queue_rank)
        for key, ids, p, lora in zip(self.keys, self.prompts, self.params, self.loras):
            tags = self.tags if lora is None else {**self.tags, "lora": lora}
            engine.submit(key, ids, p, self.cache_salt, self._sink, self.group, rank, tags)
            rank += p.n
        return self

    async def __aexit__(self, *exc: Any) -> None:
        # Ended early (client gone, handler failed): stop the engine's work on what is left
        # and drop what it still sends.
        for key, pending in self._pending.items():
            if pending:
                self.state.engine.detach(key)

    def _admit(self) -> None:
        state = self.state
        state.require_engine()
        engine = state.engine
        if len(set(self.keys)) != len(self.keys):
            raise ApiError(400, "request ids must be distinct", "rid", "duplicate_id")
        for key in self.keys:
            if engine.is_tracked(key):
                raise ApiError(400, f"request id {key!r} is already in use", "rid",
                               "duplicate_id")
        state.check_room(len(self.samples))

    async def chunks(self) -> AsyncIterator[tuple[Sample, Chunk]]:
        """Each sample's chunks in order. Chunks that piled up while the consumer was busy
        come merged, one per sample (see coalesce)."""
        while any(self._pending.values()):
            items = [await self._sink.get()]
            while not self._sink.empty():
                items.append(self._sink.get_nowait())
            for key, item in coalesce(items):
                if isinstance(item, Rerun):
                    self._forget(key)
                    continue
                if isinstance(item, EngineError):
                    self._pending[key] = 0  # the engine never started it
                    raise ApiError(item.status, item.message,
                                   code="engine_error" if item.status >= 500
                                   else "invalid_value")
                sample = self._by_id[(key, item.index)]
                sample.apply(item)
                self._observe(sample, item)
                if item.finished:
                    self._pending[key] -= 1
                yield sample, item

    def _forget(self, key: str) -> None:
        """The key's request starts over: its samples are empty again."""
        i = self.keys.index(key)
        self._pending[key] = self.params[i].n
        for place, sample in enumerate(self.samples):
            if sample.prompt_index == i:
                fresh = Sample(i, sample.index, sample.request_id)
                self.samples[place] = fresh
                self._by_id[(key, sample.index)] = fresh

    async def run(self) -> list[Sample]:
        """Wait until every sample has finished."""
        self._sink.rerunnable = True  # nothing reaches the client before the end
        async for _ in self.chunks():
            pass
        return self.samples

    def _observe(self, sample: Sample, chunk: Chunk) -> None:
        m = self.state.metrics
        if chunk.token_ids:
            if sample.first_token_time is None:
                m.ttft.observe(max(0.0, chunk.time - self.arrival))
            else:
                gap = (chunk.time - sample.last_token_time) / len(chunk.token_ids)
                for _ in chunk.token_ids:
                    m.itl.observe(max(0.0, gap))
            if sample.first_token_time is None:
                sample.first_token_time = chunk.time
            sample.last_token_time = chunk.time
        if chunk.finished:
            m.generation_tokens.inc(sample.completion_tokens)
            m.finished(chunk.finish_reason)
            m.e2e.observe(max(0.0, chunk.time - self.arrival))
            if chunk.queue_time is not None:
                m.queue_time.observe(max(0.0, chunk.queue_time))
            if chunk.prefill_time is not None:
                m.prefill_time.observe(max(0.0, chunk.prefill_time))
            if sample.first_token_time is not None:
                m.decode_time.observe(max(0.0, chunk.time - sample.first_token_time))
            if sample.index == 0:  # the prompt is counted once, whatever n is
                m.prompt_tokens.inc(sample.prompt_tokens)
                m.cached_tokens.inc(sample.cached_tokens)

    def usage(self) -> dict[str, Any]:
        """OpenAI usage: each prompt counted once; completion tokens of every sample."""
        firsts = [s for s in self.samples if s.index == 0]
        prompt = sum(s.prompt_tokens for s in firsts)
        completion = sum(s.completion_tokens for s in self.samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens
                                                               for s in firsts)}}

    def failure(self) -> ApiError | None:
        """An abort nobody asked for, if any sample had one (see abort_error)."""
        for sample in self.samples:
            if sample.finish_reason == "abort" and sample.error:
                return abort_error(sample.error, sample.error_invalid)
        return None


def coalesce(items: list[tuple[str, Chunk | EngineError | Rerun]]
             ) -> list[tuple[str, Chunk | EngineError | Rerun]]:
    """Merge the chunks of each sample among `items` into one, at the place of its first:
    deltas, tokens and logprobs joined, the rest from the latest. A stream that fell behind
    (its consumer, or the client's socket, was slower than the engine) then catches up with
    one event for several tokens instead of one each, so a loaded server spends less per
    token just when it has least to spare; a stream that keeps up is not changed."""
    if len(items) == 1:
        return items
    merged: list[tuple[str, Chunk | EngineError | Rerun]] = []
    at: dict[tuple[str, int], int] = {}  # (key, sample) -> its unfinished chunk in merged
    for key, item in items:
        if isinstance(item, (EngineError, Rerun)):
            merged.append((key, item))
            if isinstance(item, Rerun):  # what comes after it starts over
                at = {k: v for k, v in at.items() if k[0] != key}
            continue
        place = at.get((key, item.index))
        if place is None:
            merged.append((key, item))
            if not item.finished:
                at[(key, item.index)] = len(merged) - 1
            continue
        earlier = merged[place][1]
        assert isinstance(earlier, Chunk)
        logprobs = (None if earlier.logprobs is None and item.logprobs is None
                    else (earlier.logprobs or []) + (item.logprobs or []))
        merged[place] = (key, dataclasses.replace(item, delta=earlier.delta + item.delta,
                                                  token_ids=earlier.token_ids + item.token_ids,
                                                  logprobs=logprobs))
        if item.finished:
            del at[(key, item.index)]
    return merged


def check_samples(state: ServerState, wanted: int, what: str, param: str = "n") -> None:
    """One request may not ask for more samples than its cap, or than the server ever holds
    (it would wait for room that never comes, or push everyone else out). `what` says where
    the count comes from."""
    cap = state.config.max_samples_per_request
    if state.info is not None:
        cap = min(cap, max(1, state.max_in_flight))
    if wanted > cap:
        raise ApiError(400, f"this request asks for {wanted} samples ({what}); this server "
                            f"takes at most {cap} per request", param, "too_many_samples")


def abort_error(error: str, invalid: bool) -> ApiError:
    """A request the engine ended with an error: 400 when the request was at fault (a grammar
    that cannot be compiled; the message starts with its field), 500 otherwise."""
    if invalid:
        field = error.split(":", 1)[0]
        return ApiError(400, error, field if field in GRAMMAR_FIELDS else None,
                        "invalid_grammar")
    return ApiError(500, f"generation failed: {error}", code="engine_error")
