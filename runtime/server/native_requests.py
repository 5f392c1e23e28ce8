"""The native API's request and response shapes (SGLang-compatible `/generate`, plus the
routes the program language uses: pin/release a prefix, score continuations)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.config.program_tags import MAX_PRIORITY, check_program_id
from radixlm.runtime.config.sampling_params import SamplingParams
from radixlm.runtime.engine_process.messages import LogprobEntry
from radixlm.runtime.protocol.fields import Fields, bad, is_id_list, token_ids
from radixlm.runtime.protocol.sampling_fields import sampling_params
from radixlm.runtime.server.generation import Sample

GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "rid",
                   "cache_salt", "program_id", "priority", "lora_path")
MAX_BATCH = 1024
# The OpenAI routes take the program id as this header too (a client that cannot add fields).
PROGRAM_HEADER = "X-Program-Id"
MAX_LEASE_TTL = 24 * 3600.0


@dataclass
class GenerateRequest:
    texts: list[str] | None  # prompts as text, or
    input_ids: list[list[int]] | None  # as token ids
    batch: bool  # a list of prompts came in: a list goes out
    params: list[SamplingParams]  # one per prompt
    explicit_max: list[bool]  # max_new_tokens was given (so exceeding the context is a 400)
    keys: list[str]  # request ids, one per prompt
    stream: bool
    return_logprob: bool
    text_in_logprobs: bool
    cache_salt: str | None
    tags: dict[str, Any]  # program_id, priority (parse_tags)
    # Each prompt's LoRA adapter by name (SGLang's lora_path: one for all, or one per prompt)
    loras: list[str | None] | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.texts if self.texts is not None else self.input_ids or [])


def parse_tags(f: Fields, program_header: str | None = None) -> dict[str, Any]:
    """A request's `program_id` (the field, else the header's value) and `priority`."""
    program_id = f.string("program_id", program_header)
    try:
        check_program_id(program_id)
    except ValueError as exc:
        field = "program_id" if "program_id" in f.body else PROGRAM_HEADER
        raise bad(str(exc).replace("program_id", field, 1), field) from None
    return {"program_id": program_id,
            "priority": f.integer("priority", 0, lo=-MAX_PRIORITY, hi=MAX_PRIORITY)}


def one_lora(body: dict[str, Any], adapters: Any) -> str | None:
    """A request's one `lora_path` (an adapter's name, or null), checked like parse_loras."""
    if isinstance(body.get("lora_path"), list):
        raise bad("lora_path: one adapter's name is expected here, not a list", "lora_path",
                  "invalid_type")
    loras = parse_loras(body.get("lora_path"), 1, adapters)
    return None if loras is None else loras[0]


def parse_loras(value: Any, count: int, adapters: Any) -> list[str | None] | None:
    """SGLang's `lora_path`: an adapter's name for every prompt, or a list with one name (or
    null) per prompt; each must be one the server serves (`adapters`)."""
    if value is None:
        return None
    names = value if isinstance(value, list) else [value] * count
    if len(names) != count:
        raise bad(f"lora_path: got {len(names)} adapters for {count} prompts", "lora_path")
    for name in names:
        if name is not None and (not isinstance(name, str) or name not in adapters):
            known = ", ".join(sorted(adapters)) or "none"
            raise bad(f"lora_path: no adapter named {name!r:.80} is loaded (loaded: {known})",
                      "lora_path", "lora_not_found")
    return names


def parse_generate(body: dict[str, Any], vocab_size: int,
                   program_header: str | None = None,
                   adapters: Any = ()) -> GenerateRequest:
    f = Fields(body)
    f.only(GENERATE_FIELDS)
    texts, ids, batch = _prompts(f, vocab_size)
    count = len(texts if texts is not None else ids)
    return_logprob = f.boolean("return_logprob", False)
    top_n = f.integer("top_logprobs_num", 0, lo=0)
    start = f.integer("logprob_start_len", -1, lo=-1)
    raw = body.get("sampling_params")
    if raw is None:
        raw_list: list[Any] = [{}] * count
    elif isinstance(raw, dict):
        raw_list = [raw] * count
    elif isinstance(raw, list) and batch and len(raw) == count:
        raw_list = raw
    else:
        raise bad("sampling_params must be an object, or for a batch a list with one object "
                  "per prompt", "sampling_params", "invalid_type")
    # Errors name the request field: the top-level logprob fields win when they were set.
    names = ({"logprobs": "return_logprob", "top_logprobs_num": "top_logprobs_num",
              "logprob_start_len": "logprob_start_len"} if return_logprob else {})
    params, explicit = [], []
    for values in raw_list:
        if not isinstance(values, dict):
            raise bad("sampling_params must hold objects", "sampling_params", "invalid_type")
        values = _sglang_fields(dict(values))
        if return_logprob:
            values.update(logprobs=True, top_logprobs_num=top_n,
                          logprob_start_len=start if start >= 0 else None)
        params.append(sampling_params(values, names, "sampling_params."))
        explicit.append("max_new_tokens" in values)
    return GenerateRequest(texts=texts, input_ids=ids, batch=batch, params=params,
                           explicit_max=explicit, keys=_keys(f, batch, count),
                           stream=f.boolean("stream", False), return_logprob=return_logprob,
                           text_in_logprobs=f.boolean("return_text_in_logprobs", False),
                           cache_salt=f.string("cache_salt"),
                           tags=parse_tags(f, program_header),
                           loras=parse_loras(body.get("lora_path"), count, adapters))


# SGLang's /generate sampling fields that we do not implement, and why. Its frontend sends
# some of them with every request, empty: an empty value is taken as absent, any other is a
# 400 naming the field.
_SGLANG_UNSUPPORTED = {
    "custom_params": "custom logit processors are not supported",
    "beam_width": "beam search is not supported",
    "watermark": "watermarking is not supported",
}


def _sglang_fields(values: dict[str, Any]) -> dict[str, Any]:
    """SGLang's spellings of our sampling fields, in place: `sampling_seed` is `seed`;
    `stream_interval` (how many tokens per streamed event) is a hint we take as 1."""
    for name, why in _SGLANG_UNSUPPORTED.items():
        value = values.pop(name, None)
        unset = (None, [], {}, "") + ((1,) if name == "beam_width" else ())  # 1: no beams
        if value not in unset:
            raise bad(f"sampling_params.{name}: {why}", f"sampling_params.{name}",
                      "not_supported")
    if values.get("structural_tag") in (None, ""):  # SGLang's frontend sends it empty
        values.pop("structural_tag", None)
    interval = values.pop("stream_interval", None)
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int)
                                 or interval < 1):
        raise bad(f"sampling_params.stream_interval must be an integer >= 1, got {interval!r}",
                  "sampling_params.stream_interval")
    if "sampling_seed" in values:
        seed = values.pop("sampling_seed")
        if values.get("seed") is not None and seed is not None and seed != values["seed"]:
            raise bad("sampling_params: seed and sampling_seed differ",
                      "sampling_params.sampling_seed")
        if seed is not None:
            values["seed"] = seed
    return values


def _prompts(f: Fields, vocab_size: int) -> tuple[list[str] | None, list[list[int]] | None,
                                                  bool]:
    if f.has("text") == f.has("input_ids"):
        raise bad("pass exactly one of text and input_ids", "text", "missing_field")
    if f.has("text"):
        text = f.body["text"]
        if isinstance(text, str):
            texts, batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            texts, batch = text, True
        else:
            raise bad("text must be a string or a non-empty array of strings", "text",
                      "invalid_type")
        if any(not t for t in texts):
            raise bad("text must not be empty", "text")
        _check_batch(len(texts), "text")
        return texts, None, batch
    value = f.body["input_ids"]
    if is_id_list(value):
        return None, [token_ids(value, "input_ids", vocab_size)], False
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        _check_batch(len(value), "input_ids")
        return None, [token_ids(v, "input_ids", vocab_size) for v in value], True
    raise bad("input_ids must be an array of token ids or a non-empty array of such arrays",
              "input_ids", "invalid_type")


def _check_batch(count: int, param: str) -> None:
    if count > MAX_BATCH:
        raise bad(f"{param}: at most {MAX_BATCH} prompts per request, got {count}", param)


def _keys(f: Fields, batch: bool, count: int) -> list[str]:
    rid = f.body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if not batch and isinstance(rid, str) and rid:
        return [rid]
    if batch and isinstance(rid, list) and len(rid) == count and all(
            isinstance(r, str) and r for r in rid):
        return list(rid)
    what = f"an array of {count} non-empty strings" if batch else "a non-empty string"
    raise bad(f"rid must be {what}", "rid", "invalid_type")


# -- responses ---------------------------------------------------------------------------------

def finish_reason(sample: Sample) -> dict[str, Any] | None:
    reason = sample.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": sample.matched_stop}
    if reason == "length":
        return {"type": "length", "length": sample.completion_tokens}
    return {"type": "abort", "message": sample.error or "aborted"}


# The logprob lists a streamed event carries only the new entries of (SGLang's shape).
INCREMENTAL_META_KEYS = ("output_token_logprobs", "output_top_logprobs")


def result(sample: Sample, req: GenerateRequest, texts: dict[int, str],
           e2e_latency: float | None = None, logprobs_from: int = 0,
           prompt_logprobs: bool = True) -> dict[str, Any]:
    """One sample in SGLang's shape; `texts` maps token ids to their text for logprobs.
    A streamed event passes `logprobs_from`, the output logprobs sent already, to carry only
    the newer ones, and `prompt_logprobs=False` once the prompt's went out."""
    meta: dict[str, Any] = {
        "id": sample.request_id,
        "prompt_tokens": sample.prompt_tokens,
        "completion_tokens": sample.completion_tokens or len(sample.token_ids),
        "cached_tokens": sample.cached_tokens,
        "finish_reason": finish_reason(sample),
    }
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    if sample.grammar_warnings:
        meta["grammar_warnings"] = list(sample.grammar_warnings)
    if req.return_logprob:
        def entry(lp: float | None, tid: int) -> list[Any]:
            return [lp, tid, texts.get(tid) if req.text_in_logprobs else None]

        def tops(e: LogprobEntry | None) -> list[list[Any]] | None:
            return None if e is None or e[2] is None else [entry(lp, t) for t, lp in e[2]]

        new = sample.logprobs[logprobs_from:]
        meta["output_token_logprobs"] = [entry(lp, t) for t, lp, _ in new]
        meta["output_top_logprobs"] = [tops(e) for e in new]
        meta["output_token_logprobs_length"] = len(sample.logprobs)
        if sample.prompt_logprobs is not None and prompt_logprobs:
            prompt = _prompt_ids(req, sample)
            start = len(prompt) - len(sample.prompt_logprobs)
            meta["input_token_logprobs"] = [
                entry(None if e is None else e[1], prompt[start + i])
                for i, e in enumerate(sample.prompt_logprobs)]
            meta["input_top_logprobs"] = [tops(e) for e in sample.prompt_logprobs]
    return {"text": sample.text, "output_ids": sample.token_ids, "meta_info": meta}


