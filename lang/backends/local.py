"""`rl.Engine` (`EngineBackend`): programs on the in-process engine (radixlm.runtime.Engine)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Sequence

from radixlm.backends.backend import (
    Backend,
    BackendError,
    Generation,
    OnDelta,
    Prompt,
    current_lora,
    current_program,
    logprob_meta,
)
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.engine.engine import Engine as RuntimeEngine
from radixlm.runtime.engine.tokenization import encode_prompt
from radixlm.runtime.programs.choices import ChoiceScores, document_start
from radixlm.runtime.programs.segment import GenPiece, Segment, StepResult, run_segment
from radixlm.runtime.programs.stream import SegmentStream
from radixlm.runtime.protocol import tool_formats, tool_requests
from radixlm.runtime.scheduling.request import Output, TokenLogprob

# A fork's prefix stays pinned at most this long if the program never joins (e.g. it hangs).
LEASE_TTL_S = 600.0


class EngineBackend(Backend):
    """Runs programs on an engine in this process.

    `rl.Engine()` loads the embedded default model; `rl.Engine("path/or/name", **options)`
    takes the runtime Engine's options; `rl.Engine(engine=existing)` shares an engine you
    already have. `cache_hints=False` turns off prefix pinning at forks and batch warming.
    """

    supports_cache_hints = True
    supports_segments = True

    def __init__(self, model: str | None = None, *, engine: RuntimeEngine | None = None,
                 cache_hints: bool = True, **options: Any) -> None:
        if engine is not None and (model is not None or options):
            raise TypeError("rl.Engine: pass either engine= or a model and options, not both")
        self.engine = engine if engine is not None else RuntimeEngine(model, **options)
        self._owns_engine = engine is None
        self.supports_cache_hints = cache_hints and not self.engine.config.disable_radix_cache
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("model: programs need a model with a tokenizer")

    async def agenerate(self, prompt: Prompt, params: SamplingParams,
                        on_delta: OnDelta | None = None) -> Generation:
        if params.n != 1:
            raise ValueError("n: a gen produces one completion; use s.fork(n) for several")
        if on_delta is None:
            out = await self.engine.async_generate(prompt.text, params,
                                                   **_tags())
            assert not isinstance(out, list)
        else:
            out = await self._stream(prompt.text, params, on_delta)
        return Generation(_finished(out).text, self._meta(out))

    async def _stream(self, text: str, params: SamplingParams, on_delta: OnDelta) -> Output:
        last = None
        async for delta, meta, out in self._pieces(text, params):
            if delta:
                on_delta(delta, meta)
            last = out
        assert last is not None
        return last

    async def _pieces(self, text: str, params: SamplingParams
                      ) -> AsyncIterator[tuple[str, dict[str, Any], Output]]:
        """The generation's new text as it comes, each piece with its meta (the logprobs new
        since the last piece; the prompt's with the first)."""
        sent = 0  # logprob entries passed on with earlier pieces
        async for out in self.engine.generate_stream(text, params,
                                                     **_tags()):
            meta = self._meta(out, sent, prompt=sent == 0) if out.delta else {}
            if out.delta:
                sent = len(out.logprobs or ())
            yield out.delta, meta, out

    def start_segment(self, segment: Segment) -> SegmentStream:
        return SegmentStream(run_segment(segment, _EngineOps(self)))

    def _meta(self, out: Output, logprobs_from: int = 0, prompt: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
            "matched_stop": out.matched_stop,
        }
        if out.logprobs is not None:
            new = out.logprobs[logprobs_from:]
            tops = [None if e.top is None else self._entries(e.top) for e in new]
            meta.update(logprob_meta(self._entries([(e.token_id, e.logprob) for e in new]),
                                     len(out.logprobs), tops))
        if out.prompt_logprobs is not None and prompt:
            meta["input_token_logprobs"] = self._prompt_entries(out.prompt_logprobs)
        return meta

    def _entries(self, pairs: Sequence[tuple[int, float]]) -> list[tuple[float, int, str]]:
        texts = self.tokenizer.batch_decode([[t] for t, _ in pairs]) if pairs else []
        return [(lp, t, text) for (t, lp), text in zip(pairs, texts)]

    def _prompt_entries(self, logprobs: Sequence[TokenLogprob | None]
                        ) -> list[tuple[float | None, int | None, str | None]]:
        known = self._entries([(e.token_id, e.logprob) for e in logprobs if e is not None])
        it = iter(known)
        return [(None, None, None) if e is None else next(it) for e in logprobs]

    async def ascore(self, prefix: str, choices: Sequence[str],
                     unconditional: bool) -> ChoiceScores:
        choice_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
        empty = [c for c, ids in zip(choices, choice_ids) if not ids]
        if empty:
            raise ValueError(f"choices: {empty[0]!r} encodes to no tokens")
        prefix_ids = encode_prompt(self.tokenizer, prefix) if prefix else self._no_context()
        conditional = await self.engine.async_score(prefix_ids, choice_ids, **_tags())
        prior = (await self.engine.async_score(self._no_context(), choice_ids, **_tags())
                 if unconditional else None)
        return ChoiceScores(conditional, prior)

    def _no_context(self) -> list[int]:
        return [document_start(self.tokenizer.bos_token_id, [self.tokenizer.eos_token_id])]

    async def arender_chat(self, messages: list[dict[str, Any]],
                           add_generation_prompt: bool = False) -> str | None:
        # Rendering a template is quick work in this thread: no need to leave the loop.
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            return None
        return self.engine.apply_chat_template(tool_requests.for_template(template, messages),
                                               add_generation_prompt)

    async def acall_tools(self, prompt: Prompt, tools: Any, params: SamplingParams
                          ) -> Generation:
        """As the server's chat route does it: the template's tools (or a system message
        describing them), the structural tag that holds calls to their schemas, the reply
        parsed in the template's format."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise BackendError("tool_call: the model has no chat template")
        plan = tool_requests.plan(template, prompt.messages[:-1], tools)
        text = self.engine.apply_chat_template(plan.messages, True, plan.template_tools)
        if plan.structural_tag is not None:
            params = params.replace(structural_tag=plan.structural_tag)
        trigger = tool_formats.TRIGGERS.get(plan.format or "")
        if trigger is not None and self.engine.is_special_token(trigger):
            params = params.replace(skip_special_tokens=False)  # the calls are parsed from it
        out = _finished(await self.engine.async_generate(text, params,
                                                         **_tags()))
        content, calls = (tool_formats.parse(plan.format, out.text,
                                             [t["name"] for t in tools.tools],
                                             cut=out.finish_reason == "length")
                          if plan.format else (out.text, []))
        return Generation(content, {**self._meta(out), "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
            for c in calls]})

    async def apin_prefix(self, text: str) -> Any:
        if not self.supports_cache_hints or not text:
            return None
        return await self.engine.async_pin_prefix(text, ttl=LEASE_TTL_S,
                                                  lora=current_lora.get())

    async def arelease_prefix(self, handle: Any) -> None:
        if handle is not None:  # a quick call on the engine thread, waited for off the loop
            await asyncio.to_thread(self.engine.release_prefix, handle)

    async def arelease_program(self, program_id: str) -> None:
        await asyncio.to_thread(self.engine.release_program, program_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def flush_cache(self) -> bool:
        self.engine.flush_cache()
        return True

    def server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.config.model, "max_model_len": self.engine.max_model_len,
                "stats": self.engine.stats()}

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()


class _EngineOps:
    """A segment's calls on the in-process engine: the per-call path's own."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend

    async def generate(self, text: str, params: SamplingParams,
                       stream: bool) -> AsyncIterator[GenPiece]:
        last = None
        if stream:
            async for delta, meta, out in self.backend._pieces(text, params):
                if delta:
                    yield GenPiece(delta, meta)
                last = out
        else:
            last = await self.backend.engine.async_generate(text, params,
                                                            **_tags())
        assert last is not None and not isinstance(last, list)
        yield GenPiece("", {}, StepResult(_finished(last).text, self.backend._meta(last)))

    async def score(self, prefix: str, choices: list[str], unconditional: bool) -> ChoiceScores:
        return await self.backend.ascore(prefix, choices, unconditional)


def _tags() -> dict[str, Any]:
    """What every engine call of the running program carries: its id and its adapter."""
    return {"program_id": current_program.get(), "lora": current_lora.get()}


def _finished(out: Any) -> Output:
    """The output of a finished request; an aborted one raises."""
    assert isinstance(out, Output)
    if out.finish_reason == "abort":
        raise BackendError(f"the engine aborted the request: {out.error or 'aborted'}")
    return out
