"""`rl.Engine`: programs on the in-process engine (radixlm.runtime.Engine)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from radixlm.backends.base import Backend, BackendError, Generation, Prompt
from radixlm.choices import ChoiceScores
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.engine.engine import Engine as RuntimeEngine
from radixlm.runtime.engine.tokenization import encode_prompt
from radixlm.runtime.scheduling.request import Output

# A fork's prefix stays pinned at most this long if the program never joins (e.g. it hangs).
LEASE_TTL_S = 600.0


class Engine(Backend):
    """Runs programs on an engine in this process.

    `rl.Engine()` loads the embedded default model; `rl.Engine("path/or/name", **options)`
    takes the runtime Engine's options; `rl.Engine(engine=existing)` shares an engine you
    already have. `cache_hints=False` turns off prefix pinning at forks and batch warming.
    """

    supports_cache_hints = True

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

    def generate(self, prompt: Prompt, params: SamplingParams,
                 on_delta: Callable[[str], None] | None = None) -> Generation:
        if params.n != 1:
            raise ValueError("n: a gen produces one completion; use s.fork(n) for several")
        if on_delta is None:
            out = self.engine.generate(prompt.text, params)
        else:
            out = asyncio.run(self._stream(prompt.text, params, on_delta))
        return _generation(out)

    async def _stream(self, text: str, params: SamplingParams,
                      on_delta: Callable[[str], None]) -> Output:
        last = None
        async for out in self.engine.generate_stream(text, params):
            if out.delta:
                on_delta(out.delta)
            last = out
        assert last is not None
        return last

    def score(self, prefix: str, choices: Sequence[str], unconditional: bool) -> ChoiceScores:
        choice_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in choices]
        empty = [c for c, ids in zip(choices, choice_ids) if not ids]
        if empty:
            raise ValueError(f"choices: {empty[0]!r} encodes to no tokens")
        prefix_ids = encode_prompt(self.tokenizer, prefix) if prefix else self._no_context()
        conditional = self.engine.score(prefix_ids, choice_ids)
        prior = self.engine.score(self._no_context(), choice_ids) if unconditional else None
        return ChoiceScores(conditional, prior)

    def _no_context(self) -> list[int]:
        # "No context" is a document start: BOS, or EOS for models trained with EOS between
        # documents and no BOS (GPT-2 style, SmolLM2).
        tok = self.tokenizer
        start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if start is None:
            raise ValueError("choices_method: the tokenizer has neither BOS nor EOS to score "
                             "choices without context")
        return [start]

    def render_chat(self, messages: list[dict[str, str]],
                    add_generation_prompt: bool = False) -> str | None:
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        return self.engine.apply_chat_template(messages, add_generation_prompt)

    def pin_prefix(self, text: str) -> Any:
        if not self.supports_cache_hints or not text:
            return None
        return self.engine.pin_prefix(text, ttl=LEASE_TTL_S)

    def release_prefix(self, handle: Any) -> None:
        if handle is not None:
            self.engine.release_prefix(handle)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()


def _generation(out: Output) -> Generation:
    if out.finish_reason == "abort":
        raise BackendError(f"the engine aborted the request: {out.error or 'aborted'}")
    return Generation(out.text, {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason,
        "matched_stop": out.matched_stop,
        "logprobs": out.logprobs,
    })