def _prompt_ids(req: GenerateRequest, sample: Sample) -> list[int]:
    assert req.input_ids is not None  # the route fills it in after tokenizing
    return req.input_ids[sample.prompt_index]


def logprob_token_ids(samples: list[Sample]) -> set[int]:
    """Every token id a logprob entry of these samples mentions (to look up their text)."""
    ids: set[int] = set()
    for s in samples:
        for e in [*s.logprobs, *(s.prompt_logprobs or [])]:
            if e is not None:
                ids.add(e[0])
                ids.update(t for t, _ in e[2] or ())
    return ids


# -- the program-language routes ---------------------------------------------------------------

def parse_pin(body: dict[str, Any], vocab_size: int, adapters: Any = ()
              ) -> tuple[str | None, list[int] | None, str | None, float, str | None]:
    f = Fields(body)
    f.only(("text", "input_ids", "cache_salt", "ttl", "lora_path"))
    if f.has("text") == f.has("input_ids"):
        raise bad("pass exactly one of text and input_ids", "text", "missing_field")
    text = f.string("text")
    if text is not None and not text:
        raise bad("text must not be empty", "text")
    ids = None if text is not None else token_ids(body["input_ids"], "input_ids", vocab_size)
    ttl = f.number("ttl", 600.0, hi=MAX_LEASE_TTL)
    if ttl <= 0:
        raise bad(f"ttl must be a positive number of seconds, got {ttl}", "ttl")
    return text, ids, f.string("cache_salt"), float(ttl), one_lora(body, adapters)


