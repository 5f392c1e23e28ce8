"""Turning what a caller passes (text or token ids, sampling parameters, request ids) into
engine requests, validating at the boundary: every bad field raises a ValueError naming it
before anything reaches the engine thread.
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Callable, Mapping

import torch

from radixlm.runtime.config.program_tags import check_priority, check_program_id
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.engine.detokenizer import IncrementalDetokenizer
from radixlm.runtime.engine.tokenization import encode_prompt
from radixlm.runtime.scheduling.request import Output, Request


class RequestFactory:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 max_model_len: int, device: torch.device, seed: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = device
        # Requests without a seed get one from here: runs are reproducible from the engine
        # seed and the order of submission, and torch's global RNG is left alone.
        self._seeds = random.Random(seed)

    def prompts(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        """(whether one prompt was passed, the prompts as token ids) from exactly one of
        `prompt` (a string or a list of them) and `input_ids` (ids or a list of id lists)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            if not single and not isinstance(prompt, (list, tuple)):
                raise ValueError(f"prompt must be a string or a list of strings, "
                                 f"got {type(prompt).__name__}")
            texts = [prompt] if single else list(prompt)
            if not texts:
                raise ValueError("prompt: the list of prompts is empty")
            return single, [self.encode(t) for t in texts]
        if not isinstance(input_ids, (list, tuple)):
            raise ValueError(f"input_ids must be a list of ints or of lists of ints, "
                             f"got {type(input_ids).__name__}")
        single = bool(input_ids) and not isinstance(input_ids[0], (list, tuple))
        lists = [input_ids] if single or not input_ids else list(input_ids)
        return single, [self.check_ids(ids) for ids in lists]

    def encode(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string or a list of strings, "
                             f"got {type(text).__name__}")
        if not text:
            raise ValueError("prompt must not be empty")
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass input_ids")
        return encode_prompt(self.tokenizer, text)

    def check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"input_ids must be a list of ints, got {type(ids).__name__}")
        if not ids:
            raise ValueError("input_ids must not be empty")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"input_ids must hold token ids in [0, {vocab}), got {t!r}")
        return list(ids)

    def requests(self, prompts: list[list[int]], sampling_params: Any, request_id: Any,
                 cache_salt: Any, stream: bool, on_output: Callable[[Output], None],
                 first_rank: int | None = None, program_id: Any = None,
                 priority: Any = 0, loras: list[Any] | None = None) -> list[Request]:
        """One request per prompt and sample (`n`), ids "<id>#<index>" when n > 1. With a
        `first_rank`, queue ranks first_rank, first_rank + 1, ... in that order (see
        Request.queue_rank); without, rank 0 for all (one caller's batch, ordered as it came
        or by cached prefix). `loras`: each prompt's LoRA adapter (None: the base model);
        KV computed under an adapter is filed under it, apart from every other."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        check_program_id(program_id)
        check_priority(priority)
        params = _params_per_prompt(sampling_params, len(prompts))
        explicit = _explicit_max(sampling_params, len(prompts))
        ids = _request_ids(request_id, len(prompts))
        constrained = next((p for p in params if p.constrained), None)
        if constrained is not None and self.tokenizer is None:
            field = next(f for f in ("regex", "json_schema", "json_object")
                         if getattr(constrained, f))
            raise ValueError(f"{field}: structured output needs a tokenizer; this model "
                             "has none")
        for p in params:
            if p.logit_bias and p.logit_bias[-1][0] >= self.vocab_size:  # sorted by id
                raise ValueError(f"logit_bias: token id {p.logit_bias[-1][0]} is outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        requests = []
        params = [self._fit_context(p, len(ids), chosen)
                  for p, ids, chosen in zip(params, prompts, explicit)]
        loras = loras or [None] * len(prompts)
        for prompt_ids, p, rid, lora in zip(prompts, params, ids, loras):
            namespace = cache_salt if lora is None else (cache_salt, "lora", lora.digest)
            for index in range(p.n):
                requests.append(Request(
                    request_id=rid if p.n == 1 else f"{rid}#{index}",
                    prompt_ids=prompt_ids,
                    params=p,
                    eos_token_ids=self.eos_token_ids,
                    detokenizer=self._detokenizer(prompt_ids, p),
                    on_output=on_output,
                    stream=stream,
                    index=index,
                    generator=self._generator(p, index),
                    namespace=namespace,
                    lora=lora,
                    queue_rank=0 if first_rank is None else first_rank + len(requests),
                    program_id=program_id,
                    priority=priority,
                ))
        return requests

    def _fit_context(self, p: SamplingParams, prompt_len: int, explicit: bool) -> SamplingParams:
        """The server's rule (protocol.sampling_fields.fit_context): refuse a prompt, or a
        prompt plus an explicit max_new_tokens, beyond the context; clip a default
        max_new_tokens to what is left."""
        if prompt_len >= self.max_model_len:
            raise ValueError(f"prompt is {prompt_len} tokens; the context holds "
                             f"{self.max_model_len} (max_model_len), prompt included")
        allowed = p.remaining_new_tokens(0, prompt_len, self.max_model_len)
        if allowed == p.max_new_tokens:
            return p
        if explicit:
            raise ValueError(f"max_new_tokens: the prompt ({prompt_len} tokens) plus "
                             f"max_new_tokens ({p.max_new_tokens}) exceeds the context of "
                             f"{self.max_model_len} tokens (max_model_len)")
        if p.min_new_tokens > allowed:  # a minimum is asked for explicitly, always
            raise ValueError(f"min_new_tokens: the prompt ({prompt_len} tokens) plus "
                             f"min_new_tokens ({p.min_new_tokens}) exceeds the context of "
                             f"{self.max_model_len} tokens (max_model_len)")
        return p.replace(max_new_tokens=allowed)

    def _detokenizer(self, prompt_ids: list[int], p: SamplingParams) -> Any:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, p.skip_special_tokens, p.stop,
                                      p.spaces_between_special_tokens, p.no_stop_trim,
                                      p.stop_regex)

    def _generator(self, p: SamplingParams, index: int) -> torch.Generator | None:
        if p.greedy:
            return None
        seed = p.seed + index if p.seed is not None else self._seeds.getrandbits(63)
        return torch.Generator(self.device).manual_seed(seed)


def _params_per_prompt(value: Any, count: int) -> list[SamplingParams]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"sampling_params: got {len(value)} for {count} prompts")
        return [SamplingParams.coerce(v) for v in value]
    return [SamplingParams.coerce(value)] * count


def _explicit_max(value: Any, count: int) -> list[bool]:
    """Per prompt, whether its caller chose max_new_tokens (a mapping that names it, or
    SamplingParams with other than the default) rather than taking the default."""
    default = SamplingParams.__dataclass_fields__["max_new_tokens"].default
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    return [("max_new_tokens" in v) if isinstance(v, Mapping) else
            isinstance(v, SamplingParams) and v.max_new_tokens != default for v in values]


def _request_ids(value: Any, count: int) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(count)]
    ids = [value] if isinstance(value, str) else list(value)
    if len(ids) != count or not all(isinstance(i, str) and i for i in ids):
        raise ValueError(f"request_id: need {count} non-empty strings")
    return ids