def parse_score(body: dict[str, Any], vocab_size: int, program_header: str | None = None,
                adapters: Any = ()) -> dict[str, Any]:
    f = Fields(body)
    f.only(("prefix", "prefix_ids", "continuations", "continuation_ids", "cache_salt",
            "program_id", "priority", "lora_path"))
    if f.has("prefix") == f.has("prefix_ids"):
        raise bad("pass exactly one of prefix and prefix_ids", "prefix", "missing_field")
    if f.has("continuations") == f.has("continuation_ids"):
        raise bad("pass exactly one of continuations and continuation_ids", "continuations",
                  "missing_field")
    prefix = f.string("prefix")
    if prefix is not None and not prefix:
        raise bad("prefix must not be empty", "prefix")
    prefix_ids = (None if prefix is not None
                  else token_ids(body["prefix_ids"], "prefix_ids", vocab_size))
    texts = body.get("continuations")
    if texts is not None and not (isinstance(texts, list) and texts
                                  and all(isinstance(t, str) and t for t in texts)):
        raise bad("continuations must be a non-empty array of non-empty strings",
                  "continuations", "invalid_type")
    ids = body.get("continuation_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise bad("continuation_ids must be a non-empty array of token id arrays",
                      "continuation_ids", "invalid_type")
        ids = [token_ids(c, "continuation_ids", vocab_size) for c in ids]
    _check_batch(len(texts or ids), "continuations" if texts else "continuation_ids")
    return {"prefix": prefix, "prefix_ids": prefix_ids, "continuations": texts,
            "continuation_ids": ids, "cache_salt": f.string("cache_salt"),
            "lora": one_lora(body, adapters), **parse_tags(f, program_header)}
